"""`epp bench pause`: how long one large body holds the EPP's event loop.

Everything the EPP does runs on one asyncio loop, so a request that takes the loop for
100 ms makes every other request up to 100 ms late. Two parts:

1. In process, per body size and shape: each step of the hot path a large body goes
   through (JSON decode with `json.loads` and with msgspec, `parse_request`,
   `prompt_blocks`, index lookup, record), best of a few runs. Shapes: one long chat
   message (`chat`), many short messages (`chat-many`, the slowest to decode), a token-id
   prompt (`ids`).
2. Live: a real `epp serve` with simulated pods behind a real Envoy (LocalStack). Small
   chat requests flow open-loop at `--rate` per second; after a baseline phase, each phase
   sends `--big-per-phase` bodies of one size (1, 4, 10 MiB and the configured
   `server.max_body_bytes`). Per phase: small-request latency p50/p99 (from their
   scheduled start, so queueing counts), the big requests' statuses, and the EPP's own
   event-loop lag (`epp_event_loop_lag_seconds`, scraped before and after the phase: the
   worst lag falls in the highest bucket that gained samples).

The machine is shared with Envoy and the pods (2 cores): lag includes time the EPP
process waited for a CPU. Rerun with the command printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from epp.config import EppConfig, ServerConfig
from epp.prefix.blocks import prompt_blocks
from epp.prefix.hashing import chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import parse_request
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp_harness.stats import percentile

MIB = 1024 * 1024
ZERO_TIME_PODS = (
    "--prefill-overhead-ms 0 --prefill-per-token-ms 0 --decode-per-token-ms 0 --max-num-seqs 256"
)
BUDGET_S = 0.050
SHAPES = ("chat", "chat-many", "ids", "image")


def make_body(shape: str, size: int, seed: int = 0) -> tuple[str, bytes]:
    """(path, body) of about `size` bytes."""
    rng = random.Random(seed)
    if shape == "chat":
        words = [f"w{n:03d}" for n in range(1000)]
        text = " ".join(rng.choice(words) for _ in range(max(1, size // 5)))
        body = {"model": "sim-llama-8b", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}  # fmt: skip
        return "/v1/chat/completions", json.dumps(body).encode()
    if shape == "chat-many":
        count = max(1, size // 40)
        messages = [{"role": "user", "content": f"hi {i % 97}"} for i in range(count)]
        body = {"model": "sim-llama-8b", "max_tokens": 1, "messages": messages}
        return "/v1/chat/completions", json.dumps(body).encode()
    if shape == "ids":
        ids = [rng.randrange(100_000) for _ in range(max(1, size // 7))]
        body = {"model": "sim-llama-8b", "max_tokens": 1, "prompt": ids}
        return "/v1/completions", json.dumps(body).encode()
    if shape == "image":
        # A vision chat: a short system prompt and question, one base64 image (the rest).
        system = "You describe pictures precisely. " * 30
        image = base64.b64encode(rng.randbytes(max(1, (size - len(system) - 200) * 3 // 4)))
        url = "data:image/png;base64," + image.decode()
        parts = [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
        messages = [{"role": "system", "content": system}, {"role": "user", "content": parts}]
        body = {"model": "sim-llama-8b", "max_tokens": 1, "messages": messages}
        return "/v1/chat/completions", json.dumps(body).encode()
    raise ValueError(f"unknown shape {shape!r}")


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best of `repeats`, in CPU milliseconds of this thread: what the step itself costs
    the loop, without the time a busy machine keeps the process off a CPU."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best * 1000


@dataclass(slots=True)
class StepRow:
    shape: str
    mib: float
    json_loads_ms: float
    msgspec_ms: float
    parse_ms: float
    blocks_ms: float
    match_ms: float
    record_ms: float

    @property
    def total_ms(self) -> float:
        return self.parse_ms + self.blocks_ms + self.match_ms + self.record_ms


def in_process(sizes_mib: list[float], repeats: int = 3) -> list[StepRow]:
    config = EppConfig()
    block_size = config.prefix.block_size
    max_blocks = config.prefix.max_blocks_per_request
    tokenizer = ByteEstimateTokenizer()
    rows = []
    for shape in SHAPES:
        for mib in sizes_mib:
            path, body = make_body(shape, int(mib * MIB))
            request = parse_request(path, body, {})
            seed = chain_seed(request.model or "")
            blocks = prompt_blocks(request.prompt, tokenizer, block_size, seed, max_blocks)
            index = PrefixIndex.from_config(config.prefix)
            # The index already holds other prompts for the pod, as in steady state.
            for p in range(200):
                index.record("pod", [hash((p, b)) for b in range(30)])

            def record(index: PrefixIndex = index, hashes: list = blocks.hashes) -> None:
                index.record("pod", hashes)

            rows.append(
                StepRow(
                    shape,
                    len(body) / MIB,
                    _best_ms(lambda body=body: json.loads(body), repeats),
                    _best_ms(lambda body=body: msgspec.json.decode(body), repeats),
                    _best_ms(lambda p=path, b=body: parse_request(p, b, {}), repeats),
                    _best_ms(
                        lambda r=request, s=seed: prompt_blocks(
                            r.prompt, tokenizer, block_size, s, max_blocks
                        ),
                        repeats,
                    ),
                    _best_ms(lambda h=blocks.hashes, i=index: i.match(h), repeats),
                    _best_ms(record, repeats),
                )
            )
    return rows


# -- live -----------------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    name: str
    big_bytes: int = 0
    small_latencies_s: list[float] = field(default_factory=list)
    small_failed: int = 0
    big_statuses: list[int] = field(default_factory=list)
    big_latencies_s: list[float] = field(default_factory=list)
    lag_buckets: dict[str, int] = field(default_factory=dict)  # bucket bound -> new samples
    lag_max_gauge_s: float = 0.0  # highest epp_event_loop_lag_max_seconds seen in the phase
    route_buckets: dict[str, int] = field(default_factory=dict)  # epp_scoring_latency_us

    def _deltas(self) -> list[tuple[float, int]]:
        """(upper bound, samples in that bucket alone), from the cumulative counts."""
        cumulative = sorted((float(b), n) for b, n in self.lag_buckets.items())
        out, below = [], 0
        for bound, count in cumulative:
            out.append((bound, count - below))
            below = count
        return out

    def worst_route_bucket_us(self) -> tuple[float, float]:
        """(lower, upper] of the slowest Router.route call in the phase (parse..pick)."""
        cumulative = sorted((float(b), n) for b, n in self.route_buckets.items())
        lower, below, worst = 0.0, 0, (0.0, 0.0)
        for bound, count in cumulative:
            if count - below > 0:
                worst = (lower, bound)
            lower, below = bound, count
        return worst

    def worst_lag_bucket(self) -> tuple[float, float]:
        """(lower, upper] bounds of the highest lag bucket that gained samples."""
        lower, worst = 0.0, (0.0, 0.0)
        for bound, count in self._deltas():
            if count > 0:
                worst = (lower, bound)
            lower = bound
        return worst

    def lag_over(self, seconds: float) -> int:
        return sum(n for bound, n in self._deltas() if bound > seconds)

    @property
    def lag_samples(self) -> int:
        return sum(n for _, n in self._deltas())


def _lag_buckets(page: str, family: str = "epp_event_loop_lag_seconds") -> dict[str, int]:
    """Cumulative bucket counts of a histogram (labels other than le: none) on a page."""
    out = {}
    for line in page.splitlines():
        if line.startswith(family + "_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[bound] = int(float(line.rsplit(" ", 1)[1]))
    return out


def _gauge(page: str, name: str) -> float:
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ", 1)[1])
    return 0.0


async def live(
    sizes_mib: list[float],
    *,
    rate: float,
    phase_s: float,
    big_per_phase: int,
    pods: int,
    shape: str,
    epp_config_yaml: str | None,
    pin: bool = False,
) -> tuple[list[Phase], dict]:
    import aiohttp

    from epp_harness.stack import LocalStack

    stack = LocalStack(pods=pods, sim_args=ZERO_TIME_PODS.split(), epp_config_yaml=epp_config_yaml)
    load_start = os.getloadavg()[0]
    await asyncio.to_thread(stack.start)
    try:
        if pin:
            _pin(stack.pids)
        url = stack.envoy_url
        metrics_url = stack.epp_metrics_url
        assert metrics_url is not None
        _, small = make_body("chat", 4000, seed=1)  # ~1,000 pseudo-tokens
        # A size at the limit is sent just under it (the JSON around the prompt included).
        bigs = {mib: make_body(shape, int(mib * MIB) - 4096, seed=2) for mib in sizes_mib}
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def scrape() -> str:
                async with session.get(metrics_url) as response:
                    return await response.text()

            async def post(path: str, body: bytes) -> int:
                async with session.post(
                    url + path, data=body, headers={"content-type": "application/json"}
                ) as response:
                    await response.read()
                    return response.status

            async def small_one(phase: Phase, scheduled: float) -> None:
                try:
                    status = await post("/v1/chat/completions", small)
                except aiohttp.ClientError:
                    status = 0
                if status == 200:
                    phase.small_latencies_s.append(time.perf_counter() - scheduled)
                else:
                    phase.small_failed += 1

            async def big_one(phase: Phase, path: str, body: bytes) -> None:
                start = time.perf_counter()
                try:
                    status = await post(path, body)
                except aiohttp.ClientError:
                    status = 0
                phase.big_statuses.append(status)
                phase.big_latencies_s.append(time.perf_counter() - start)

            async def run_phase(phase: Phase, big: tuple[str, bytes] | None) -> None:
                page = await scrape()
                before = _lag_buckets(page)
                route_before = _lag_buckets(page, "epp_scoring_latency_us")
                tasks: list[asyncio.Task] = []
                start = time.perf_counter()
                interval = 1.0 / rate
                big_at = (
                    [phase_s * (i + 0.5) / big_per_phase for i in range(big_per_phase)]
                    if big
                    else []
                )
                n = 0
                stop_polling = asyncio.Event()

                async def poll_gauge() -> None:
                    while not stop_polling.is_set():
                        page = await scrape()
                        phase.lag_max_gauge_s = max(
                            phase.lag_max_gauge_s, _gauge(page, "epp_event_loop_lag_max_seconds")
                        )
                        await asyncio.sleep(0.5)

                poller = asyncio.create_task(poll_gauge())
                while True:
                    now = time.perf_counter() - start
                    if now >= phase_s:
                        break
                    while big_at and big_at[0] <= now:
                        big_at.pop(0)
                        assert big is not None
                        tasks.append(asyncio.create_task(big_one(phase, *big)))
                    scheduled = start + n * interval
                    if scheduled <= time.perf_counter():
                        tasks.append(asyncio.create_task(small_one(phase, scheduled)))
                        n += 1
                        continue
                    await asyncio.sleep(min(scheduled - time.perf_counter(), 0.005))
                await asyncio.gather(*tasks)
                stop_polling.set()
                await poller
                page = await scrape()
                after = _lag_buckets(page)
                phase.lag_buckets = {b: after[b] - before.get(b, 0) for b in after}
                route_after = _lag_buckets(page, "epp_scoring_latency_us")
                phase.route_buckets = {
                    b: route_after[b] - route_before.get(b, 0) for b in route_after
                }

            # Warm-up: first streams, first tokenizations, connection pools.
            await run_phase(Phase("warm-up"), None)
            phases = [Phase("no big bodies")]
            await run_phase(phases[0], None)
            for mib in sizes_mib:
                phase = Phase(f"{mib:g} MiB x {big_per_phase}", int(mib * MIB))
                phases.append(phase)
                await run_phase(phase, bigs[mib])
            final = await scrape()
        info = {
            "pods": pods,
            "stack_log_dir": None,
            "lag_max_gauge_end_s": _gauge(final, "epp_event_loop_lag_max_seconds"),
            "load_average": (load_start, os.getloadavg()[0]),
        }
        return phases, info
    finally:
        await asyncio.to_thread(stack.stop)


def _pin(pids: dict[str, int]) -> None:
    """The EPP (every thread) alone on CPU 0; Envoy, the pods and this client on CPU 1."""
    for name, pid in pids.items():
        cpus = {0} if name == "epp" else {1}
        for task in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(task), cpus)
    os.sched_setaffinity(0, {1})


# -- report ---------------------------------------------------------------------------


def _fmt_steps(rows: list[StepRow]) -> str:
    head = (
        "| shape | body MiB | json.loads ms | msgspec ms | parse_request ms | prompt_blocks ms "
        "| match ms | record ms | parse..record ms |\n|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.mib:.1f} | {r.json_loads_ms:.1f} | {r.msgspec_ms:.1f} | "
            f"{r.parse_ms:.1f} | {r.blocks_ms:.1f} | {r.match_ms:.2f} | {r.record_ms:.2f} | "
            f"{r.total_ms:.1f} |"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _fmt_phases(phases: list[Phase]) -> str:
    lines = [
        "| phase | small ok / failed | small p50 ms | small p99 ms | small max ms "
        "| big statuses | big latency ms | EPP loop lag: worst bucket ms | lag samples > 50 ms "
        "| max-lag gauge ms | slowest Router.route ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in phases:
        lo, hi = p.worst_lag_bucket()
        route_lo, route_hi = p.worst_route_bucket_us()
        statuses = ",".join(str(s) for s in sorted(set(p.big_statuses))) or "-"
        big_lat = (
            f"{min(p.big_latencies_s) * 1000:.0f}-{max(p.big_latencies_s) * 1000:.0f}"
            if p.big_latencies_s
            else "-"
        )
        lines.append(
            f"| {p.name} | {len(p.small_latencies_s)} / {p.small_failed} "
            f"| {_ms(percentile(p.small_latencies_s, 50))} "
            f"| {_ms(percentile(p.small_latencies_s, 99))} "
            f"| {_ms(max(p.small_latencies_s, default=None))} | {statuses} | {big_lat} "
            f"| ({lo * 1000:g}, {hi * 1000:g}] | {p.lag_over(BUDGET_S)} "
            f"| {p.lag_max_gauge_s * 1000:.1f} "
            f"| ({route_lo / 1000:g}, {route_hi / 1000:g}] |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epp bench pause", description=__doc__.split("\n")[0])
    default_limit = ServerConfig().max_body_bytes / MIB
    parser.add_argument(
        "--sizes",
        default=f"1,4,10,{default_limit:g}",
        help="big body sizes in MiB (default: 1,4,10 and the default server.max_body_bytes)",
    )
    parser.add_argument(
        "--step-sizes",
        default=f"1,4,10,{default_limit:g},32",
        help="sizes for the in-process step table (MiB)",
    )
    parser.add_argument("--rate", type=float, default=40.0, help="small requests per second")
    parser.add_argument("--phase-s", type=float, default=6.0, help="seconds per phase")
    parser.add_argument("--big-per-phase", type=int, default=3)
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--shape", choices=SHAPES, default="chat", help="big body shape (live)")
    parser.add_argument(
        "--max-body-mib", type=float, help="run the EPP with this server.max_body_bytes"
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the EPP to CPU 0 and Envoy, the pods and the client to CPU 1",
    )
    parser.add_argument("--skip-live", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    command = "epp bench pause " + shlex.join(argv)
    results: dict = {
        "command": command,
        "machine": f"{platform.machine()}, {platform.python_version()}, {os.cpu_count()} cpus",
        "max_body_bytes_default": ServerConfig().max_body_bytes,
    }
    if not args.skip_steps:
        rows = in_process([float(s) for s in args.step_sizes.split(",")])
        results["steps"] = [asdict(r) | {"total_ms": r.total_ms} for r in rows]
        print("## In process: one body's hot path (CPU ms, best of 3)\n")
        print(_fmt_steps(rows))
        print()
    if not args.skip_live:
        config_yaml = None
        if args.max_body_mib is not None:
            config_yaml = f"server:\n  max_body_bytes: {int(args.max_body_mib * MIB)}\n"
        sizes = list(dict.fromkeys(float(s) for s in args.sizes.split(",")))
        phases, info = asyncio.run(
            live(
                sizes,
                rate=args.rate,
                phase_s=args.phase_s,
                big_per_phase=args.big_per_phase,
                pods=args.pods,
                shape=args.shape,
                epp_config_yaml=config_yaml,
                pin=args.pin,
            )
        )
        results["live"] = {"phases": [asdict(p) for p in phases], **info}
        limit = args.max_body_mib * MIB if args.max_body_mib else ServerConfig().max_body_bytes
        print(
            f"## Live: Envoy + epp serve + {args.pods} simulated pods, {args.rate:g} small "
            f"req/s, big body shape '{args.shape}', server.max_body_bytes = "
            f"{limit / MIB:g} MiB\n"
        )
        print(_fmt_phases(phases))
        load = info["load_average"]
        print(
            f"\nmachine load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f} "
            f"on {os.cpu_count()} cpus: lag includes time the EPP waited for a CPU"
        )
        print()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"rerun: .venv/bin/{command}")
    sys.stdout.flush()
    return 0
