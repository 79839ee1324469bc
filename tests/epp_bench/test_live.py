"""The live benchmark's own logic: /proc CPU accounting, the open-loop client against real
pods, report parsing, router command lines, and one full run through the real stack.

Tests that need the extra tools of `.bench/` (inference-perf, sglang-router) skip with the
reason when they are not installed: CI does not install them (minutes and ~1 GB).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from live_bench_fixtures import BENCH, FAST_SIM

from epp.tokenization.protocol import ChatMessage
from epp_bench.live import cpu as live_cpu
from epp_bench.live.bench_dir import BenchDir
from epp_bench.live.client import DEADLINE_ERROR, ClientLimits, run_open_loop
from epp_bench.live.frozen_code import children_import, choose_code
from epp_bench.live.inference_perf import (
    InferencePerfLoad,
    config_for,
    load_from_workload,
    outcomes_from_report,
    run_inference_perf,
    summary_fields,
)
from epp_bench.live.peers import PeerSpec, peer_argv
from epp_bench.live.routers import ROUTERS, unavailable_reason
from epp_bench.live.runner import LiveSettings, live_workload, run_once, sim_config
from epp_bench.live.sampler import parse_epp_stats, parse_pod_page, pod_ttft_mean_s
from epp_bench.reports.live import (
    TargetCheck,
    cpu_table,
    diagnosis_table,
    pool_repeats,
    repeats_table,
    target_checks,
    targets_table,
)
from epp_bench.workloads.catalog import multi_turn
from epp_bench.workloads.types import BenchRequest, RequestOutcome, RunResult, Workload
from epp_harness.stack import LocalStack

# -- CPU accounting -------------------------------------------------------------------------


def test_proc_stat_is_parsed_past_a_command_name_with_spaces_and_parentheses() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    fields = ["S", "1", "4242"] + ["0"] * 8 + [str(3 * ticks), str(ticks)] + ["0"] * 30
    stat = live_cpu.parse_proc_stat("4243 (my (odd) name) " + " ".join(fields))
    assert stat == live_cpu.ProcStat(pid=4243, pgrp=4242, cpu_s=4.0)


def test_machine_cpu_counts_idle_and_iowait_as_not_busy() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    line = f"cpu  {ticks} 0 {ticks} {2 * ticks} {ticks} 0 0 0 0 0\ncpu0 1 2 3 4\n"
    assert live_cpu.parse_machine_cpu(line) == live_cpu.MachineCpu(busy_s=2.0, total_s=5.0)
    with pytest.raises(ValueError):
        live_cpu.parse_machine_cpu("intr 1 2 3\n")


def test_own_process_group_cpu_grows_with_work_done() -> None:
    pgid = os.getpgrp()
    before = live_cpu.process_groups_cpu_s([pgid])[pgid]
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = live_cpu.process_groups_cpu_s([pgid])[pgid]
    # Clock ticks are 10 ms: 0.3 s of spinning shows as at least 0.2 s.
    assert after - before >= 0.2


def test_usage_between_gives_cores_and_what_other_programs_used() -> None:
    before = live_cpu.CpuSnapshot({"epp": 1.0, "pod-0": 2.0}, live_cpu.MachineCpu(10, 100), 5.0)
    after = live_cpu.CpuSnapshot({"epp": 1.5, "pod-0": 3.0}, live_cpu.MachineCpu(14, 104), 5.5)
    usage = live_cpu.usage_between(before, after, wall_s=2.0)
    assert usage.cores == {"epp": 0.25, "pod-0": 0.5}
    assert usage.client_cores == 0.25
    # 4 busy of 4 elapsed CPU seconds: every core of the machine was busy.
    assert usage.machine_busy_cores == pytest.approx(usage.machine_cores)
    assert usage.foreign_cores == pytest.approx(usage.machine_cores - 1.0)


# -- workloads, settings, command lines -----------------------------------------------------


def test_live_workload_drops_late_arrivals_and_orphaned_follow_ups() -> None:
    full = live_workload("multi-turn", rate=2.0, seed=0, duration_s=1e9)
    cut = live_workload("multi-turn", rate=2.0, seed=0, duration_s=10.0)
    assert 0 < len(cut.requests) < len(full.requests)
    kept = {r.index for r in cut.requests}
    for request in cut.requests:
        assert request.arrival_s < 10.0
        assert request.after is None or request.after in kept


def test_sim_config_reads_the_pod_arguments_and_refuses_bad_ones() -> None:
    config = sim_config(["--max-num-seqs", "3", "--time-scale", "0.5"])
    assert (config.engine.max_num_seqs, config.time_scale) == (3, 0.5)
    assert sim_config(LiveSettings().sim_args).engine.max_num_seqs == 4
    with pytest.raises(ValueError, match="invalid --sim-args"):
        sim_config(["--no-such-flag"])


def test_peer_command_lines_bind_loopback_and_block_the_hub(tmp_path: Path) -> None:
    bench = BenchDir(tmp_path)
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    sglang = peer_argv(PeerSpec("sglang", "cache_aware", "sglang-router"), bench, 10, 11, urls)
    assert sglang[:2] == ["env", "HF_ENDPOINT=http://127.0.0.1:9"]
    assert sglang[2].endswith("venvs/sglang-router/bin/python")
    assert sglang[3:5] == ["-m", "sglang_router.launch_router"]
    vllm = peer_argv(PeerSpec("vllm_router", "cache_aware", "vllm-router"), bench, 10, 11, urls)
    assert vllm[2].endswith("venvs/vllm-router/bin/vllm-router")
    for argv in (sglang, vllm):
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
        assert argv[argv.index("--policy") + 1] == "cache_aware"
        start = argv.index("--worker-urls") + 1
        assert argv[start : start + 2] == urls


def test_a_peer_without_its_venv_is_reported_unavailable(tmp_path: Path) -> None:
    bench = BenchDir(tmp_path)
    assert "sglang-router not installed" in (
        unavailable_reason(ROUTERS["sglang_cache_aware"], bench) or ""
    )
    assert unavailable_reason(ROUTERS["epp"], bench) is None


def test_children_import_the_frozen_commit_and_the_environment_is_restored(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    before = os.environ.get("PYTHONPATH")
    code = choose_code("head", repo, tmp_path)
    assert code.choice == "head" and len(code.commit) == 40
    with children_import(code):
        imported = subprocess.run(
            [sys.executable, "-c", "import vllm_sim.cli as m; print(m.__file__)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    assert imported == str(tmp_path / code.commit / "vllm_sim" / "cli.py")
    assert os.environ.get("PYTHONPATH") == before
    worktree = choose_code("worktree", repo, tmp_path)
    assert worktree.path == str(repo / "src") and len(worktree.commit) == 40
    with children_import(worktree):
        assert os.environ.get("PYTHONPATH") == before


def test_an_unknown_revision_is_refused_before_anything_runs(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(RuntimeError, match="no-such-revision"):
        choose_code("no-such-revision", repo, tmp_path)
    assert not any(tmp_path.iterdir())


# -- what the processes report -------------------------------------------------------------


POD_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.8
vllm:time_to_first_token_seconds_created{engine="0",model_name="m"} 1.7e9
"""


