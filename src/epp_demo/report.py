"""Summaries of workload runs, and a side-by-side table of several of them.

Two views of the prefix cache are reported, because they answer different questions:
- the pods' own hit rate: the increase of `vllm:prefix_cache_hits_total` over the increase
  of `vllm:prefix_cache_queries_total` (both in tokens), summed over every pod, scraped
  before and after the run;
- the client's cached-token ratio: the sum of `usage.prompt_tokens_details.cached_tokens`
  over the sum of `usage.prompt_tokens` of the successful requests.

Percentiles use linear interpolation between closest ranks (numpy's default "linear"
method): the p-th percentile of n sorted values sits at position (n - 1) * p / 100.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

HITS_METRIC = "vllm:prefix_cache_hits_total"
QUERIES_METRIC = "vllm:prefix_cache_queries_total"
_ERROR_SAMPLES = 5


class RequestOutcome(Protocol):
    """The fields of a client request record that a summary reads."""

    @property
    def ok(self) -> bool: ...

    pod: str | None
    latency_s: float
    ttft_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class PrefixCacheCounters:
    """A pod's prefix-cache counters (tokens), summed over all label sets."""

    queries: float = 0.0
    hits: float = 0.0


def _sample_value(rest: str) -> float | None:
    """The value of a sample line after its metric name: `{labels} value [timestamp]`."""
    if rest.startswith("{"):
        # Label values may contain spaces or braces inside quotes; skip them as a unit.
        in_quotes = escaped = False
        for index, char in enumerate(rest):
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_quotes = not in_quotes
            elif char == "}" and not in_quotes:
                rest = rest[index + 1 :]
                break
        else:
            return None
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_prefix_cache_counters(text: str) -> PrefixCacheCounters:
    """Sum the two prefix-cache counters of a Prometheus text page; ignore everything else.

    Tolerant by design: unknown lines, malformed samples and non-finite values are skipped,
    so a page with garbage still yields whatever valid samples it has.
    """
    totals = {HITS_METRIC: 0.0, QUERIES_METRIC: 0.0}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("vllm:prefix_cache_"):
            continue
        for name in totals:
            rest = line[len(name) :]
            # The name must end here: `..._total_foo` is another metric.
            if line.startswith(name) and rest[:1] in ("{", " ", "\t"):
                value = _sample_value(rest)
                if value is not None:
                    totals[name] += value
                break
    return PrefixCacheCounters(queries=totals[QUERIES_METRIC], hits=totals[HITS_METRIC])


def _counter_increase(before: float, after: float) -> float:
    # A counter that went down was reset (the pod restarted): all of `after` is new.
    return after - before if after >= before else after


def pod_hit_rate(
    before: Mapping[str, PrefixCacheCounters], after: Mapping[str, PrefixCacheCounters]
) -> float | None:
    """Hits over queries of the run, summed over the pods scraped both times; None if no query."""
    hits = queries = 0.0
    for pod, end in after.items():
        start = before.get(pod)
        if start is None:
            continue
        hits += _counter_increase(start.hits, end.hits)
        queries += _counter_increase(start.queries, end.queries)
    return hits / queries if queries > 0 else None


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


@dataclass(frozen=True, slots=True)
class RunSummary:
    label: str
    requests: int
    ok: int
    failed: int
    duration_s: float
    requests_per_pod: dict[str, int]
    pod_hit_rate: float | None
    client_cached_ratio: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    latency_p90_s: float | None
    output_tokens_per_s: float | None
    error_samples: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(
    label: str,
    records: Sequence[RequestOutcome],
    *,
    duration_s: float,
    counters_before: Mapping[str, PrefixCacheCounters],
    counters_after: Mapping[str, PrefixCacheCounters],
    pods: Sequence[str] = (),
) -> RunSummary:
    """One run's summary. `pods` lists every pod so that idle ones show up with 0."""
    succeeded = [r for r in records if r.ok]
    per_pod: Counter[str] = Counter({pod: 0 for pod in pods})
    per_pod.update(r.pod or "(unknown)" for r in succeeded)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in succeeded if r.cached_tokens is not None)
    cached_tokens = sum(r.cached_tokens or 0 for r in succeeded)
    output_tokens = sum(r.output_tokens or 0 for r in succeeded)
    ttfts = [r.ttft_s for r in succeeded if r.ttft_s is not None]
    latencies = [r.latency_s for r in succeeded]
    return RunSummary(
        label=label,
        requests=len(records),
        ok=len(succeeded),
        failed=len(records) - len(succeeded),
        duration_s=duration_s,
        requests_per_pod=dict(sorted(per_pod.items())),
        pod_hit_rate=pod_hit_rate(counters_before, counters_after),
        client_cached_ratio=cached_tokens / prompt_tokens if prompt_tokens else None,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        latency_p50_s=percentile(latencies, 50),
        latency_p90_s=percentile(latencies, 90),
        output_tokens_per_s=output_tokens / duration_s if duration_s > 0 else None,
        error_samples=tuple(r.error for r in records if r.error)[:_ERROR_SAMPLES],
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def _rows(summaries: Sequence[RunSummary]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = [
        ("requests ok / failed", [f"{s.ok} / {s.failed}" for s in summaries]),
        ("wall time", [f"{s.duration_s:.1f} s" for s in summaries]),
        ("prefix cache hit rate (pods)", [_pct(s.pod_hit_rate) for s in summaries]),
        ("cached prompt tokens (client)", [_pct(s.client_cached_ratio) for s in summaries]),
        ("TTFT p50", [_ms(s.ttft_p50_s) for s in summaries]),
        ("TTFT p90", [_ms(s.ttft_p90_s) for s in summaries]),
        ("TTFT p99", [_ms(s.ttft_p99_s) for s in summaries]),
        ("latency p50", [_ms(s.latency_p50_s) for s in summaries]),
        ("latency p90", [_ms(s.latency_p90_s) for s in summaries]),
        (
            "output tokens/s",
            [
                "-" if s.output_tokens_per_s is None else f"{s.output_tokens_per_s:.0f}"
                for s in summaries
            ],
        ),
    ]
    pods = sorted({pod for s in summaries for pod in s.requests_per_pod})
    rows.append(("requests per pod", ["" for _ in summaries]))
    rows.extend(
        (f"  {pod}", [str(s.requests_per_pod.get(pod, 0)) for s in summaries]) for pod in pods
    )
    return rows


def format_table(summaries: Sequence[RunSummary]) -> str:
    """A plain-text table: one row per metric, one column per run."""
    if not summaries:
        return ""
    rows = _rows(summaries)
    header = ["", *(s.label for s in summaries)]
    body = [[name, *cells] for name, cells in rows]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    notes = (
        "hit rate: delta of vllm:prefix_cache_hits_total / delta of "
        "vllm:prefix_cache_queries_total, summed over pods",
        "percentiles: linear interpolation over successful requests",
    )
    return "\n".join([line(header), rule, *(line(row) for row in body), "", *notes]) + "\n"
