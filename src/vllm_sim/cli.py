"""`epp sim`: serve one simulated vLLM pod until SIGINT or SIGTERM.

On startup one JSON line goes to stderr with the addresses actually bound (so `--port 0`
and `--kv-events-port 0` work for scripts that start many pods), whatever the log level.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import zmq

from vllm_sim import presets
from vllm_sim.engine import DEFAULT_LORA_RANK, EngineConfig
from vllm_sim.failures import FAIL_HEADER, FailureConfig, FailureKind, parse_kinds
from vllm_sim.kv_publisher import DEFAULT_REPLAY_BUFFER, KvEventsConfig
from vllm_sim.server import SimPodConfig, start_pod

DEFAULT_MODEL = "sim-llama-8b"

# Engine flags: (flag, EngineConfig field, multiplier from the flag's unit to the field's).
_ENGINE_FLAGS: tuple[tuple[str, str, float], ...] = (
    ("block_size", "block_size", 1),
    ("num_gpu_blocks", "num_gpu_blocks", 1),
    ("max_num_seqs", "max_num_seqs", 1),
    ("max_waiting", "max_waiting", 1),
    ("max_loras", "max_loras", 1),
    ("max_num_batched_tokens", "max_num_batched_tokens", 1),
    ("prefill_overhead_ms", "prefill_overhead_s", 0.001),
    ("prefill_per_token_ms", "prefill_per_token_s", 0.001),
    ("prefill_per_cached_token_ms", "prefill_per_cached_token_s", 0.001),
    ("decode_per_token_ms", "decode_per_token_s", 0.001),
    ("batch_slowdown", "batch_slowdown", 1),
    ("lora_load_ms", "lora_load_s", 0.001),
)

_EPILOG = f"""\
presets (--preset; sources in vllm_sim/presets.py):
{chr(10).join(f"  {name:15s} {presets.preset(name).description}" for name in presets.names())}

LoRA:
  --lora-adapters sql:64,chat serves two adapters from startup (rank 64 and the default
  {DEFAULT_LORA_RANK}). Loading an adapter that is not resident costs
  lora-load-ms x rank / 16 (200 ms at rank 16 and 800 ms at rank 64 by default).
  At runtime, as vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING:
    POST /v1/load_lora_adapter   {{"lora_name": "x", "lora_path": "/p", "rank": 16}}
    POST /v1/unload_lora_adapter {{"lora_name": "x"}}
  ("rank" is a simulator extension; 16 when absent.)