def test_pod_page_gives_gauges_counters_and_ttft_totals() -> None:
    page = parse_pod_page(POD_PAGE)
    assert (page.metrics.running, page.metrics.waiting) == (3.0, 1.0)
    assert (page.metrics.prefix_queries, page.metrics.prefix_hits) == (1000.0, 600.0)
    assert (page.ttft_sum_s, page.ttft_count) == (0.8, 4.0)
    later = parse_pod_page(POD_PAGE.replace("} 4.0", "} 6.0").replace("} 0.8", "} 1.4"))
    assert pod_ttft_mean_s({"p": page}, {"p": later}) == pytest.approx(0.3)


def test_epp_stats_come_from_its_metrics_page() -> None:
    page = (
        'epp_routing_decisions_total{model="m",result="ok"} 5.0\n'
        'epp_routing_decisions_total{model="m",result="rejected"} 1.0\n'
        "epp_scoring_latency_us_count 6.0\nepp_scoring_latency_us_sum 600.0\n"
        "epp_cache_match_ratio_count 5.0\nepp_cache_match_ratio_sum 4.0\n"
    )
    stats = parse_epp_stats(page)
    assert stats["decisions"] == 6.0
    assert stats["scoring_latency_us_mean"] == 100.0
    assert stats["cache_match_mean"] == 0.8
    assert "best_match_mean" not in stats


# -- inference-perf -------------------------------------------------------------------------

# Recorded from real runs of inference-perf 0.7.0 (how: "recorded_with" in the file).
_RECORDED = json.loads(
    (Path(__file__).parent / "live_fixtures/inference-perf-report.json").read_text()
)
INFERENCE_PERF_REPORT: list[dict] = _RECORDED["per_request"]
INFERENCE_PERF_SUMMARY: dict = _RECORDED["summary"]


