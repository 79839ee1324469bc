"""Percentiles and the pods' prefix-cache hit rate, as the demo and the benchmarks report them."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.datalayer.metrics_parser import PodMetrics, parse_vllm_metrics
from epp_harness.stats import counter_increase, percentile, prefix_hit_rate

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


@pytest.mark.parametrize("p", [-1, 101])
def test_percentile_out_of_range_is_rejected(p: float) -> None:
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], p)


def _pod(queries: float, hits: float) -> PodMetrics:
    return PodMetrics(prefix_queries=queries, prefix_hits=hits)


def test_counter_increase_treats_a_fall_as_a_reset() -> None:
    assert counter_increase(10.0, 25.0) == 15.0
    assert counter_increase(10.0, 4.0) == 4.0


def test_hit_rate_is_the_ratio_of_summed_deltas() -> None:
    before = {"pod-0": _pod(1000, 500), "pod-1": _pod(0, 0)}
    # +2000 queries, +1500 hits on pod-0; +1000 queries, +100 hits on pod-1.
    after = {"pod-0": _pod(3000, 2000), "pod-1": _pod(1000, 100)}
    assert prefix_hit_rate(before, after) == pytest.approx(1600 / 3000)


def test_hit_rate_handles_resets_and_missing_pods() -> None:
    before = {"pod-0": _pod(5000, 4000), "pod-1": _pod(100, 50)}
    # pod-0 restarted (counters fell: all of `after` is new); pod-1 was not scraped after,
    # pod-2 not before: both are left out.
    after = {"pod-0": _pod(400, 100), "pod-2": _pod(999, 999)}
    assert prefix_hit_rate(before, after) == pytest.approx(100 / 400)


def test_hit_rate_without_queries_is_none() -> None:
    same = {"pod-0": _pod(10, 5)}
    assert prefix_hit_rate(same, same) is None


def test_hit_rate_between_real_vllm_pages_in_new_and_old_metric_names() -> None:
    """The pages are read by the router's parser: vLLM's current names, and the
    `vllm:gpu_prefix_cache_*` names of older releases, give the same counters."""
    page = FIXTURE.read_text()
    before = parse_vllm_metrics(page)
    assert (before.prefix_queries, before.prefix_hits) == (918234.0, 512000.0)
    later = page.replace("918234.0", "928234.0").replace("512000.0", "519500.0")
    old_names = later.replace("vllm:prefix_cache_", "vllm:gpu_prefix_cache_")
    for after_page in (later, old_names):
        after = parse_vllm_metrics(after_page)
        assert prefix_hit_rate({"pod-0": before}, {"pod-0": after}) == pytest.approx(0.75)
