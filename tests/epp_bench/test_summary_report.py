"""Summaries on known data, markdown tables, the JSON round trip, PNG plots, the CLIs."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from epp_bench.reports import cli as report_cli
from epp_bench.reports.summary import load_spread
from epp_bench.reports.tables import (
    is_saturated,
    ladder_table,
    load_results,
    markdown_table,
    plot_ttft_cdf,
    plot_vs_rate,
    saturation,
    save_results,
    summarize,
)
from epp_bench.virtual import cli as virtual_cli
from epp_bench.workloads.types import RequestOutcome, RunResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def quiet_routing_logs() -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.configure(**saved)


def _outcome(
    index: int, ttft: float, latency: float, pod: str = "pod-0", **kw: object
) -> RequestOutcome:
    fields: dict[str, object] = {
        "index": index,
        "pod": pod,
        "status": 200,
        "start_s": float(index),
        "ttft_s": ttft,
        "latency_s": latency,
        "prompt_tokens": 100,
        "cached_tokens": 50,
        "output_tokens": 10,
    } | kw
    return RequestOutcome(**fields)  # type: ignore[arg-type]


def _result(
    router: str = "epp", rate: float | None = 2.0, pods: int = 2, **kw: object
) -> RunResult:
    # TTFTs 0.1 .. 1.0 s, latencies 1 .. 10 s, alternating over two pods, plus one 429.
    outcomes = [
        _outcome(i, ttft=(i + 1) / 10, latency=float(i + 1), pod=f"pod-{i % 2}") for i in range(10)
    ]
    outcomes.append(RequestOutcome(10, None, 429, 10.0, None, 0.0, error="rejected-saturated"))
    fields: dict[str, object] = {
        "router": router,
        "workload": "shared-prefix",
        "rate": rate,
        "pods": pods,
        "duration_s": 20.0,
        "outcomes": outcomes,
        "pod_hit_rate": 0.5,
        "epp_cpu_us_per_decision": 123.0 if router == "epp" else None,
        "extra": {"pod_names": [f"pod-{i}" for i in range(pods)]},
    } | kw
    return RunResult(**fields)  # type: ignore[arg-type]


def test_summary_on_known_data() -> None:
    s = summarize(_result())
    assert s["requests"] == 11 and s["ok"] == 10 and s["failed"] == 1
    assert s["failed_by_status"] == {"429": 1}
    # Linear interpolation: p50 of 0.1..1.0 is 0.55, p90 is 0.91, p99 is 0.991.
    assert s["ttft_p50_s"] == pytest.approx(0.55)
    assert s["ttft_p90_s"] == pytest.approx(0.91)
    assert s["ttft_p99_s"] == pytest.approx(0.991)
    assert s["latency_p50_s"] == pytest.approx(5.5)
    assert s["latency_p90_s"] == pytest.approx(9.1)
    assert s["output_tokens"] == 100
    assert s["output_tokens_per_s"] == pytest.approx(100 / 20.0)
    assert s["client_cached_ratio"] == pytest.approx(0.5)
    assert s["pod_hit_rate"] == 0.5
    assert s["requests_per_pod"] == {"pod-0": 5, "pod-1": 5}
    assert s["load_max_over_mean"] == pytest.approx(1.0)
    assert s["load_cv"] == pytest.approx(0.0)
    assert s["epp_cpu_us_per_decision"] == 123.0
    # Sends 0..10 s apart: 1 req/s offered; ok ends at 1, 3, 5, ..., 19 s: 0.5 req/s.
    assert s["offered_rps"] == pytest.approx(1.0)
    assert s["completion_rps"] == pytest.approx(9 / 18)


def test_load_spread_counts_idle_pods() -> None:
    assert load_spread([10, 10, 10, 10]) == (pytest.approx(1.0), pytest.approx(0.0))
    max_over_mean, cv = load_spread([40, 0, 0, 0])
    assert max_over_mean == pytest.approx(4.0)
    assert cv == pytest.approx(3**0.5)
    assert load_spread([]) == (None, None)
    s = summarize(_result(pods=4, extra={"pod_names": ["pod-0", "pod-1", "pod-2", "pod-3"]}))
    assert s["requests_per_pod"] == {"pod-0": 5, "pod-1": 5, "pod-2": 0, "pod-3": 0}
    assert s["load_max_over_mean"] == pytest.approx(2.0)


def test_markdown_table_has_a_row_per_router_with_numbers() -> None:
    table = markdown_table([_result("epp"), _result("round_robin")])
    lines = table.strip().splitlines()
    assert lines[0].startswith("| router |") and "TTFT p90" in lines[0]
    assert len(lines) == 4
    assert lines[2].startswith("| epp | 10 / 1 | 550 ms | 910 ms |")
    assert "123 µs" in lines[2] and "50.0%" in lines[2]
    assert lines[3].startswith("| round_robin |") and lines[3].rstrip().endswith("| - |")
    # A rate column appears only when the rates differ.
    assert "rate (req/s)" not in lines[0]
    assert "rate (req/s)" in markdown_table([_result(rate=1.0), _result(rate=2.0)])


def test_ladder_table_and_saturation() -> None:
    ok_outcomes = [_outcome(i, 0.1, 1.0) for i in range(10)]
    calm = _result("round_robin", rate=1.0, outcomes=ok_outcomes)
    busy = _result("round_robin", rate=4.0)  # has a 429: saturated
    epp = _result("epp", rate=4.0, outcomes=ok_outcomes)
    table = ladder_table([busy, epp, calm])
    rows = [line for line in table.splitlines()[2:] if line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "4", "4"]
    assert rows[2].split("|")[2].strip() == "round_robin" and rows[2].rstrip().endswith("| yes |")
    assert not is_saturated(summarize(calm))
    assert saturation([busy, epp, calm]) == {"round_robin": 4.0, "epp": None}


def test_json_round_trip(tmp_path: Path) -> None:
    results = [_result("epp"), _result("round_robin", rate=None)]
    path = save_results(results, tmp_path / "deep" / "results.json")
    document = json.loads(path.read_text())
    assert document["format"] == "epp-bench-results/1"
    loaded = load_results(path)
    assert [r.router for r in loaded] == ["epp", "round_robin"]
    for original, back in zip(results, loaded, strict=True):
        assert back.outcomes == original.outcomes
        assert (back.rate, back.pods, back.duration_s) == (original.rate, original.pods, 20.0)
        assert summarize(back) == summarize(original)


def test_json_without_outcomes_keeps_summary_and_cdf(tmp_path: Path) -> None:
    original = _result()
    path = save_results([original], tmp_path / "small.json", outcomes=False)
    (back,) = load_results(path)
    assert back.outcomes == []
    assert summarize(back) == json.loads(json.dumps(summarize(original)))
    assert len(back.extra["ttft_quantiles"]) == 101
    assert plot_ttft_cdf([back], tmp_path / "cdf.png").read_bytes().startswith(PNG_MAGIC)


def test_load_refuses_other_files(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"results": []}')
    with pytest.raises(ValueError):
        load_results(path)


def test_plots_are_png_files(tmp_path: Path) -> None:
    results = [_result(r, rate=rate) for r in ("epp", "round_robin") for rate in (1.0, 2.0, 4.0)]
    cdf = plot_ttft_cdf(results[:2], tmp_path / "plots" / "cdf.png")
    vs_rate = plot_vs_rate(results, tmp_path / "plots" / "vs-rate.png")
    for path in (cdf, vs_rate):
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC)
        assert 5_000 < len(data) < 300_000


def test_virtual_cli_writes_tables_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = virtual_cli.main(
        [
            "--workload", "shared-prefix-small", "--pods", "4",
            "--routers", "epp,round_robin", "--rates", "40,80",
            "--kv-fraction", "2", "--out", str(tmp_path), "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| epp |" in printed and "| round_robin |" in printed
    assert "## rate ladder" in printed
    assert "reproduce: epp bench virtual --workload shared-prefix-small --pods 4" in printed
    results = load_results(tmp_path / "shared-prefix-small.json")
    assert len(results) == 4
    assert {r.extra["kv_fraction"] for r in results} == {2.0}
    assert (tmp_path / "shared-prefix-small-vs-rate.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "shared-prefix-small-ttft-cdf.png").read_bytes().startswith(PNG_MAGIC)

    out = tmp_path / "report.md"
    out.write_text(
        f"# Mine\n\nanalysis before\n\n{report_cli.BEGIN}\nold\n{report_cli.END}\n\nafter\n"
    )
    assert (
        report_cli.main(["--from", str(tmp_path / "shared-prefix-small.json"), "--out", str(out)])
        == 0
    )
    text = out.read_text()
    assert text.startswith("# Mine\n\nanalysis before") and text.rstrip().endswith("after")
    assert "old" not in text and "### Rate ladder" in text and "| epp |" in text
    assert "](report/shared-prefix-small-virtual-4-pods-vs-rate.png)" in text
    assert (tmp_path / "report" / "shared-prefix-small-virtual-4-pods-ttft-cdf.png").exists()


def test_virtual_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        virtual_cli.main(["--routers", "nope"])
    assert virtual_cli.main(["--engine", "nope=1", "--no-progress"]) == 2
    assert "expected FIELD=VALUE" in capsys.readouterr().err
