"""`epp bench soak`: the real stack (Envoy + `epp serve` + simulated pods) at its measured
ceiling for minutes: does anything in the EPP grow, does latency drift, and how long does it
take to recover from a burst of ten times the rate?

1. **Ceiling**: a rate ladder (x1.5 a rung, a few seconds each) until the median TTFT climbs
   above 1.5x the lowest rung's (+5 ms), a request fails, or the client cannot deliver the
   rate; the ceiling is the last rung that held. It is this machine's (CPU) ceiling for the
   whole stack, client included.
2. **Soak**: that rate for `--minutes`, the EPP's RSS, open fds (from /proc), asyncio tasks
   and decision latency (`epp_asyncio_tasks`, `epp_scoring_latency_us` from its /metrics)
   sampled every `--sample-seconds`. Growth is the least-squares slope after the first
   minute (warm-up: caches and the prefix index fill); flat means under the limits in
   analysis.FLAT_LIMITS.
3. **Burst**: ten times the rate for `--burst-seconds`, then the ceiling rate again; recovery
   is the time from the burst's end until the TTFT median of each 1-s window is back within
   1.5x the soak's (+5 ms) and stays there.

    .venv/bin/epp bench soak --minutes 10 --out docs/benchmarks/soak.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from epp_bench.soak.analysis import (
    RECOVERY_HOLD_WINDOWS,
    Growth,
    Step,
    ceiling,
    growth,
    histogram_quantile,
    recovery_s,
    step_holds,
    windowed_p50,
)
from epp_bench.soak.load import LoadClient, Record
from epp_bench.soak.sampler import ProcessSampler, Sample
from epp_harness.stack import LocalStack
from epp_harness.stats import percentile

# Fast pods with room (8 running slots, a queue of 64 each): the ceiling is the stack's
# CPU, not the simulated GPUs.
SIM_ARGS = (
    "--prefill-per-token-ms",
    "0.02",
    "--decode-per-token-ms",
    "2",
    "--log-level",
    "warning",
)
BURST_FACTOR = 10


@dataclass(slots=True)
class MinuteRow:
    minute: int
    requests: int
    failed: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    decision_p50_us: float | None
    decision_p99_us: float | None


@dataclass(slots=True)
class SoakResult:
    command: str
    commit: str
    pods: int
    ladder: list[Step] = field(default_factory=list)
    ceiling_rps: float | None = None
    confirmations: list[Step] = field(default_factory=list)
    minutes: list[MinuteRow] = field(default_factory=list)
    growth: list[Growth] = field(default_factory=list)
    steady_ttft_p50_ms: float | None = None
    burst_offered_rps: float = 0.0
    burst_sent_rps: float = 0.0
    burst_statuses: dict[str, int] = field(default_factory=dict)
    burst_ttft_p99_ms: float | None = None
    recovery_s: float | None = None
    # (seconds after the burst, TTFT median of the requests sent in that second)
    recovery_curve: list[tuple[float, float | None]] = field(default_factory=list)
    index_nodes: tuple[float, float] = (0.0, 0.0)  # first and last steady sample
    skipped: int = 0
    samples: list[Sample] = field(default_factory=list)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def _statuses(records: list[Record]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for r in records:
        counts[str(r.status) if r.error is None or r.status != 200 else "200-broken"] += 1
    return dict(sorted(counts.items()))


def _step(records: list[Record], offered: float, seconds: float) -> Step:
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    return Step(
        offered_rps=offered,
        achieved_rps=len(records) / seconds,
        ok=len(ttfts),
        failed=len(records) - len(ttfts),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
    )


async def find_ceiling(
    client: LoadClient, start_rps: float, max_rps: float, step_s: float
) -> list[Step]:
    await client.phase(start_rps, 3.0)  # warm-up: connections, caches
    await client.drain(10.0)
    steps: list[Step] = []
    rate = start_rps
    while rate <= max_rps:
        begin, end = await client.phase(rate, step_s)
        await client.drain(10.0)
        # The first second of a rung still carries the previous rung's tail.
        measured_from = begin + 1.0
        step = _step(client.between(measured_from, end), rate, end - measured_from)
        steps.append(step)
        print(
            f"soak: ladder {rate:6.1f} req/s: sent {step.achieved_rps:6.1f}/s, failed"
            f" {step.failed}, TTFT p50 {_fmt_ms(_ms(step.ttft_p50_s))}"
            f" p99 {_fmt_ms(_ms(step.ttft_p99_s))}",
            flush=True,
        )
        if ceiling(steps) != step.offered_rps:
            break
        rate = round(rate * 1.5, 1)
    return steps


async def confirm_ceiling(
    client: LoadClient, ladder: list[Step], seconds: float, result: SoakResult
) -> float | None:
    """The highest rung that also holds for `seconds` (judged on their second half, where a
    growing backlog shows): a short rung can hold on a backlog that a longer run would not."""
    held = [s.offered_rps for s in ladder if s.offered_rps <= (ceiling(ladder) or 0.0)]
    for rate in sorted(held, reverse=True):
        begin, end = await client.phase(rate, seconds)
        await client.drain(10.0)
        half = seconds / 2
        step = _step(client.between(begin + half, end), rate, half)
        result.confirmations.append(step)
        ok = step_holds(step, ladder[0])
        print(
            f"soak: confirm {rate:6.1f} req/s for {seconds:g} s: TTFT p50"
            f" {_fmt_ms(_ms(step.ttft_p50_s))}, failed {step.failed}: {'holds' if ok else 'no'}",
            flush=True,
        )
        if ok:
            return rate
    return None


def _nearest(samples: list[Sample], t: float) -> Sample | None:
    return min(samples, key=lambda s: abs(s.t_s - t)) if samples else None


def minute_rows(
    records: list[Record], samples: list[Sample], start_s: float, minutes: int
) -> list[MinuteRow]:
    rows = []
    for m in range(minutes):
        lo, hi = start_s + 60 * m, start_s + 60 * (m + 1)
        window = [r for r in records if lo <= r.sent_s < hi]
        ttfts = [r.ttft_s for r in window if r.ok and r.ttft_s is not None]
        before, after = _nearest(samples, lo), _nearest(samples, hi)
        d50 = d99 = None
        if before is not None and after is not None and before is not after:
            d50 = histogram_quantile(0.5, before.decision_buckets, after.decision_buckets)
            d99 = histogram_quantile(0.99, before.decision_buckets, after.decision_buckets)
        rows.append(
            MinuteRow(
                m + 1,
                len(window),
                len(window) - len(ttfts),
                _ms(percentile(ttfts, 50)),
                _ms(percentile(ttfts, 99)),
                d50,
                d99,
            )
        )
    return rows


async def run(args: argparse.Namespace, result: SoakResult, stack: LocalStack) -> None:
    pid = stack.pids["epp"]
    assert stack.epp_metrics_url is not None
    async with LoadClient(
        stack.envoy_url, max_tokens=args.max_tokens, max_in_flight=args.max_in_flight
    ) as client:
        if args.rate is not None:
            rate = args.rate
        else:
            result.ladder = await find_ceiling(
                client, args.start_rate, args.max_rate, args.step_seconds
            )
            found = await confirm_ceiling(client, result.ladder, args.confirm_seconds, result)
            if found is None:
                raise SystemExit("soak: not even the first rung held; lower --start-rate")
            rate = found
        result.ceiling_rps = rate
        print(f"soak: {rate:g} req/s for {args.minutes} min", flush=True)

        sampler = ProcessSampler(pid, stack.epp_metrics_url, client.now, args.sample_seconds)
        sampling = asyncio.create_task(sampler.run())
        soak_start, soak_end = await client.phase(rate, args.minutes * 60.0)
        burst_start, burst_end = await client.phase(rate * BURST_FACTOR, args.burst_seconds)
        _, run_end = await client.phase(rate, args.recovery_seconds)
        await client.drain(30.0)
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)

    samples = sampler.samples
    result.samples = samples
    result.skipped = client.skipped
    soak_records = client.between(soak_start, soak_end)
    result.minutes = minute_rows(soak_records, samples, soak_start, args.minutes)
    steady = [s for s in samples if soak_start + 60.0 <= s.t_s <= soak_end]
    if len(steady) < 2:  # a 1-minute smoke run: the whole soak
        steady = [s for s in samples if s.t_s <= soak_end]
    times = [s.t_s for s in steady]
    result.growth = [
        growth("rss_mb", "MB", times, [s.rss_mb for s in steady]),
        growth("open_fds", "fds", times, [float(s.open_fds) for s in steady]),
        growth("asyncio_tasks", "tasks", times, [s.asyncio_tasks for s in steady]),
    ]
    ttfts = [(r.sent_s, r.ttft_s) for r in soak_records if r.ok and r.ttft_s is not None]
    steady_p50 = percentile([v for _, v in ttfts], 50)
    result.steady_ttft_p50_ms = _ms(steady_p50)
    burst = client.between(burst_start, burst_end)
    result.burst_offered_rps = rate * BURST_FACTOR
    result.burst_sent_rps = len(burst) / args.burst_seconds
    result.burst_statuses = _statuses(burst)
    result.burst_ttft_p99_ms = _ms(
        percentile([r.ttft_s for r in burst if r.ok and r.ttft_s is not None], 99)
    )
    after = [
        (r.sent_s, r.ttft_s)
        for r in client.between(burst_end, run_end)
        if r.ok and r.ttft_s is not None
    ]
    if steady_p50 is not None:
        result.recovery_s = recovery_s(after, burst_end, run_end, steady_p50)
    result.recovery_curve = [
        (start - burst_end, p50) for start, p50 in windowed_p50(after, burst_end, run_end, 1.0)
    ]
    result.index_nodes = (steady[0].index_nodes, steady[-1].index_nodes)


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def render(result: SoakResult, args: argparse.Namespace) -> str:
    lines = [
        "# Soak: the stack at its ceiling for minutes",
        "",
        f"_Generated by `{result.command}` at commit `{result.commit}`; 2-core machine shared"
        " with other work, everything on 127.0.0.1: real Envoy, `epp serve` (TLS, default"
        f" settings), {result.pods} simulated pods (`epp sim`, tiny preset, fast: the ceiling is"
        " the CPU's), an open-loop streaming chat client (16 shared system prompts, a distinct"
        f" question each, {args.max_tokens} output tokens)._",
        "",
    ]
    if result.ladder:
        lines += [
            "## Ceiling",
            "",
            "| offered req/s | sent req/s | failed | TTFT p50 | TTFT p99 | held |",
            "|---:|---:|---:|---:|---:|---|",
        ]
        for step in result.ladder:
            held = "yes" if step_holds(step, result.ladder[0]) else "no"
            lines.append(
                f"| {step.offered_rps:g} | {step.achieved_rps:.1f} | {step.failed}"
                f" | {_fmt_ms(_ms(step.ttft_p50_s))} | {_fmt_ms(_ms(step.ttft_p99_s))} | {held} |"
            )
        for step in result.confirmations:
            held = "yes" if step.offered_rps == result.ceiling_rps else "no"
            lines.append(
                f"| {step.offered_rps:g} for {args.confirm_seconds:g} s | {step.achieved_rps:.1f}"
                f" | {step.failed} | {_fmt_ms(_ms(step.ttft_p50_s))}"
                f" | {_fmt_ms(_ms(step.ttft_p99_s))} | {held} |"
            )
        lines += [
            "",
            f"Ceiling: **{result.ceiling_rps:g} req/s**: the highest rung whose median TTFT"
            " stayed within 1.5x the first rung's + 5 ms, with no failure and the rate"
            f" delivered, for {args.step_seconds:g} s and then again for"
            f" {args.confirm_seconds:g} s (judged on the second half of each, where a growing"
            " backlog shows).",
            "",
        ]
    lines += [
        "## Growth (EPP process, after the first minute)",
        "",
        "| resource | first | last | mean | slope per minute | flat if at most | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for g in result.growth:
        lines.append(
            f"| {g.name} ({g.unit}) | {g.first:.1f} | {g.last:.1f} | {g.mean:.1f}"
            f" | {g.slope_per_min:+.3f} | {g.limit_per_min:g} | {'flat' if g.flat else 'NOT FLAT'} |"
        )
    lines += [
        "",
        f"The prefix index went from {result.index_nodes[0]:.0f} to"
        f" {result.index_nodes[1]:.0f} entries (`epp_prefix_tree_nodes`) over the same window:"
        " it grows until `prefix.capacity_per_pod` (or the pod's reported KV size) bounds it,"
        " and its entries are part of the RSS.",
        "",
        "## Latency per minute",
        "",
        "| minute | requests | failed | TTFT p50 | TTFT p99 | decision p50 | decision p99 |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result.minutes:
        lines.append(
            f"| {row.minute} | {row.requests} | {row.failed} | {_fmt_ms(row.ttft_p50_ms)}"
            f" | {_fmt_ms(row.ttft_p99_ms)} | {_fmt(row.decision_p50_us, ' us')}"
            f" | {_fmt(row.decision_p99_us, ' us')} |"
        )
    recovery = (
        "never within the run" if result.recovery_s is None else f"**{result.recovery_s:.0f} s**"
    )
    lines += [
        "",
        "TTFT is the client's (through Envoy, the EPP and a pod); decision latency is the"
        " EPP's `epp_scoring_latency_us` (parse + hash + lookup + score + pick), quantiles"
        " interpolated inside its buckets.",
        "",
        "## Burst of 10x",
        "",
        f"{args.burst_seconds:g} s at {result.burst_offered_rps:g} req/s offered"
        f" ({result.burst_sent_rps:.0f} req/s sent), then {result.ceiling_rps:g} req/s again."
        f" Answers during the burst: {result.burst_statuses}; TTFT p99 during the burst:"
        f" {_fmt_ms(result.burst_ttft_p99_ms)}. Recovery to the steady median TTFT"
        f" ({_fmt_ms(result.steady_ttft_p50_ms)}, within 1.5x + 5 ms, per 1-s window, for"
        f" {RECOVERY_HOLD_WINDOWS} windows in a row): {recovery}.",
        "",
        "TTFT median per second after the burst: "
        + ", ".join(f"{t:.0f} s {_fmt_ms(_ms(p50))}" for t, p50 in result.recovery_curve[:20])
        + ".",
        "",
    ]
    if result.skipped:
        lines += [
            f"{result.skipped} requests fell due while {args.max_in_flight} were in flight and"
            " were not sent (client cap).",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="epp bench soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=int, default=10, help="soak length (default 10)")
    parser.add_argument("--rate", type=float, help="skip the ladder: soak at this req/s")
    parser.add_argument("--start-rate", type=float, default=10.0)
    parser.add_argument("--max-rate", type=float, default=400.0)
    parser.add_argument("--step-seconds", type=float, default=8.0)
    parser.add_argument(
        "--confirm-seconds", type=float, default=30.0, help="a rung must also hold this long"
    )
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--burst-seconds", type=float, default=5.0)
    parser.add_argument("--recovery-seconds", type=float, default=40.0)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-in-flight", type=int, default=2000)
    parser.add_argument(
        "--index-capacity",
        type=int,
        help="the EPP's prefix.capacity_per_pod (small: the index is full within a minute,"
        " so what still grows is not the index)",
    )
    parser.add_argument("--out", type=Path, help="write the markdown page here")
    parser.add_argument("--json", type=Path, help="write the results (and every sample) here")
    args = parser.parse_args(argv)
    if args.minutes < 1:
        parser.error("--minutes must be at least 1")
    command = f"epp bench soak --minutes {args.minutes}"
    if args.rate is not None:
        command += f" --rate {args.rate:g}"
    if args.index_capacity is not None:
        command += f" --index-capacity {args.index_capacity}"
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    result = SoakResult(command=command, commit=commit or "unknown", pods=args.pods)
    config = None
    if args.index_capacity is not None:
        config = f"prefix: {{capacity_per_pod: {args.index_capacity}}}\n"
    with LocalStack(
        pods=args.pods, sim_args=SIM_ARGS, epp_config_yaml=config, log_level="warning"
    ) as stack:
        asyncio.run(run(args, result, stack))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=1, default=str) + "\n")
    page = render(result, args)
    print(page)
    if args.out is not None:
        args.out.write_text(page)
    print(f"rerun: .venv/bin/{command}", file=sys.stderr)
    flat = all(g.flat for g in result.growth)
    return 0 if flat else 1