KV-cache events (vLLM's ZMQ format):
  --kv-events-port P publishes [topic, seq (8 bytes BE), msgpack batch] on a PUB socket,
  topic kv@<host>:<port>@<model> unless --kv-events-topic; --kv-replay-port R serves
  replays on a ROUTER socket as vLLM 0.32 does ([b"", start seq] ->
  [b"", topic, seq, batch]..., [b"", b"", ff*8, b""]). As in vLLM, full blocks of
  generated tokens are cached and announced too (when the request finishes), a
  recomputed block is announced again under its hash, and a reset's AllBlocksCleared
  goes out with the next batch. "return_token_ids": true returns the token ids.
  GET /sim/kv lists the engine's cached block hashes (each once, hex): what a router
  following these events should hold for the pod.

failure injection (for testing routers):
  header {FAIL_HEADER}: {"|".join(k.value for k in FailureKind)}
    on /v1/completions, /v1/chat/completions and /metrics forces one failure:
    429/500/503 answer at once in vLLM's error shape; hang takes a slot and never
    answers (the slot is freed when the client gives up); drop closes the connection
    when the first token is ready (streams: after its chunk); slow-metrics delays that
    /metrics by --metrics-delay-ms (2000 ms when 0).
  --failure-rate F --failure-kinds 429,500,503 [--seed S]: the same, at random, on a
    fraction F of the generation requests (kinds: 429, 500, 503, hang, drop).
  --metrics-delay-ms N: every /metrics answers N wall-clock ms late.
  POST /sim/fail {{"health": 503 | null, "metrics": "garbage" | "hang" | "frozen" | null,
    "tokenize": "garbage" | "hang" | "error" | null, "generation": "500" | "hang" | ... |
    null, "delay_ms": N, "kv_events": "drop" | "reorder" | "duplicate" | null}}: /health
    answers that status, /metrics answers garbage, never, or its page of that moment again
    and again, POST /tokenize garbage, never or 500, every generation request fails that
    way or starts N ms late, KV-event batches are lost, swapped in pairs or sent twice;
    null switches back, a key left out stays as it is. GET /sim/fail shows the switches.
  POST /sim/kv/restart: the KV-event publisher restarts (sequence from the start, replay
    buffer empty) while the engine keeps its blocks.
  Responses produced by an injected failure carry x-sim-injected-failure: <kind>.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    tiny = EngineConfig()
    parser = argparse.ArgumentParser(
        prog="epp sim",
        description=(
            "Serve one simulated vLLM pod: OpenAI completions and chat (streaming or not), "
            "/metrics in vLLM 0.33's format, /health, /v1/models, /reset_prefix_cache and "
            "runtime LoRA loading. It models a KV cache with prefix reuse and LRU eviction, "
            "a waiting queue, running slots, LoRA slots, and latency from uncached prompt "
            "tokens, with prefills sharing the pod's compute first come first served and "
            "slowing the decode steps they share; it can publish vLLM's KV-cache events "
            "over ZMQ and inject failures. "
            "Engine flags default to the preset's values (--preset, default tiny) and "
            "override them one by one."
        ),
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )
    net = parser.add_argument_group("serving")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on")
    net.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    net.add_argument("--name", default="pod-0", help="pod name, sent in every x-sim-pod header")
    net.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a real model's tokenizer files (tokenizer.json, tokenizer_config.json with its"
        " chat template) for prompt token ids and block hashes (default: the simulator's own)",
    )
    net.add_argument(
        "--preset",
        default=presets.DEFAULT_PRESET,
        choices=presets.names(),
        help="GPU and model to imitate (see below)",
    )
    net.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        help=f"served model name (default: the preset's; tiny: {DEFAULT_MODEL})",
    )
    net.add_argument(
        "--lora-adapters",
        default="",
        help="LoRA adapters served from startup: name[:rank],... (rank default "
        f"{DEFAULT_LORA_RANK})",
    )
    net.add_argument(
        "--enable-lora",
        action="store_true",
        help="accept /v1/load_lora_adapter with no startup adapter (implied by --lora-adapters)",
    )
    net.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (0.1 runs ten times faster; /metrics "
        "still reports simulated seconds)",
    )
    net.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (prompt text is never logged)",
    )
    cap = parser.add_argument_group("capacity (default: the preset's)")
    _engine_flag(cap, "--block-size", int, "tokens per KV block", tiny.block_size)
    _engine_flag(cap, "--num-gpu-blocks", int, "KV-cache capacity in blocks", tiny.num_gpu_blocks)
    _engine_flag(cap, "--max-num-seqs", int, "requests running at once", tiny.max_num_seqs)
    _engine_flag(
        cap,
        "--max-waiting",
        int,
        "queued requests beyond the free slots; more get HTTP 429",
        tiny.max_waiting,
    )
    _engine_flag(cap, "--max-loras", int, "LoRA adapters resident at once", tiny.max_loras)
    _engine_flag(
        cap,
        "--max-num-batched-tokens",
        int,
        "token budget of one step: the prefill chunk a decode step carries while prefills run",
        tiny.max_num_batched_tokens,
    )
    lat = parser.add_argument_group("latency (simulated milliseconds; default: the preset's)")
    _engine_flag(
        lat,
        "--prefill-overhead-ms",
        float,
        "fixed cost of a prefill",
        tiny.prefill_overhead_s * 1000,
    )
    _engine_flag(
        lat,
        "--prefill-per-token-ms",
        float,
        "prefill cost per prompt token not found in the prefix cache",
        tiny.prefill_per_token_s * 1000,
    )
    _engine_flag(
        lat,
        "--prefill-per-cached-token-ms",
        float,
        "prefill cost per prompt token found in the prefix cache (lookup)",
        tiny.prefill_per_cached_token_s * 1000,
    )
    _engine_flag(
        lat,
        "--decode-per-token-ms",
        float,
        "inter-token latency with a batch of one",
        tiny.decode_per_token_s * 1000,
    )
    _engine_flag(
        lat,
        "--batch-slowdown",
        float,
        "ITL grows by this fraction as the batch goes from 1 to max-num-seqs",
        tiny.batch_slowdown,
    )
    _engine_flag(
        lat,
        "--lora-load-ms",
        float,
        "time to load a rank-16 adapter that is not resident (proportional to rank)",
        tiny.lora_load_s * 1000,
    )
    kv = parser.add_argument_group("KV-cache events")
    kv.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="publish vLLM's KV-cache events on this ZMQ PUB port; 0: any free, None: off",
    )
    kv.add_argument(
        "--kv-replay-port",
        type=int,
        default=None,
        help="serve event replays on this ZMQ ROUTER port; 0: any free, None: off",
    )
    kv.add_argument(
        "--kv-events-topic",
        default=None,
        help="topic frame; None: kv@<host>:<port>@<model>",
    )
    kv.add_argument(
        "--kv-events-first-seq",
        type=int,
        default=0,
        help="the first batch's sequence number (vLLM: 0); later: a publisher whose "
        "numbering survives a restart (tests)",
    )
    kv.add_argument(
        "--kv-replay-buffer",
        type=int,
        default=DEFAULT_REPLAY_BUFFER,
        help="event batches kept for replay",
    )
    fail = parser.add_argument_group("failure injection (see below)")
    fail.add_argument(
        "--failure-rate",
        type=float,
        default=0.0,
        help="fraction of generation requests that fail at random",
    )
    fail.add_argument(
        "--failure-kinds",
        default="429,500,503",
        help="what a random failure is, picked uniformly: 429, 500, 503, hang, drop",
    )
    fail.add_argument(
        "--seed", type=int, default=None, help="seed of the random failures; None: a fresh one"
    )
    fail.add_argument(
        "--metrics-delay-ms",
        type=float,
        default=0.0,
        help="every /metrics answers this many wall-clock ms late",
    )
    return parser


