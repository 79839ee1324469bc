from __future__ import annotations

import pytest

from epp_bench.picker.overhead import _markdown, in_process, scraping


def test_in_process_times_every_step_of_a_decision():
    steps = in_process(pods=4, prompt_tokens=512, prefixes_per_pod=2, iterations=30)
    timed = [s for s in steps if s.p50_us > 0]
    assert [s.step for s in timed][-1] == "whole decision (Router.route)"
    assert all(0 < s.p50_us <= s.p99_us for s in timed)
    whole = timed[-1].mean_us
    assert whole > max(s.mean_us for s in timed[:-1]) * 0.5  # the whole is not cheaper than a part
    report = _markdown(steps, [], "epp bench overhead")
    assert "| prefix index lookup |" in report


@pytest.mark.e2e
def test_scraping_cost_is_measured_on_a_real_epp_process():
    cost = scraping(pods=2, seconds=0.6)
    assert cost.scrapes > 10  # ~40/s expected
    assert 0 < cost.epp_cpu_cores < 2
    assert "cores for 100 pods" in _markdown([], [], "x", cost)
