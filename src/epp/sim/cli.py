"""`epp sim`: serve one simulated vLLM pod until SIGINT or SIGTERM.

On startup one JSON line goes to stderr with the address actually bound (so `--port 0`
works for scripts that start many pods), whatever the log level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from epp.sim.engine import EngineConfig
from epp.sim.server import SimPodConfig, start_pod

DEFAULT_MODEL = "sim-llama-8b"


def build_parser() -> argparse.ArgumentParser:
    defaults = EngineConfig()
    parser = argparse.ArgumentParser(
        prog="epp sim",
        description=(
            "Serve one simulated vLLM pod: OpenAI completions and chat (streaming or not), "
            "/metrics in vLLM 0.33's format, /health, /v1/models and /reset_prefix_cache. "
            "It models a KV cache with prefix reuse and LRU eviction, a waiting queue, "
            "running slots, LoRA slots, and latency from uncached prompt tokens."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    net = parser.add_argument_group("serving")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on")
    net.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    net.add_argument("--name", default="pod-0", help="pod name, sent in every x-sim-pod header")
    net.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    net.add_argument(
        "--lora-adapters",
        default="",
        help="comma-separated LoRA adapter names served on top of the model",
    )
    net.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (0.1 runs ten times faster)",
    )
    net.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (prompt text is never logged)",
    )
    cap = parser.add_argument_group("capacity")
    cap.add_argument(
        "--block-size", type=int, default=defaults.block_size, help="tokens per KV block"
    )
    cap.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=defaults.num_gpu_blocks,
        help="KV-cache capacity in blocks",
    )
    cap.add_argument(
        "--max-num-seqs", type=int, default=defaults.max_num_seqs, help="requests running at once"
    )
    cap.add_argument(
        "--max-waiting",
        type=int,
        default=defaults.max_waiting,
        help="queued requests beyond the free slots; more get HTTP 429",
    )
    cap.add_argument(
        "--max-loras", type=int, default=defaults.max_loras, help="LoRA adapters resident at once"
    )
    lat = parser.add_argument_group("latency (simulated milliseconds)")
    lat.add_argument(
        "--prefill-overhead-ms",
        type=float,
        default=defaults.prefill_overhead_s * 1000,
        help="fixed cost of a prefill",
    )
    lat.add_argument(
        "--prefill-per-token-ms",
        type=float,
        default=defaults.prefill_per_token_s * 1000,
        help="prefill cost per prompt token not found in the prefix cache",
    )
    lat.add_argument(
        "--decode-per-token-ms",
        type=float,
        default=defaults.decode_per_token_s * 1000,
        help="inter-token latency with a batch of one",
    )
    lat.add_argument(
        "--batch-slowdown",
        type=float,
        default=defaults.batch_slowdown,
        help="ITL grows by this fraction as the batch goes from 1 to max-num-seqs",
    )
    lat.add_argument(
        "--lora-load-ms",
        type=float,
        default=defaults.lora_load_s * 1000,
        help="time to load an adapter that is not resident",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SimPodConfig:
    """Raises ValueError on values the engine or pod would refuse."""
    adapters = tuple(dict.fromkeys(a.strip() for a in args.lora_adapters.split(",") if a.strip()))
    engine = EngineConfig(
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        prefill_overhead_s=args.prefill_overhead_ms / 1000,
        prefill_per_token_s=args.prefill_per_token_ms / 1000,
        decode_per_token_s=args.decode_per_token_ms / 1000,
        batch_slowdown=args.batch_slowdown,
        max_loras=args.max_loras,
        lora_load_s=args.lora_load_ms / 1000,
    )
    return SimPodConfig(
        pod_name=args.name,
        model=args.model,
        lora_adapters=adapters,
        engine=engine,
        time_scale=args.time_scale,
    )


async def serve(config: SimPodConfig, host: str, port: int) -> int:
    """Serve until SIGINT/SIGTERM; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        running = await start_pod(config, host, port)
    except OSError as exc:
        print(f"epp sim: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    announcement = {
        "event": "sim listening",
        "pod": config.pod_name,
        "url": running.url,
        "model": config.model,
        "lora_adapters": list(config.lora_adapters),
    }
    print(json.dumps(announcement), file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await running.close()
    logging.getLogger("epp.sim").info("sim stopped pod=%s", config.pod_name)
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
