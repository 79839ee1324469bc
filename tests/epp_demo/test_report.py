"""Run summaries: percentiles, the prefix-cache counter parser, hit-rate deltas, the table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from epp_demo.report import (
    PrefixCacheCounters,
    format_table,
    parse_prefix_cache_counters,
    percentile,
    pod_hit_rate,
    summarize,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.33-metrics.txt"


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([1, 2, 3, 4, 5], 50, 3.0),
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90, 9.1),
        ([10, 20], 0, 10.0),
        ([10, 20], 100, 20.0),
        ([5, 1, 4, 2, 3], 25, 2.0),
        ([42], 99, 42.0),
        (list(range(1, 101)), 99, 99.01),
    ],
)
def test_percentile_linear_interpolation(values: list[float], p: float, expected: float) -> None:
    assert percentile(values, p) == pytest.approx(expected)


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None


def test_percentile_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_parser_reads_the_real_vllm_page() -> None:
    counters = parse_prefix_cache_counters(FIXTURE.read_text())
    assert counters == PrefixCacheCounters(queries=918234.0, hits=512000.0)


def test_parser_sums_label_sets_and_skips_lookalikes_and_garbage() -> None:
    page = "\n".join(
        [
            "# HELP vllm:prefix_cache_hits_total doc",
            "# TYPE vllm:prefix_cache_hits_total counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="a b {c}"} 10.0',
            'vllm:prefix_cache_hits_total{engine="1",model_name="x\\"y"} 5 1700000000000',
            "vllm:prefix_cache_hits_total 1e1",
            'vllm:prefix_cache_hits_total_extra{engine="0"} 1000',
            'vllm:prefix_cache_hits_created{engine="0"} 1.79e9',
            'vllm:external_prefix_cache_hits_total{engine="0"} 77',
            'vllm:prefix_cache_hits_total{engine="2"} not-a-number',
            'vllm:prefix_cache_hits_total{engine="3"} NaN',
            'vllm:prefix_cache_hits_total{engine="4" 9',
            'vllm:prefix_cache_queries_total{engine="0"} 100',
            "garbage line {{{",
            "",
        ]
    )
    assert parse_prefix_cache_counters(page) == PrefixCacheCounters(queries=100.0, hits=25.0)


def test_parser_on_an_empty_page_gives_zeros() -> None:
    assert parse_prefix_cache_counters("") == PrefixCacheCounters()


def test_hit_rate_is_the_ratio_of_summed_deltas() -> None:
    before = {
        "pod-0": PrefixCacheCounters(queries=1000, hits=500),
        "pod-1": PrefixCacheCounters(queries=0, hits=0),
    }
    after = {
        "pod-0": PrefixCacheCounters(queries=3000, hits=2000),  # +2000 queries, +1500 hits
        "pod-1": PrefixCacheCounters(queries=1000, hits=100),  # +1000 queries, +100 hits
    }
    assert pod_hit_rate(before, after) == pytest.approx(1600 / 3000)


def test_hit_rate_handles_resets_and_missing_pods() -> None:
    before = {
        "pod-0": PrefixCacheCounters(queries=5000, hits=4000),
        "pod-1": PrefixCacheCounters(queries=100, hits=50),
    }
    # pod-0 restarted (counters fell: all of `after` is new); pod-1 was not scraped after.
    after = {
        "pod-0": PrefixCacheCounters(queries=400, hits=100),
        "pod-2": PrefixCacheCounters(queries=999, hits=999),
    }
    assert pod_hit_rate(before, after) == pytest.approx(100 / 400)


def test_hit_rate_without_queries_is_none() -> None:
    same = {"pod-0": PrefixCacheCounters(queries=10, hits=5)}
    assert pod_hit_rate(same, same) is None


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
        counters_before={"pod-0": PrefixCacheCounters(0, 0), "pod-1": PrefixCacheCounters(0, 0)},
        counters_after={
            "pod-0": PrefixCacheCounters(2000, 1700),
            "pod-1": PrefixCacheCounters(4000, 1500),
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
        "counters_before": {"pod-0": PrefixCacheCounters(0, 0)},
        "pods": ["pod-0", "pod-1"],
    }
    warm = summarize(
        "EPP (prefix+load aware)",
        _records()[:2],
        counters_after={"pod-0": PrefixCacheCounters(1000, 873)},
        **common,
    )
    cold = summarize(
        "Envoy round robin",
        _records()[2:4],
        counters_after={"pod-0": PrefixCacheCounters(1000, 212)},
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
