"""Run summaries and the side-by-side table (percentiles and hit rates: tests/epp_harness)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from epp.datalayer.metrics_parser import PodMetrics
from epp_demo.report import format_table, summarize


def _pod(queries: float, hits: float) -> PodMetrics:
    return PodMetrics(prefix_queries=queries, prefix_hits=hits)


@dataclass
class FakeRecord:
    pod: str | None
    latency_s: float
    ttft_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _records() -> list[FakeRecord]:
    return [
        FakeRecord("pod-0", 0.100, 0.010, 1000, 900, 24),
        FakeRecord("pod-0", 0.200, 0.020, 1000, 800, 24),
        FakeRecord("pod-1", 0.300, 0.030, 2000, 0, 24),
        FakeRecord("pod-1", 0.400, 0.040, 2000, 1500, 24),
        FakeRecord(None, 5.0, None, None, None, None, error="HTTP 503: no pods"),
    ]


def test_summary_counts_spread_ratios_and_percentiles() -> None:
    summary = summarize(
        "EPP",
        _records(),
        duration_s=2.0,
        metrics_before={"pod-0": _pod(0, 0), "pod-1": _pod(0, 0)},
        metrics_after={
            "pod-0": _pod(2000, 1700),
            "pod-1": _pod(4000, 1500),
        },
        pods=["pod-0", "pod-1", "pod-2"],
    )
    assert (summary.requests, summary.ok, summary.failed) == (5, 4, 1)
    assert summary.requests_per_pod == {"pod-0": 2, "pod-1": 2, "pod-2": 0}
    assert summary.pod_hit_rate == pytest.approx(3200 / 6000)
    assert summary.client_cached_ratio == pytest.approx(3200 / 6000)
    assert summary.ttft_p50_s == pytest.approx(0.025)
    assert summary.latency_p50_s == pytest.approx(0.25)
    assert summary.output_tokens_per_s == pytest.approx(48.0)
    assert summary.error_samples == ("HTTP 503: no pods",)


def test_table_shows_every_run_side_by_side() -> None:
    common = {
        "duration_s": 1.0,
        "metrics_before": {"pod-0": _pod(0, 0)},
        "pods": ["pod-0", "pod-1"],
    }
    warm = summarize(
        "EPP (prefix+load aware)",
        _records()[:2],
        metrics_after={"pod-0": _pod(1000, 873)},
        **common,
    )
    cold = summarize(
        "Envoy round robin",
        _records()[2:4],
        metrics_after={"pod-0": _pod(1000, 212)},
        **common,
    )
    table = format_table([warm, cold])
    lines = table.splitlines()
    assert "EPP (prefix+load aware)" in lines[0]
    assert "Envoy round robin" in lines[0]
    hit_row = next(line for line in lines if line.startswith("prefix cache hit rate"))
    assert hit_row.split()[-2:] == ["87.3%", "21.2%"]
    ttft_row = next(line for line in lines if line.startswith("TTFT p50"))
    assert ttft_row.split()[-4:] == ["15.0", "ms", "35.0", "ms"]
    pod_rows = {line.split()[0]: line.split()[1:] for line in lines if line.startswith("  pod-")}
    assert pod_rows == {"pod-0": ["2", "0"], "pod-1": ["0", "2"]}
    assert "linear interpolation" in table
