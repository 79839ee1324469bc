"""The live benchmark's own tables: where the CPU went, and the targets against the peers.

The shared tables (`epp_bench.reports.tables`) show what the client saw. A live run on a small
box also needs to show what it cost and who was the bottleneck: cores per component,
the machine's total (and what other programs took), and how full the simulated GPUs were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from epp_bench.reports.summary import summarize
from epp_bench.workloads.types import RunResult
from epp_harness.stats import percentile

PEER_FOR_TARGETS = "sglang_cache_aware"


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cpu_table(results: Sequence[RunResult]) -> str:
    """One row per run: cores by component, machine busy, foreign load, GPU occupancy."""
    header = [
        "rate",
        "router",
        "pods",
        "envoy",
        "epp / router",
        "client",
        "machine busy",
        "other programs",
        "sim slots busy",
        "sim queue (mean / max)",
        "router CPU/request",
    ]
    rows = []
    for result in sorted(results, key=lambda r: (r.rate or 0.0, r.router)):
        cores = result.extra.get("cpu_cores") or {}
        occupancy = result.extra.get("occupancy") or {}
        per_request = result.extra.get("router_cpu_us_per_request")
        decider = cores.get("epp", cores.get("router"))
        rows.append(
            [
                f"{result.rate:g}" if result.rate is not None else "-",
                result.router,
                _f(cores.get("pods")),
                _f(cores.get("envoy")),
                _f(decider),
                _f(cores.get("client")),
                f"{_f(cores.get('machine_busy'))} / {result.extra.get('machine_cores', 2)}",
                _f(cores.get("foreign")),
                "-"
                if occupancy.get("slots_busy_mean") is None
                else f"{occupancy['slots_busy_mean'] * 100:.0f}%",
                f"{_f(occupancy.get('waiting_mean'), 1)} / {_f(occupancy.get('waiting_max'), 0)}",
                "-" if per_request is None else f"{per_request:,.0f} µs",
            ]
        )
    align = ["---", "---"] + ["---:"] * (len(header) - 2)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class TargetCheck:
    rate: float | None
    workload: str
    epp_hit: float | None
    peer_hit: float | None
    epp_ttft_p99_s: float | None
    peer_ttft_p99_s: float | None

    @property
    def hit_ok(self) -> bool:
        return (
            self.epp_hit is not None
            and self.peer_hit is not None
            and (self.epp_hit >= self.peer_hit - 1e-9)
        )

    @property
    def ttft_ok(self) -> bool:
        return (
            self.epp_ttft_p99_s is not None
            and self.peer_ttft_p99_s is not None
            and self.epp_ttft_p99_s < self.peer_ttft_p99_s
        )


def target_checks(results: Sequence[RunResult], peer: str = PEER_FOR_TARGETS) -> list[TargetCheck]:
    """The issue's targets, per (workload, rate): EPP hit rate >= the peer's, TTFT p99 < it.

    With several repeats of a pair, the check uses the mean of each figure over them.
    """
    groups: dict[tuple[str, float | None], dict[str, list[dict[str, Any]]]] = {}
    for result in results:
        if result.router not in ("epp", peer):
            continue
        key = (result.workload, result.rate)
        groups.setdefault(key, {}).setdefault(result.router, []).append(summarize(result))
    checks = []
    for (workload, rate), by_router in sorted(
        groups.items(), key=lambda item: (item[0][0], item[0][1] or 0.0)
    ):
        if "epp" not in by_router or peer not in by_router:
            continue
        checks.append(
            TargetCheck(
                rate=rate,
                workload=workload,
                epp_hit=_mean(s["pod_hit_rate"] for s in by_router["epp"]),
                peer_hit=_mean(s["pod_hit_rate"] for s in by_router[peer]),
                epp_ttft_p99_s=_mean(s["ttft_p99_s"] for s in by_router["epp"]),
                peer_ttft_p99_s=_mean(s["ttft_p99_s"] for s in by_router[peer]),
            )
        )
    return checks


def _mean(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def targets_table(checks: Sequence[TargetCheck], peer: str = PEER_FOR_TARGETS) -> str:
    header = [
        "workload",
        "rate",
        "hit rate epp",
        f"hit rate {peer}",
        "hit target",
        "TTFT p99 epp",
        f"TTFT p99 {peer}",
        "TTFT target",
    ]

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.1f}%"

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    rows = [
        [
            c.workload,
            "-" if c.rate is None else f"{c.rate:g}",
            pct(c.epp_hit),
            pct(c.peer_hit),
            "met" if c.hit_ok else "MISSED",
            ms(c.epp_ttft_p99_s),
            ms(c.peer_ttft_p99_s),
            "met" if c.ttft_ok else "MISSED",
        ]
        for c in checks
    ]
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pool_repeats(results: Sequence[RunResult]) -> list[RunResult]:
    """One result per (router, workload, rate), pooling the outcomes of its repeats.

    150 requests make a noisy p99 (it is the second-worst request); three repeats pooled
    make 450. Each repeat's times are shifted past the previous one's end so that rates
    computed over the pooled span stay right. The hit rate and the CPU figures are the
    repeats' means; `extra["repeats"]` keeps each repeat's own headline figures.
    """
    groups: dict[tuple[str, str, float | None], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.router, result.workload, result.rate), []).append(result)
    pooled: list[RunResult] = []
    for runs in groups.values():
        if len(runs) == 1:
            pooled.append(runs[0])
            continue
        outcomes = []
        offset = 0.0
        for run in runs:
            outcomes += [replace(o, start_s=o.start_s + offset) for o in run.outcomes]
            offset += run.duration_s
        first = runs[0]
        extra = dict(first.extra)
        for key in ("cpu_cores", "idle_cpu_cores", "occupancy"):
            extra[key] = _mean_dicts([r.extra.get(key) or {} for r in runs])
        for key in ("router_cpu_us_per_request", "front_ttft_mean_s", "pod_ttft_mean_s"):
            extra[key] = _mean(r.extra.get(key) for r in runs)
        extra["repeats"] = [
            {
                key: summarize(run)[key]
                for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "pod_hit_rate", "load_cv")
            }
            | {"requests_per_pod": summarize(run)["requests_per_pod"]}
            for run in runs
        ]
        pooled.append(
            replace(
                first,
                outcomes=outcomes,
                duration_s=offset,
                pod_hit_rate=_mean(r.pod_hit_rate for r in runs),
                epp_cpu_us_per_decision=_mean(r.epp_cpu_us_per_decision for r in runs),
                extra=extra,
            )
        )
    return pooled


def _mean_dicts(dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    keys = {k for d in dicts for k, v in d.items() if isinstance(v, int | float)}
    return {k: _mean(d.get(k) for d in dicts) for k in sorted(keys)}


def repeats_table(pooled: Sequence[RunResult]) -> str:
    """Per (rate, router): each repeat's TTFT p99 and hit rate, to show the spread."""
    header = ["rate", "router", "TTFT p99 per repeat", "hit rate per repeat", "load CV per repeat"]
    rows = []
    for result in sorted(pooled, key=lambda r: (r.rate or 0.0, r.router)):
        repeats = result.extra.get("repeats")
        if not repeats:
            continue
        rows.append(
            [
                f"{result.rate:g}" if result.rate is not None else "-",
                result.router,
                ", ".join(_ms(r["ttft_p99_s"]) for r in repeats),
                ", ".join(_pct(r["pod_hit_rate"]) for r in repeats),
                ", ".join(_f(r["load_cv"]) for r in repeats),
            ]
        )
    align = ["---", "---", "---:", "---:", "---:"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def diagnosis_table(pooled: Sequence[RunResult]) -> str:
    """Where TTFT comes from, per (rate, router).

    - front TTFT: the client's mean TTFT minus the pods' own mean (their TTFT histogram):
      what the router, the proxy hops and the client add to every request;
    - pod TTFT: queueing in the pod plus prefill, as the pods measure it;
    - TTFT p90 of prefix hits (more than half the prompt cached) and of misses;
    - placement: prefix groups per pod and groups served by several pods.
    """
    header = [
        "rate",
        "router",
        "front TTFT (mean)",
        "pod TTFT (mean)",
        "TTFT p90 hits / misses",
        "groups per pod",
        "split groups",
        "requests per pod",
    ]
    rows = []
    for result in sorted(pooled, key=lambda r: (r.rate or 0.0, r.router)):
        ok = [o for o in result.outcomes if o.ok and o.ttft_s is not None and o.prompt_tokens]
        hits = [o.ttft_s for o in ok if o.cached_tokens * 2 > o.prompt_tokens]
        misses = [o.ttft_s for o in ok if o.cached_tokens * 2 <= o.prompt_tokens]
        placement = result.extra.get("placement") or {}
        per_pod = summarize(result)["requests_per_pod"]
        # Clients that do not see the serving pod (inference-perf) leave every count at 0.
        pods_known = any(o.pod for o in result.outcomes)
        rows.append(
            [
                f"{result.rate:g}" if result.rate is not None else "-",
                result.router,
                _ms1(result.extra.get("front_ttft_mean_s")),
                _ms(result.extra.get("pod_ttft_mean_s")),
                f"{_ms(percentile(hits, 90))} / {_ms(percentile(misses, 90))}",
                " ".join(str(v) for v in (placement.get("groups_per_pod") or {}).values()) or "-",
                str(placement.get("groups_on_several_pods", "-")),
                " ".join(str(v) for v in per_pod.values()) if pods_known else "-",
            ]
        )
    align = ["---", "---"] + ["---:"] * (len(header) - 2)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _ms1(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"