def test_inference_perf_per_request_report_becomes_outcomes() -> None:
    outcomes = outcomes_from_report(INFERENCE_PERF_REPORT)
    assert [o.index for o in outcomes] == [0, 1, 2]
    first, second, failed = outcomes
    assert first.start_s == 0.0 and second.start_s > 0.0
    assert first.ok and first.status == 200 and first.pod is None
    assert first.ttft_s is not None and 0 < first.ttft_s < first.latency_s
    # Server usage wins over inference-perf's own re-tokenized count (59 for these 16).
    assert (first.prompt_tokens, first.cached_tokens, first.output_tokens) == (289, 0, 16)
    assert (second.prompt_tokens, second.cached_tokens) == (262, 224)
    assert not failed.ok and failed.status == 0 and failed.ttft_s is None
    assert failed.error is not None and failed.error.startswith("ClientConnectorError")


def test_inference_perf_summary_fields() -> None:
    fields = summary_fields(INFERENCE_PERF_SUMMARY)
    assert (fields["requests_ok"], fields["requests_failed"]) == (8, 0)
    assert fields["ttft_p99_s"] == pytest.approx(0.011108, abs=1e-6)
    assert fields["client_cached_ratio"] == pytest.approx(1536 / 2228)
    assert fields["schedule_delay_p99_s"] == pytest.approx(0.001644, abs=1e-6)


def test_inference_perf_load_mirrors_a_shared_prefix_workload() -> None:
    workload = live_workload("shared-prefix-small", rate=4.0, seed=0, duration_s=10.0)
    load = load_from_workload(workload, rate=4.0, duration_s=10.0, max_concurrency=64)
    assert (load.groups, load.prompts_per_group) == (30, 5)
    assert (load.system_tokens, load.question_tokens, load.output_tokens) == (1500, 300, 100)
    assert load.duration_s == 10
    with pytest.raises(ValueError, match="only shared-prefix"):
        load_from_workload(multi_turn(conversations=2), 1.0, 10.0, 8)


def _small_load(rate: float = 4.0, duration_s: int = 2) -> InferencePerfLoad:
    return InferencePerfLoad(
        groups=2,
        prompts_per_group=3,
        system_tokens=200,
        question_tokens=20,
        output_tokens=8,
        rate=rate,
        duration_s=duration_s,
        model="sim-llama-8b",
        teardown_grace_s=5.0,
    )


def test_inference_perf_config_has_the_load_and_reports_we_read(tmp_path: Path) -> None:
    config = config_for(_small_load(), "http://127.0.0.1:1", tmp_path / "tok", tmp_path / "out")
    assert config["data"]["type"] == "shared_prefix"
    assert config["load"]["stages"] == [{"rate": 4.0, "duration": 2}]
    assert config["report"]["request_lifecycle"]["per_request"] is True
    assert config["server"]["ignore_eos"] is True


# -- reports --------------------------------------------------------------------------------


def _result(router: str, hit: float, ttfts: list[float], rate: float = 4.0) -> RunResult:
    outcomes = [
        RequestOutcome(index=i, pod="pod-0", status=200, start_s=i, ttft_s=t, latency_s=t + 1)
        for i, t in enumerate(ttfts)
    ]
    extra = {
        "cpu_cores": {"pods": 0.5, "epp": 0.1, "envoy": 0.05, "client": 0.1, "machine_busy": 1.0},
        "occupancy": {"slots_busy_mean": 0.5, "waiting_mean": 0.2, "waiting_max": 2.0},
        "router_cpu_us_per_request": 1500.0,
    }
    return RunResult(router, "w", rate, 1, 10.0, outcomes, hit, None, "live", extra)


def test_targets_compare_hit_rate_and_ttft_p99_with_sglang() -> None:
    results = [
        _result("epp", 0.9, [0.1] * 99 + [0.5]),
        _result("sglang_cache_aware", 0.9, [0.1] * 99 + [0.4]),
        _result("envoy_round_robin", 0.3, [1.0] * 100),
    ]
    (check,) = target_checks(results)
    assert check.hit_ok  # equal counts as "at least"
    assert not check.ttft_ok
    table = targets_table([check])
    assert "| met |" in table and "| MISSED |" in table
    assert TargetCheck(4.0, "w", 0.8, 0.9, 0.1, 0.2).ttft_ok
    assert not TargetCheck(4.0, "w", 0.8, 0.9, 0.1, 0.2).hit_ok


