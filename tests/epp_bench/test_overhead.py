from __future__ import annotations

import pytest

from epp_bench.picker.overhead import (
    GRPC_PART,
    WORK_TREE_SRC,
    ExtProcCost,
    StepTiming,
    _markdown,
    ext_proc_cost,
    in_process,
    probe_steps,
    profile_split,
    scraping,
    split_rows,
)


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


def test_the_probe_times_the_edge_and_every_step_of_the_code_it_is_pointed_at():
    """overhead_probe.py runs in a child that imports `epp` from the code it is given (the
    before column uses a frozen commit the same way)."""
    steps = probe_steps(WORK_TREE_SRC, "steps", pods=4, prompt_tokens=512, iterations=30)
    names = [s.step for s in steps]
    for part in ("protobuf: parse", "protobuf: serialize", "ext_proc machine", "observer stream",
                 "parse JSON body", "tokenize", "hash blocks", "prefix index lookup",
                 "filter + score + pick", "record blocks", "whole decision",
                 "decision's metrics", "completion"):  # fmt: skip
        assert any(name.startswith(part) for name in names), part
    assert all(s.mean_us > 0 for s in steps)
    info = probe_steps(WORK_TREE_SRC, "parts", pods=4, prompt_tokens=512, iterations=30,
                       log_level="info")  # fmt: skip
    assert [s.step for s in info] == [
        n for n in names if n.startswith(("decision's", "completion"))
    ]


@pytest.mark.e2e
def test_the_real_ext_proc_server_routes_every_request_the_driver_sends():
    """The gRPC rows: the bare floor and the EPP each answer the routing stream with the
    destination for every request (ext_proc_cost raises otherwise) and report CPU."""
    costs = ext_proc_cost(
        {"floor": None, "after": WORK_TREE_SRC}, requests=20, rounds=1, pods=4, prompt_tokens=512
    )
    assert [c.server for c in costs] == ["floor", "after"]
    assert all(c.cpu_us_per_request >= 0 and len(c.rounds_us) == 1 for c in costs)


def test_the_report_has_before_and_after_columns_and_splits_the_cpu_per_request():
    def steps(scale: float) -> list[StepTiming]:
        names = ["protobuf: parse 2 + 2 messages", "ext_proc machine (2 messages, replies)",
                 "parse JSON body", "filter + score + pick", "whole decision (Router.route)",
                 "decision's metrics and log lines (inside it)", "completion (Router.complete)"]  # fmt: skip
        values = [3.0, 20.0, 20.0, 80.0, 300.0, 40.0, 20.0]
        return [
            StepTiming(n, v * scale, v * scale, v * scale)
            for n, v in zip(names, values, strict=True)
        ]

    compared = {"before": steps(2.0), "after": steps(1.0)}
    edge = [
        ExtProcCost("gRPC floor (bare servicer)", 100, 1000.0, [1000.0]),
        ExtProcCost("EPP before", 100, 2000.0, [2000.0]),
        ExtProcCost("EPP after", 100, 1500.0, [1500.0]),
    ]
    report = _markdown(compared["after"], [], "epp bench overhead", None, compared, edge, "HEAD")
    assert "| whole decision (Router.route) | 600.0 | 300.0 | 600.0 | 300.0 | 0.50 |" in report
    assert "| EPP after | 100 | 1500 | 1500 |" in report
    rows = dict(split_rows(compared["after"], 1500.0, 1000.0))
    assert (
        rows["rest of the decision (preparation, dispatch, accounting)"] == 300 - 80 - 20 - 40 - 20
    )
    # every part of the total is accounted for exactly once
    assert sum(rows.values()) == pytest.approx(1500.0)


def test_a_py_spy_profile_is_split_by_the_innermost_part_and_idle_samples_are_dropped(tmp_path):
    raw = tmp_path / "epp.raw"
    raw.write_text(
        "run (asyncio/runners.py:1);ExternalProcessor._decide (epp/extproc/server.py:9);"
        "Scheduler.schedule (epp/scheduling/scheduler.py:90);"
        "Histogram.observe (prometheus_client/metrics.py:679) 3\n"
        "run (asyncio/runners.py:1);ExternalProcessor._decide (epp/extproc/server.py:9);"
        "Scheduler.schedule (epp/scheduling/scheduler.py:90) 5\n"
        "run (asyncio/runners.py:1);Handle._run (asyncio/events.py:80) 7\n"
        "run (asyncio/runners.py:1);EpollSelector.select (selectors.py:468) 100\n"
        "Thread._bootstrap (threading.py:1);Thread.run (threading.py:982) 50\n"
    )
    busy, parts = profile_split(raw)
    assert busy == 15
    assert dict(parts) == {"metrics": 3, "score (filter + score + pick)": 5, GRPC_PART: 7}
