"""`epp bench loop`: registered, each load does real work in both arrangements (a small
real run: real ZMQ publisher process, the service's own components and web app), and the
summary takes the median of the runs."""

from __future__ import annotations

import importlib

from epp_bench.cli import BENCHMARKS
from epp_bench.picker.loop import PHASES, PhaseResult, Settings, markdown, run, summary


def test_it_is_an_epp_bench_subcommand() -> None:
    module = importlib.import_module(BENCHMARKS["loop"][0])
    assert callable(module.main)


async def test_a_small_run_measures_every_load_on_and_off_the_loop() -> None:
    settings = Settings(
        fleet=40, rate=40, phase_s=0.5, repeats=1, kv_pods=3, batches=20, blocks=4,
        relist_ms=100, pages_ms=100,
    )  # fmt: skip
    results, costs = await run(settings, ["kv", "relist", "pages", "metrics"])
    phases = {(r.load, r.where): r for r in results}
    assert set(phases) == set(PHASES)
    for result in results:
        assert result.decisions == 20 and 0 < result.p50_us <= result.p99_us <= result.max_us
    for where in ("on", "off", "frozen"):
        kv = phases["kv", where].work
        assert kv["batches"] > 0 and kv["gaps"] == 0, kv  # events reached the index
        assert phases["relist", where].work["relists"] >= 2
    # Threads: the receiver's one (off the loop) beside the loop's own and the runtime's.
    assert phases["kv", "off"].work["threads"] == phases["kv", "on"].work["threads"] + 1
    for load, where in PHASES:
        if load in ("pages", "metrics"):
            work = phases[load, where].work
            assert work["pages"] >= 2 and work["largest_page_kib"] > 1, (load, where)
    assert costs["/metrics exposition"] > 0


async def test_followed_pods_may_share_publishers() -> None:
    """`kv_publishers`: 12 followed pods on 3 publisher sockets, every pod's batches
    applied (each publisher's batches reach its 4 subscribers)."""
    settings = Settings(
        fleet=20, rate=40, phase_s=0.5, repeats=1, kv_pods=12, kv_publishers=3, batches=20,
        blocks=4,
    )  # fmt: skip
    results, _ = await run(settings, ["kv"])
    kv = {r.where: r.work for r in results if r.load == "kv"}
    for work in kv.values():
        assert work["batches"] >= 12 * 5 and work["gaps"] == 0, work


def test_the_summary_is_the_median_of_the_runs() -> None:
    results = [
        PhaseResult("kv", "on", n, 10, p50_us=1000.0 * n, p99_us=5000.0 * n, max_us=9000.0 * n)
        for n in (1, 3, 2)
    ]
    (row,) = summary(results)
    assert (row["p50_ms"], row["p99_ms"], row["p99_worst_ms"], row["max_ms"]) == (2, 10, 15, 27)
    assert row["p99_runs_ms"] == [5, 15, 10]
    assert "| kv | on the loop | 3 | 2.00 | 10.00 | 5.00, 15.00, 10.00 | 27.00 |" in markdown([row])