def test_repeats_pool_into_one_result_with_shifted_times() -> None:
    first = _result("epp", 0.8, [0.1, 0.2])
    second = _result("epp", 0.6, [0.3, 0.4])
    other = _result("sglang_cache_aware", 0.9, [0.1])
    pooled = pool_repeats([first, second, other])
    assert [r.router for r in pooled] == ["epp", "sglang_cache_aware"]
    epp = pooled[0]
    assert [o.ttft_s for o in epp.outcomes] == [0.1, 0.2, 0.3, 0.4]
    # The second repeat starts after the first one's span (10 s each).
    assert [o.start_s for o in epp.outcomes] == [0.0, 1.0, 10.0, 11.0]
    assert epp.duration_s == 20.0 and epp.pod_hit_rate == pytest.approx(0.7)
    assert [r["pod_hit_rate"] for r in epp.extra["repeats"]] == [0.8, 0.6]
    assert pooled[1] is other
    assert "80.0%, 60.0%" in repeats_table(pooled)


def test_diagnosis_separates_hits_from_misses() -> None:
    result = _result("epp", 0.5, [0.05, 0.4])
    result.outcomes[0].prompt_tokens, result.outcomes[0].cached_tokens = 100, 90
    result.outcomes[1].prompt_tokens, result.outcomes[1].cached_tokens = 100, 0
    result.extra.update(
        front_ttft_mean_s=0.0042,
        pod_ttft_mean_s=0.2,
        placement={"groups_per_pod": {"pod-0": 2}, "groups_on_several_pods": 0},
    )
    row = diagnosis_table([result]).splitlines()[2]
    assert "4.2 ms" in row and "200 ms" in row and "50 ms / 400 ms" in row


def test_cpu_table_has_one_row_per_run() -> None:
    table = cpu_table([_result("epp", 0.9, [0.1]), _result("sglang_cache_aware", 0.9, [0.1])])
    assert table.count("\n") == 4
    assert "1,500 µs" in table and "50%" in table


# -- real processes -------------------------------------------------------------------------


def _conversation_workload() -> Workload:
    """Two conversations of three turns over one system prompt, think time 50 ms."""
    system = ChatMessage("system", "You are terse. " * 200)
    requests: list[BenchRequest] = []
    for conversation in range(2):
        history = [system]
        previous = None
        for turn in range(3):
            history.append(ChatMessage("user", f"conversation {conversation} turn {turn} " * 8))
            requests.append(
                BenchRequest(
                    index=len(requests),
                    arrival_s=0.05 * conversation,
                    kind="chat",
                    model="sim-llama-8b",
                    max_tokens=4,
                    messages=tuple(history),
                    session=f"c{conversation}",
                    after=previous,
                    think_s=0.05 if previous is not None else 0.0,
                )
            )
            history.append(ChatMessage("assistant", "fine " * 4))
            previous = len(requests) - 1
    return Workload("tiny-chat", tuple(requests))


@pytest.mark.e2e
def test_open_loop_client_honours_turn_order_through_real_pods() -> None:
    workload = _conversation_workload()
    with LocalStack(pods=2, mode="round_robin", sim_args=FAST_SIM) as stack:
        run = asyncio.run(run_open_loop(stack.envoy_url, workload, ClientLimits(deadline_s=30)))
    assert run.not_sent == 0 and run.cap_waits == 0
    assert [o.index for o in run.outcomes] == list(range(6))
    by_index = {o.index: o for o in run.outcomes}
    for request in workload.requests:
        outcome = by_index[request.index]
        assert outcome.ok, outcome.error
        assert outcome.pod in ("pod-0", "pod-1")
        assert outcome.ttft_s is not None and 0 < outcome.ttft_s <= outcome.latency_s
        assert outcome.output_tokens == 4 and outcome.prompt_tokens > 0
        if request.after is not None:
            previous = by_index[request.after]
            assert outcome.start_s >= previous.start_s + previous.latency_s + request.think_s
    # Round robin over two pods: turn k+2 lands where turn k did and reuses its history.
    assert any(o.cached_tokens > 0 for o in run.outcomes)


@pytest.mark.e2e
def test_open_loop_client_stops_at_its_deadline() -> None:
    slow = ("--decode-per-token-ms", "200")
    early = BenchRequest(0, 0.0, "completion", "sim-llama-8b", max_tokens=50, prompt="x " * 50)
    late = BenchRequest(1, 5.0, "completion", "sim-llama-8b", max_tokens=1, prompt="y " * 50)
    workload = Workload("deadline", (early, late))
    with LocalStack(pods=1, mode="round_robin", sim_args=slow) as stack:
        started = time.monotonic()
        run = asyncio.run(run_open_loop(stack.envoy_url, workload, ClientLimits(deadline_s=1.0)))
        elapsed = time.monotonic() - started
    assert elapsed < 4.0
    assert run.not_sent == 1
    (outcome,) = run.outcomes
    assert outcome.error == DEADLINE_ERROR and not outcome.ok


