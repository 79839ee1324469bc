"""One RunResult -> the figures every benchmark report shows, as a flat dict.

Definitions (the same for virtual and live runs):

- Percentiles (TTFT, end-to-end latency) are over successful requests only, by linear
  interpolation between closest ranks: the p-th percentile of n sorted values sits at
  position (n - 1) * p / 100 (numpy's default; `epp_harness.stats.percentile`).
- Throughput is output tokens of successful requests divided by the run's span: from the
  first request sent to the last one ended (`RunResult.duration_s`).
- Hit rate is what the pods report: prefix-cache hits / queries, in tokens, summed over
  the pods (vLLM's `prefix_cache_hits_total` / `prefix_cache_queries_total` deltas).
- Load spread is over requests sent to each pod (served or refused by the pod), every pod
  of the fleet counted, idle ones as 0: max / mean and the coefficient of variation
  (population standard deviation / mean). 1.0 and 0.0 mean perfectly even.
- Offered and completion rates: requests sent per second between the first and the last
  send, and successful requests ended per second between the first and the last end. A
  router that keeps up completes at the offered rate; a saturated one completes at its
  capacity while its queues grow.
- EPP CPU per decision: process CPU time inside the EPP's `route()`, mean over decisions.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from epp_bench.workloads.types import RunResult
from epp_harness.stats import percentile

# Keys of `summarize`, in the order the tables show them.
SUMMARY_KEYS = (
    "router",
    "workload",
    "rate",
    "pods",
    "mode",
    "requests",
    "ok",
    "failed",
    "failed_by_status",
    "duration_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "latency_p50_s",
    "latency_p90_s",
    "latency_p99_s",
    "output_tokens",
    "output_tokens_per_s",
    "requests_per_s",
    "offered_rps",
    "completion_rps",
    "pod_hit_rate",
    "client_cached_ratio",
    "requests_per_pod",
    "load_max_over_mean",
    "load_cv",
    "epp_cpu_us_per_decision",
)


def _pod_counts(result: RunResult) -> dict[str, int]:
    names: list[str] = list(result.extra.get("pod_names") or [])
    counts: Counter[str] = Counter(dict.fromkeys(names, 0))
    counts.update(o.pod for o in result.outcomes if o.pod is not None)
    # Pods never named and never used still count, so spread is over the whole fleet.
    for filler in range(max(0, result.pods - len(counts))):
        counts[f"(idle {filler})"] = 0
    return dict(sorted(counts.items(), key=lambda item: _natural(item[0])))


def _natural(name: str) -> tuple[str, int]:
    head = name.rstrip("0123456789")
    tail = name[len(head) :]
    return head, int(tail) if tail else -1


def load_spread(counts: list[int]) -> tuple[float | None, float | None]:
    """(max / mean, coefficient of variation) of per-pod request counts."""
    if not counts:
        return None, None
    mean = sum(counts) / len(counts)
    if mean == 0:
        return None, None
    variance = sum((c - mean) ** 2 for c in counts) / len(counts)
    return max(counts) / mean, math.sqrt(variance) / mean


def _rate_between(times: list[float]) -> float | None:
    """Events per second between the first and the last of `times` (None below two)."""
    if len(times) < 2:
        return None
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else None


def summarize(result: RunResult) -> dict[str, Any]:
    """The summary of one run (see the module docstring for every definition).

    A result loaded from a summary-only JSON file (no outcomes) returns its stored summary.
    """
    if not result.outcomes and "summary" in result.extra:
        return dict(result.extra["summary"])
    ok = [o for o in result.outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    latencies = [o.latency_s for o in ok]
    output_tokens = sum(o.output_tokens for o in ok)
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    cached_tokens = sum(o.cached_tokens for o in ok)
    duration = result.duration_s
    per_pod = _pod_counts(result)
    max_over_mean, cv = load_spread(list(per_pod.values()))
    failed = Counter(str(o.status) for o in result.outcomes if not o.ok)
    return {
        "router": result.router,
        "workload": result.workload,
        "rate": result.rate,
        "pods": result.pods,
        "mode": result.mode,
        "requests": len(result.outcomes),
        "ok": len(ok),
        "failed": len(result.outcomes) - len(ok),
        "failed_by_status": dict(sorted(failed.items())),
        "duration_s": duration,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p90_s": percentile(latencies, 90),
        "latency_p99_s": percentile(latencies, 99),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else None,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "offered_rps": _rate_between([o.start_s for o in result.outcomes]),
        "completion_rps": _rate_between([o.start_s + o.latency_s for o in ok]),
        "pod_hit_rate": result.pod_hit_rate,
        "client_cached_ratio": cached_tokens / prompt_tokens if prompt_tokens else None,
        "requests_per_pod": per_pod,
        "load_max_over_mean": max_over_mean,
        "load_cv": cv,
        "epp_cpu_us_per_decision": result.epp_cpu_us_per_decision,
    }
