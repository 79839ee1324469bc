"""Numbers the demo and the benchmarks report the same way.

Percentiles use linear interpolation between closest ranks (numpy's default "linear"
method): the p-th percentile of n sorted values sits at position (n - 1) * p / 100.

The pods' own prefix-cache hit rate over a run is the increase of
`vllm:prefix_cache_hits_total` over the increase of `vllm:prefix_cache_queries_total` (both
in tokens), summed over the pods, between a scrape before the run and one after. The pages
are read by the router's own parser (`epp.datalayer.metrics_parser.parse_vllm_metrics`),
which also knows the older `vllm:gpu_prefix_cache_*` names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from epp.datalayer.metrics_parser import PodMetrics


def percentile(values: Iterable[float], p: float) -> float | None:
    """The p-th percentile (0..100) by linear interpolation; None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {p}")
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * p / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


def counter_increase(before: float, after: float) -> float:
    """How much a counter grew; one that went down was reset (the pod restarted), so all of
    `after` is new."""
    return after - before if after >= before else after


def prefix_hit_rate(
    before: Mapping[str, PodMetrics], after: Mapping[str, PodMetrics]
) -> float | None:
    """Hits over queries of the run, summed over the pods scraped both times (by name);
    None if no query was counted."""
    hits = queries = 0.0
    for pod, end in after.items():
        start = before.get(pod)
        if start is None:
            continue
        hits += counter_increase(start.prefix_hits, end.prefix_hits)
        queries += counter_increase(start.prefix_queries, end.prefix_queries)
    return hits / queries if queries > 0 else None
