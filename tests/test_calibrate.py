"""epp calibrate: the fit from samples, and a measurement against a real simulated pod."""

from __future__ import annotations

import pytest

from epp.calibrate import Sample, fit, measure
from epp_harness.stack import LocalStack


def test_fit_recovers_slope_intercept_and_cached_cost():
    per_token, overhead, cached = 0.0002, 0.01, 0.00001
    short = [Sample(100, overhead + 100 * per_token)] * 3
    long = [Sample(700, overhead + 700 * per_token)] * 3
    hit = [Sample(700, overhead + 700 * cached)] * 3
    result = fit(short, long, hit)
    assert result.per_token_s == pytest.approx(per_token)
    assert result.overhead_s == pytest.approx(overhead)
    assert result.per_cached_token_s == pytest.approx(cached)
    assert "per_token_s: 0.0002" in result.yaml()


def test_fit_never_returns_inconsistent_costs():
    noisy = fit([Sample(100, 0.5)], [Sample(700, 0.4)], [Sample(700, 0.9)])
    assert noisy.per_token_s == 0.0
    assert noisy.per_cached_token_s <= noisy.per_token_s
    with pytest.raises(ValueError):
        fit([Sample(700, 0.1)], [Sample(100, 0.2)], [Sample(100, 0.1)])


@pytest.mark.e2e
def test_calibrating_a_simulated_pod_finds_its_configured_prefill_speed(tmp_path):
    # 1 ms per prompt token: large against HTTP noise, so a factor of 2 is a real miss.
    args = ["--prefill-per-token-ms", "1.0", "--decode-per-token-ms", "1"]
    with LocalStack(pods=1, mode="round_robin", sim_args=args, work_dir=tmp_path) as stack:
        pod = stack.pods[0]
        result = measure(pod.base_url, stack.model, 100, 600, 3, 30.0)
    assert 0.0005 < result.per_token_s < 0.002
    assert result.per_cached_token_s < result.per_token_s / 5