def _processes_in(directory: Path) -> list[int]:
    """Pids of live processes whose working directory is `directory` (the stack's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd") == str(directory):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.e2e
def test_one_live_run_through_envoy_and_the_epp(tmp_path: Path) -> None:
    settings = LiveSettings(pods=2, sim_args=FAST_SIM, idle_probe_s=0.3, drain_s=20.0)
    workload = multi_turn(
        conversations=4, turns=2, system_prompts=2, system_tokens=200, user_tokens=16,
        reply_tokens=8, think_s=0.05, rate=8.0,
    )  # fmt: skip
    seen: list[RequestOutcome] = []
    result = run_once(
        ROUTERS["epp"], BENCH, workload, 8.0, settings, work_dir=tmp_path, progress=seen.append
    )
    assert result.mode == "live" and result.router == "epp" and result.pods == 2
    assert len(result.outcomes) == len(seen) == 8
    assert all(o.ok for o in result.outcomes), [o.error for o in result.outcomes]
    assert result.pod_hit_rate is not None and result.pod_hit_rate > 0.3
    assert result.epp_cpu_us_per_decision is not None and result.epp_cpu_us_per_decision > 0
    extra = result.extra
    assert extra["epp"]["decisions"] == 8
    assert extra["cpu_cores"]["epp"] > 0 and extra["cpu_cores"]["pods"] > 0
    # The client's TTFT is the pods' own plus the path in front of them (Envoy, EPP, client).
    client_ttft = [o.ttft_s for o in result.outcomes if o.ttft_s is not None]
    assert len(client_ttft) == 8 and extra["pod_ttft_mean_s"] > 0
    assert 0 < extra["front_ttft_mean_s"] < sum(client_ttft) / len(client_ttft)
    assert extra["pod_names"] == ["pod-0", "pod-1"]
    # Every process of the run ran in `tmp_path` (logs there) and none is left.
    assert {p.name for p in tmp_path.glob("*.log")} >= {"epp.log", "envoy.log", "pod-0.log"}
    assert _processes_in(tmp_path) == []


needs_sglang = pytest.mark.skipif(
    not BENCH.installed("sglang-router"),
    reason=f"sglang-router not installed in {BENCH.venv('sglang-router')} "
    "(.venv/bin/python tools/bench/install_peers.py)",
)
needs_inference_perf = pytest.mark.skipif(
    not (BENCH.installed("inference-perf") and BENCH.tokenizer_ready()),
    reason=f"inference-perf or its tokenizer not installed under {BENCH.root} "
    "(.venv/bin/python tools/bench/install_peers.py)",
)


@pytest.mark.e2e
@needs_sglang
def test_sglang_router_runs_in_front_of_fresh_pods(tmp_path: Path) -> None:
    settings = LiveSettings(pods=2, sim_args=FAST_SIM, idle_probe_s=0.2, drain_s=20.0)
    workload = live_workload("shared-prefix-small", rate=20.0, seed=0, duration_s=1.0)
    result = run_once(ROUTERS["sglang_cache_aware"], BENCH, workload, 20.0, settings,
                      work_dir=tmp_path)  # fmt: skip
    assert result.outcomes and all(o.ok for o in result.outcomes)
    assert {o.pod for o in result.outcomes} <= {"pod-0", "pod-1"}
    assert result.extra["router_component"] == "router"
    # The peer's process is the router whose CPU is measured (no Envoy, no EPP).
    assert "router" in result.extra["cpu_cores"]
    assert not {"epp", "envoy"} & set(result.extra["cpu_cores"])
    assert result.extra["cpu_cores"]["pods"] > 0
    assert _processes_in(tmp_path) == []


@pytest.mark.e2e
@needs_inference_perf
def test_inference_perf_drives_a_real_pod(tmp_path: Path) -> None:
    with LocalStack(pods=1, mode="round_robin", sim_args=FAST_SIM) as stack:
        run = run_inference_perf(BENCH, _small_load(), stack.envoy_url, tmp_path)
    assert len(run.outcomes) >= 3
    assert all(o.ok for o in run.outcomes)
    assert any(o.cached_tokens > 0 for o in run.outcomes)
    assert run.benchmark_s > 0 and summary_fields(run.summary)["requests_ok"] == len(run.outcomes)
