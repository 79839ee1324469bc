"""`epp bench scale` at a tiny size (`--quick`): in one process, no process started (the
commit lookup, a `git` call, is replaced). The run must put its requests in flight through
the Router and keep them open, spread over every pod; its measured requests must meet the
prefix state it built (the shared system prompts' real hashes); the drain must close every
request; and the report must carry the figures the docs quote."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from epp_bench.cli import BENCHMARKS
from epp_bench.picker import scale
from epp_bench.picker.scale import INTERVALS, QUICK, cores, render, run

TINY = dataclasses.replace(QUICK, pods=12, small_pods=4, in_flight=60, decisions=20)


def test_it_is_an_epp_bench_subcommand() -> None:
    module = importlib.import_module(BENCHMARKS["scale"][0])
    assert module is scale and callable(module.main)


async def test_a_tiny_run_holds_its_requests_open_and_drains_them() -> None:
    report = await run(TINY)

    # The measured chats meet the shared system prompts the pods hold (real hashes).
    index = report.index
    assert index["probe blocks"] >= 200  # a 4k-token chat, 16-token blocks
    assert index["pods holding 90 % of the probe"] >= 1
    assert index["longest match (blocks)"] >= 0.9 * index["probe blocks"]

    fill = report.fill
    assert fill["requests routed and open"] == TINY.in_flight
    assert fill["pods used"] == TINY.pods  # spread by the router, not all on one pod
    assert report.drain["completions"] == TINY.in_flight
    assert report.drain["open after"] == 0

    arms = {a.name: a for a in report.arms}
    assert set(arms) == {"small fleet, idle", "large fleet, idle", "large fleet, loaded"}
    assert (arms["small fleet, idle"].pods, arms["small fleet, idle"].in_flight) == (4, 0)
    assert (arms["large fleet, loaded"].pods, arms["large fleet, loaded"].in_flight) == (12, 60)
    for arm in arms.values():
        assert arm.decisions == 18  # the first tenth warms up
        assert 0 < arm.p50_us <= arm.p99_us and arm.cpu_us > 0

    memory = report.memory
    assert memory["large: index blocks recorded"] == TINY.pods * TINY.blocks_per_pod
    for key in (
        "small: store traced KB per pod",
        "small: index traced KB per pod",
        "small: traced KB per open request",
        "large: traced KB per open request",
        "RSS MB, process at full load",
    ):
        assert memory[key] > 0, key

    scrape = report.scrape
    assert 0 < scrape["filtered page bytes"] < scrape["whole page bytes"]
    for name, us, by_interval in cores(report, TINY):
        assert us > 0, name
        for label, seconds in INTERVALS.items():
            assert by_interval[label] == pytest.approx(us / 1e6 * TINY.pods / seconds, abs=1e-3)
    assert "large fleet, loaded" in render(report, TINY)


def test_main_prints_the_figures_and_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(scale, "commit", lambda: "abc1234")
    monkeypatch.setattr(scale, "QUICK", TINY)
    # The product's logging set-up binds the stream it is given (here pytest's capture,
    # closed after this test) into every module logger it caches: recorded, not run, so
    # the tests after this one still log.
    levels: list[str] = []
    monkeypatch.setattr(scale, "configure_logging", levels.append)
    out = tmp_path / "scale.json"
    assert scale.main(["--quick", "--out", str(out)]) == 0
    assert levels == ["warning"]
    printed = capsys.readouterr().out
    assert "rerun: epp bench scale --quick --out" in printed
    assert "cores at 50 ms (busy)" in printed
    saved = json.loads(out.read_text())
    assert saved["commit"] == "abc1234"
    assert saved["fill"]["requests routed and open"] == TINY.in_flight
    assert saved["helm_memory_mb"] >= 256
