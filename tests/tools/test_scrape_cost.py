"""The pure parts of tools/vllm_check/scrape_cost.py: the arm order and the per-scrape math.

The tool itself starts a real vLLM (minutes, `make vllm-setup`); nothing here does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "vllm_check"))

import scrape_cost as sc


def test_schedule_alternates_every_arm_once_per_round() -> None:
    order = sc.schedule(("idle", "gzip", "filtered"), 2)
    assert order == [
        (0, "idle"), (0, "gzip"), (0, "filtered"),
        (1, "idle"), (1, "gzip"), (1, "filtered"),
    ]  # fmt: skip


def test_extra_cpu_per_scrape_subtracts_the_rounds_idle_rate() -> None:
    idle = sc.Window(0, "idle", wall_s=10.0, engine_cpu_s=0.5)  # 0.05 core idle
    arm = sc.Window(0, "gzip", wall_s=8.0, engine_cpu_s=1.2, scrapes=160)
    # 1.2 s used, 0.4 s of it idle over 8 s: 0.8 s for 160 scrapes = 5 ms each.
    assert sc.extra_ms_per_scrape(arm, idle) == pytest.approx(5.0)
    assert sc.extra_ms_per_scrape(sc.Window(0, "gzip", 8.0, 1.0), idle) is None  # no scrape


def test_summary_per_arm_median_range_and_cores_at_rate() -> None:
    windows = []
    for r, (idle_cpu, filtered_cpu) in enumerate([(0.1, 0.26), (0.3, 0.40), (0.2, 0.42)]):
        windows.append(sc.Window(r, "idle", 10.0, idle_cpu))
        windows.append(sc.Window(r, "filtered", 10.0, filtered_cpu, scrapes=200, page_bytes=2976))
    summary = sc.summarize(windows, rate_hz=20.0)
    # Per round: (0.26-0.1)/200 = 0.8 ms, (0.40-0.3)/200 = 0.5 ms, (0.42-0.2)/200 = 1.1 ms.
    filtered = summary["filtered"]
    assert filtered["ms_per_scrape_rounds"] == [0.8, 0.5, 1.1]
    assert filtered["ms_per_scrape_median"] == 0.8
    assert filtered["ms_per_scrape_range"] == [0.5, 1.1]
    assert filtered["cores_per_engine_at_rate"] == pytest.approx(0.016)  # 0.8 ms x 20/s
    assert filtered["scrapes_per_s"] == 20.0
    assert filtered["page_bytes"] == 2976 and filtered["encoding"] == "identity"
    assert summary["idle"]["engine_cores_median"] == pytest.approx(0.02)
    assert summary["idle"]["engine_cores_range"] == [0.01, 0.03]
    table = sc.render_table(summary, 20.0)
    assert "| filtered | 0.80 [0.50 - 1.10] | 2,976 B identity | 0.016 | 20.0 |" in table
