"""epp bench soak's verdicts from recorded numbers: slopes, flat or not, histogram
quantiles over a window, the ceiling of a rate ladder, recovery after a burst."""

from __future__ import annotations

import math

import pytest

from epp_bench.soak.analysis import (
    Step,
    ceiling,
    growth,
    histogram_quantile,
    recovery_s,
    slope_per_minute,
)
from epp_bench.soak.sampler import parse_page


def test_slope_is_per_minute_and_ignores_noise_around_a_flat_line():
    times = [5.0 * i for i in range(120)]
    assert slope_per_minute(times, [100 + 0.01 * t for t in times]) == pytest.approx(0.6)
    noisy = [100 + (3 if i % 2 else -3) for i in range(120)]
    assert abs(slope_per_minute(times, noisy)) < 0.05  # +-3 swings, no trend


def test_a_leak_is_not_flat_and_a_breathing_heap_is():
    times = [5.0 * i for i in range(108)]
    leak = growth("rss_mb", "MB", times, [120 + t / 60 for t in times])  # 1 MB/min
    assert not leak.flat
    breathing = growth("rss_mb", "MB", times, [120 + 4 * math.sin(t / 30) for t in times])
    assert breathing.flat
    fds = growth("open_fds", "fds", times, [40 + (i // 20) for i in range(108)])  # 1 per 100 s
    assert not fds.flat


def test_histogram_quantile_interpolates_between_two_snapshots():
    before = {100.0: 10, 200.0: 10, 400.0: 10, math.inf: 10}
    after = {100.0: 10, 200.0: 60, 400.0: 110, math.inf: 110}  # 50 in (100,200], 50 in (200,400]
    assert histogram_quantile(0.5, before, after) == pytest.approx(200.0)
    assert histogram_quantile(0.25, before, after) == pytest.approx(150.0)
    assert histogram_quantile(0.99, before, after) == pytest.approx(396.0)
    assert histogram_quantile(0.5, after, after) is None


def _step(rate: float, p50: float, failed: int = 0, sent: float | None = None) -> Step:
    return Step(rate, rate if sent is None else sent, 100, failed, p50, p50 * 3)


def test_the_ceiling_is_the_last_rung_before_latency_climbs():
    ladder = [_step(10, 0.010), _step(15, 0.012), _step(22.5, 0.019), _step(33.8, 0.040)]
    assert ceiling(ladder) == 22.5  # 19 ms <= 1.5 x 10 ms + 5 ms; 40 ms is not
    assert ceiling([_step(10, 0.010), _step(15, 0.010, failed=1)]) == 10
    assert ceiling([_step(10, 0.010), _step(15, 0.010, sent=12.0)]) == 10  # not delivered
    assert ceiling([_step(10, 0.010, failed=2)]) is None


def test_recovery_is_when_the_median_returns_for_five_seconds():
    steady = 0.010
    points = [(t / 10, 0.200 if t < 35 else 0.011) for t in range(0, 200)]  # back at 3.5 s
    points += [(5.0 + k / 100, 0.500) for k in range(15)]  # one more bad second at 5 s
    # Seconds 4 is good but 5 is not: the five good seconds in a row start at 6.
    assert recovery_s(points, 0.0, 20.0, steady) == pytest.approx(6.0)
    assert recovery_s([(t / 10, 0.2) for t in range(100)], 0.0, 10.0, steady) is None
    assert recovery_s([(t / 10, 0.01) for t in range(100)], 0.0, 10.0, steady) == 0.0
    # A slow second long after recovery is other work, not the burst.
    late = [(t / 10, 0.3 if 150 <= t < 160 else 0.01) for t in range(200)]
    assert recovery_s(late, 0.0, 20.0, steady) == 0.0


def test_the_sampler_reads_tasks_and_decision_buckets_from_a_page():
    page = (
        "# TYPE epp_asyncio_tasks gauge\nepp_asyncio_tasks 42.0\n"
        "# TYPE epp_scoring_latency_us histogram\n"
        'epp_scoring_latency_us_bucket{le="100.0"} 3.0\n'
        'epp_scoring_latency_us_bucket{le="+Inf"} 5.0\n'
        "epp_scoring_latency_us_count 5.0\nepp_scoring_latency_us_sum 900.0\n"
    )
    tasks, nodes, buckets = parse_page(page)
    assert tasks == 42
    assert math.isnan(nodes)  # not on this page
    assert buckets == {100.0: 3.0, math.inf: 5.0}