def _engine_flag(
    group: argparse._ArgumentGroup, flag: str, kind: type, help_: str, tiny_value: float
) -> None:
    # Absent unless given, so that the preset supplies the value; help shows tiny's.
    group.add_argument(
        flag, type=kind, default=argparse.SUPPRESS, help=f"{help_} (tiny: {tiny_value:g})"
    )


def parse_lora_adapters(text: str) -> dict[str, int]:
    """`name[:rank],...` -> {name: rank}, in order; a name given twice must agree."""
    adapters: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, rank_text = item.partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"LoRA adapter {item!r} has no name")
        rank = DEFAULT_LORA_RANK
        if sep:
            try:
                rank = int(rank_text)
            except ValueError:
                raise ValueError(
                    f"LoRA adapter {name!r}: rank {rank_text!r} is not an integer"
                ) from None
        if adapters.get(name, rank) != rank:
            raise ValueError(f"LoRA adapter {name!r} is given two different ranks")
        adapters[name] = rank
    return adapters


def config_from_args(args: argparse.Namespace) -> SimPodConfig:
    """Raises ValueError on values the engine or pod would refuse."""
    chosen = presets.preset(args.preset)
    overrides = {
        field: getattr(args, flag) * unit
        for flag, field, unit in _ENGINE_FLAGS
        if hasattr(args, flag)
    }
    engine = dataclasses.replace(chosen.engine, **overrides)
    adapters = parse_lora_adapters(args.lora_adapters)
    if args.tokenizer is not None and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    kv_events = None
    if args.kv_events_port is not None:
        kv_events = KvEventsConfig(
            port=args.kv_events_port,
            replay_port=args.kv_replay_port,
            host=args.host,
            topic=args.kv_events_topic,
            replay_buffer=args.kv_replay_buffer,
            first_seq=args.kv_events_first_seq,
        )
    elif args.kv_replay_port is not None:
        raise ValueError("--kv-replay-port needs --kv-events-port")
    failures = FailureConfig(
        rate=args.failure_rate,
        kinds=parse_kinds(args.failure_kinds),
        seed=args.seed,
        metrics_delay_s=args.metrics_delay_ms / 1000,
    )
    return SimPodConfig(
        pod_name=args.name,
        model=getattr(args, "model", chosen.model),
        lora_adapters=tuple(adapters),
        lora_ranks={name: rank for name, rank in adapters.items() if rank != DEFAULT_LORA_RANK},
        enable_lora=args.enable_lora,
        engine=engine,
        time_scale=args.time_scale,
        kv_events=kv_events,
        failures=failures,
        tokenizer_dir=args.tokenizer,
    )


async def serve(config: SimPodConfig, host: str, port: int) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        running = await start_pod(config, host, port)
    except (OSError, zmq.ZMQError) as exc:
        print(f"epp sim: cannot listen on {host}: {exc}", file=sys.stderr)
        return 1
    announcement: dict[str, Any] = {
        "event": "sim listening",
        "pod": config.pod_name,
        "url": running.url,
        "model": config.model,
        "lora_adapters": list(config.lora_adapters),
    }
    publisher = running.kv_publisher
    if publisher is not None:
        announcement["kv_events"] = {
            "endpoint": f"tcp://{host}:{publisher.pub_port}",
            "replay_endpoint": None
            if publisher.replay_port is None
            else f"tcp://{host}:{publisher.replay_port}",
            "topic": publisher.topic,
        }
    print(json.dumps(announcement), file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await running.close()
    logging.getLogger("vllm_sim").info("sim stopped pod=%s", config.pod_name)
    return 0


def _runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run

    def run(coro: Coroutine[Any, Any, int]) -> int:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)

    return run


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    return _runner()(serve(config, args.host, args.port))
