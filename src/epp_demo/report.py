"""Summaries of workload runs, and a side-by-side table of several of them.

Two views of the prefix cache are reported, because they answer different questions:
- the pods' own hit rate (`epp_harness.stats.prefix_hit_rate`): the increase of
  `vllm:prefix_cache_hits_total` over the increase of `vllm:prefix_cache_queries_total`
  (both in tokens), summed over every pod, scraped before and after the run;
- the client's cached-token ratio: the sum of `usage.prompt_tokens_details.cached_tokens`
  over the sum of `usage.prompt_tokens` of the successful requests.

Percentiles are `epp_harness.stats.percentile` (linear interpolation between closest ranks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from epp.datalayer.metrics_parser import PodMetrics
from epp_harness.stats import percentile, prefix_hit_rate

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
    metrics_before: Mapping[str, PodMetrics],
    metrics_after: Mapping[str, PodMetrics],
    pods: Sequence[str] = (),
) -> RunSummary:
    """One run's summary. `metrics_before` / `metrics_after` are the pods' pages by name,
    scraped around the run; `pods` lists every pod so that idle ones show up with 0."""
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
        pod_hit_rate=prefix_hit_rate(metrics_before, metrics_after),
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
