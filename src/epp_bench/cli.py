"""`epp bench <kind> ...`: one subcommand per benchmark, each in its own module."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "virtual": ("epp_bench.virtual.cli", "replay a workload over simulated pods in virtual time"),
    "live": ("epp_bench.live.cli", "real Envoy + EPP + simulated pods, peers and baselines"),
    "overhead": ("epp_bench.picker.overhead", "EPP hot-path cost in process and through Envoy"),
    "pause": (
        "epp_bench.picker.pause",
        "event-loop pauses from large bodies (in process and live)",
    ),
    "pressure": (
        "epp_bench.picker.pressure",
        "bursts and the thundering herd through the real stack",
    ),
    "streams": (
        "epp_bench.picker.streams",
        "10,000 concurrent streaming generations held through Envoy and the EPP",
    ),
    "faults": (
        "epp_bench.picker.faults",
        "the fault suite: time to move away and to return, failed requests, index divergence",
    ),
    "replicas": (
        "epp_bench.picker.replicas",
        "several EPP replicas behind one Envoy: sharing, hit rate, a replica killed",
    ),
    "workers": (
        "epp_bench.picker.workers",
        "epp serve --workers 1 and 2 behind one Envoy port: decisions/s, balance, hit rate",
    ),
    "soak": (
        "epp_bench.soak.cli",
        "minutes at the measured ceiling: EPP memory, fds, tasks, latency; a 10x burst",
    ),
    "tokenize": (
        "epp_bench.picker.tokenize",
        "a model's own tokenizer: cost per 1k tokens, the decision for a chat, multi-turn",
    ),
    "index": (
        "epp_bench.picker.index",
        "prefix index: lookup, memory per entry, KV event ingest, loop pauses",
    ),
    "loop": (
        "epp_bench.picker.loop",
        "routing latency with KV events, relists, pages on the loop or off it",
    ),
    "scale": (
        "epp_bench.picker.scale",
        "1,000 pods, 10,000 in flight: decision latency, memory per pod and request, scrape",
    ),
    "scrape": (
        "epp_bench.picker.scrape",
        "pods' /metrics scrape: EPP CPU per page and cores, the engine's cost, before/after",
    ),
    "precise-report": (
        "epp_bench.virtual.precise_report",
        "precise vs approximate mode tables (docs/benchmarks/precise.md) from virtual runs",
    ),
    "report": ("epp_bench.reports.cli", "rebuild docs/benchmarks/ from saved JSON results"),
}


def usage() -> str:
    lines = ["usage: epp bench <kind> [options]", "", "kinds:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    entry = BENCHMARKS.get(argv[0])
    if entry is None:
        print(f"epp bench: unknown kind {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(entry[0]).main(argv[1:]) or 0)
