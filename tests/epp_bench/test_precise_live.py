"""Precise against approximate mode, live: the router variants' EPP configuration, the
workload tokenizer the pods and the EPP share, engine-side stale routing from the EPP's
logged decisions, the page's tables, and one run of each variant through the real stack
(pods publishing KV events over ZMQ, `epp serve`, Envoy)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
import yaml
from live_bench_fixtures import BENCH, FAST_SIM

from epp.request import parse_request
from epp.tokenization import load_tokenizer_dir
from epp_bench.live.cli import _reproduce_command, build_parser, router_order
from epp_bench.live.decisions import (
    LoggedDecision,
    engine_stale,
    parse_decisions,
    predicted_tokens,
)
from epp_bench.live.precise_report import (
    BEGIN,
    END,
    paired_ratios,
    ratios_table,
    render,
    runs_table,
    splice,
    write_page,
)
from epp_bench.live.routers import ROUTERS, epp_config_for, sim_tokenizer
from epp_bench.live.runner import LiveSettings, expected_index_mode, run_once
from epp_bench.live.sampler import parse_epp_stats
from epp_bench.live.workload_tokenizer import ensure_tokenizer
from epp_bench.reports.tables import save_results
from epp_bench.workloads.catalog import QUICK as SMALL
from epp_bench.workloads.catalog import SharedPrefixShape, multi_turn, shared_prefix
from epp_bench.workloads.types import RequestOutcome, RunResult
from vllm_sim.engine import EngineConfig
from vllm_sim.server import SimPodConfig, start_pod

# -- router variants --------------------------------------------------------------------


def test_precise_and_approx_variants_set_the_index_mode_and_log_decisions() -> None:
    precise, approx = ROUTERS["epp_precise"], ROUTERS["epp_approx"]
    assert expected_index_mode(precise) == "precise" and precise.needs_kv_events
    assert expected_index_mode(approx) == "approximate" and not approx.needs_kv_events
    assert precise.epp_log_level == approx.epp_log_level == "info"
    assert expected_index_mode(ROUTERS["epp"]) is None
    # Investigations: not in the default set of `epp bench live`.
    assert not precise.in_default_set and not approx.in_default_set


def test_epp_config_merges_the_users_file_the_variant_and_the_pods_tokenizer(
    tmp_path: Path,
) -> None:
    user = tmp_path / "user.yaml"
    user.write_text(yaml.safe_dump({"kv_events": {"predicted_ttl_s": 30}, "prefix": {"x": 1}}))
    sim_args = ["--max-num-seqs", "4", "--tokenizer", "tok"]
    text, rest = epp_config_for(
        ROUTERS["epp_precise"], ["--config", str(user), "--other", "1"], sim_args
    )
    assert rest == ["--other", "1"]  # the user's file is merged, not passed twice
    assert text is not None
    config = yaml.safe_load(text)
    assert config["kv_events"] == {"predicted_ttl_s": 30, "mode": "precise"}
    assert config["prefix"] == {"x": 1}
    assert config["tokenizers"] == {"sim-llama-8b": {"path": str(Path("tok").resolve())}}
    # Plain `epp` on the simulator's own tokenizer: nothing changes.
    assert epp_config_for(ROUTERS["epp"], ["--config", "f"], ["--max-num-seqs", "4"]) == (
        None,
        ["--config", "f"],
    )
    assert sim_tokenizer(["--tokenizer=/t"]) == "/t" and sim_tokenizer(["--tokenizer"]) is None


def test_routers_alternate_their_order_between_repeats() -> None:
    routers = [ROUTERS[n] for n in ("epp_precise", "epp_approx", "envoy_round_robin")]
    names = [[s.name for s in router_order(routers, repeat)] for repeat in range(3)]
    assert names[0] == names[2] == ["epp_precise", "epp_approx", "envoy_round_robin"]
    assert names[1] == ["envoy_round_robin", "epp_approx", "epp_precise"]


def test_reproduce_command_names_the_tokenizer_once_and_the_sim_args_as_given() -> None:
    argv = [
        "--routers", "epp_precise,epp_approx", "--tokenizer", "tok", "--name", "churn",
        "--sim-args", "--num-gpu-blocks 480",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    settings = LiveSettings(sim_args=("--num-gpu-blocks", "480", "--tokenizer", "/abs/tok"))
    command = _reproduce_command(args, settings, "c0ffee")
    assert command.count("--tokenizer") == 1 and "/abs/tok" not in command
    assert "'--num-gpu-blocks 480'" in command and "--name churn" in command


def test_the_epp_page_gives_its_stale_counters() -> None:
    page = (
        "epp_stale_cache_routing_total 3.0\nepp_stale_cache_checked_total 12.0\n"
        'epp_kv_events_total{reason="blocks_stored"} 40.0\n'
        'epp_kv_events_total{reason="blocks_removed"} 2.0\n'
    )
    stats = parse_epp_stats(page)
    assert (stats["stale"], stats["stale_checked"], stats["kv_events"]) == (3.0, 12.0, 42.0)


# -- the shared tokenizer ----------------------------------------------------------------


async def test_workload_tokenizer_is_about_4_bytes_a_token_and_the_pods_agree(
    tmp_path: Path,
) -> None:
    workloads = [
        shared_prefix(SMALL, rate=8.0, seed=0, name="shared-prefix-small"),
        multi_turn(rate=2.0, seed=0),
    ]
    directory = ensure_tokenizer(tmp_path / "tok", workloads)
    trained_at = (directory / "tokenizer.json").stat().st_mtime_ns
    assert ensure_tokenizer(directory, workloads) == directory  # reused, not trained again
    assert (directory / "tokenizer.json").stat().st_mtime_ns == trained_at
    epp = load_tokenizer_dir(directory)
    prompt = workloads[0].requests[7].prompt
    assert prompt is not None
    assert 3.5 < len(prompt) / len(epp.encode(prompt)) < 5.0  # sized as the workload says
    # A real pod with the same files answers with the ids the EPP computes (chat and
    # completion), which is what precise mode's keys rest on.
    engine = EngineConfig(prefill_overhead_s=0.0, prefill_per_token_s=0.0, decode_per_token_s=0.0)
    pod = await start_pod(SimPodConfig(engine=engine, tokenizer_dir=str(directory)), "127.0.0.1", 0)
    chat = workloads[1].requests[-1].body(stream=False) | {"return_token_ids": True}
    completion = workloads[0].requests[3].body(stream=False) | {"return_token_ids": True}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{pod.url}/v1/chat/completions", json=chat) as response:
                chat_answer = await response.json()
            async with http.post(f"{pod.url}/v1/completions", json=completion) as response:
                completion_answer = await response.json()
    finally:
        await pod.close()
    parsed = parse_request("/v1/chat/completions", json.dumps(chat).encode(), {})
    assert parsed.prompt.messages is not None
    ours = epp.encode_chat(parsed.prompt.messages, parsed.prompt.chat)
    assert chat_answer["prompt_token_ids"] == list(ours)
    assert completion_answer["choices"][0]["prompt_token_ids"] == list(
        epp.encode(completion["prompt"])
    )


# -- engine-side stale routing ------------------------------------------------------------


def _line(request_id: str, pod: str, tokens: int, match: float | None) -> str:
    return json.dumps(
        {"request_id": request_id, "pod": pod, "input_tokens": tokens, "cache_match": match,
         "event": "request_routed", "level": "info"}
    )  # fmt: skip


def _outcome(index: int, pod: str, prompt: int, cached: int, status: int = 200) -> RequestOutcome:
    return RequestOutcome(
        index=index, pod=pod, status=status, start_s=0.0, ttft_s=0.1, latency_s=0.2,
        prompt_tokens=prompt, cached_tokens=cached,
    )  # fmt: skip


def test_decisions_are_read_from_the_epps_routed_lines_only() -> None:
    lines = [
        _line("a", "pod-0", 160, 0.5),
        '{"event": "request_answered", "request_id": "b"}',
        "not json request_routed",
        _line("c", "pod-1", 40, None),
    ]
    decisions = parse_decisions(lines)
    assert decisions == {
        "a": LoggedDecision("pod-0", 160, 0.5),
        "c": LoggedDecision("pod-1", 40, None),
    }


def test_prediction_is_whole_blocks_capped_as_the_engine_caps_a_hit() -> None:
    # 0.3333 (rounded in the log) of 9 blocks is 3 blocks.
    assert predicted_tokens(LoggedDecision("p", 150, 0.3333), 150, 16) == 48
    # A fully matched prompt of exactly 10 blocks: the engine recomputes the last one.
    assert predicted_tokens(LoggedDecision("p", 160, 1.0), 160, 16) == 144
    # The EPP counted differently from the engine: scaled to the engine's prompt.
    assert predicted_tokens(LoggedDecision("p", 160, 0.5), 320, 16) == 160
    assert predicted_tokens(LoggedDecision("p", 160, None), 160, 16) == 0


def test_engine_stale_counts_predictions_the_serving_pod_did_not_reuse() -> None:
    decisions = parse_decisions(
        [
            _line("hit", "pod-0", 320, 0.5),  # 10 blocks predicted, 160 reused: fine
            _line("half", "pod-0", 320, 0.5),  # 79 of 160 reused: stale
            _line("moved", "pod-0", 320, 0.5),  # served by pod-1: not checked
            _line("none", "pod-1", 320, 0.0),  # nothing predicted: not checked
            _line("failed", "pod-1", 320, 0.5),  # failed request: not joined
        ]
    )
    outcomes = [
        _outcome(0, "pod-0", 320, 160),
        _outcome(1, "pod-0", 320, 79),
        _outcome(2, "pod-1", 320, 0),
        _outcome(3, "pod-1", 320, 0),
        _outcome(4, "pod-1", 320, 0, status=503),
        _outcome(5, "pod-1", 320, 0),  # no id: Envoy answered without the EPP
    ]
    ids = {0: "hit", 1: "half", 2: "moved", 3: "none", 4: "failed"}
    stale = engine_stale(outcomes, ids, decisions, 16)
    assert (stale["joined"], stale["served_elsewhere"]) == (4, 1)
    assert (stale["checked"], stale["stale"], stale["rate"]) == (2, 1, 0.5)
    assert stale["predicted_tokens"] == 320
    assert stale["predicted_reused"] == pytest.approx((160 + 79) / 320)


# -- the page -------------------------------------------------------------------------------


def _run(router: str, repeat: int, hit: float, ttfts: list[float], stale: float) -> RunResult:
    outcomes = [
        RequestOutcome(i, f"pod-{i % 2}", 200, float(i), t, t + 1.0, 100, 50, 10)
        for i, t in enumerate(ttfts)
    ]
    epp = {
        "stale_from_epp": {"stale": stale * 10, "checked": 10.0, "rate": stale},
        "stale_engine_side": {"checked": 20, "stale": 2, "rate": 0.1, "predicted_reused": 0.9},
    }
    if not router.startswith("epp"):
        epp = {}
    return RunResult(
        router=router, workload="shared-prefix-small", rate=8.0, pods=2, duration_s=10.0,
        outcomes=outcomes, pod_hit_rate=hit, epp_cpu_us_per_decision=None, mode="live",
        extra={"repeat": repeat, "epp": epp, "sim_args": ["--num-gpu-blocks", "480"],
               "busy_cores_before": 0.25, "workload_description": "small",
               "occupancy": {"waiting_mean": 2.5}, "cpu_cores": {"foreign": 1.5}},
    )  # fmt: skip


def _campaign() -> list[RunResult]:
    return [
        _run("epp_precise", 0, 0.6, [0.1, 0.2, 0.4], 0.0),
        _run("epp_approx", 0, 0.5, [0.2, 0.4, 0.8], 0.2),
        _run("envoy_round_robin", 0, 0.25, [1.0, 1.0, 1.0], 0.0),
        _run("envoy_round_robin", 1, 0.25, [1.0, 1.0, 1.0], 0.0),
        _run("epp_approx", 1, 0.6, [0.1, 0.2, 0.4], 0.1),
        _run("epp_precise", 1, 0.3, [0.2, 0.4, 0.8], 0.0),
    ]


def test_ratios_pair_the_variants_repeat_by_repeat() -> None:
    pairs = paired_ratios(_campaign())
    assert [p["repeat"] for p in pairs] == [0.0, 1.0]
    assert pairs[0]["hit_rate"] == pytest.approx(1.2) and pairs[1]["hit_rate"] == 0.5
    assert pairs[0]["ttft_p50_s"] == 0.5 and pairs[1]["ttft_p50_s"] == 2.0
    table = ratios_table(_campaign(), "epp_precise", "epp_approx")
    assert "| mean | epp_precise / epp_approx | 0.85x | 1.25x |" in table
    assert "no repeat" in ratios_table(_campaign()[:1], "epp_precise", "epp_approx")


def test_runs_table_has_one_row_per_run_with_both_stale_rates() -> None:
    table = runs_table(_campaign())
    rows = table.splitlines()[2:]
    assert len(rows) == 6
    assert rows[0].startswith("| 0 | epp_precise | 3 / 0 | 60.0% | 200 ms |")
    # approx: both stale rates, the pods' queue and how busy the machine was
    assert "| 20.0% (2/10) | 10.0% (2/20) | 90.0% | 2.5 | 0.25 / 1.50 |" in rows[1]
    assert "| - | - | - |" in rows[2]  # round robin: nothing predicted, nothing checked


def test_page_is_regenerated_between_its_markers_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    save_results(_campaign(), data / "churn-runs.json", outcomes=False)
    (data / "churn-meta.json").write_text(
        json.dumps({"command": "epp bench live --name churn", "code": {"commit": "ab" * 20},
                    "wall_s": 100.0})
    )  # fmt: skip
    save_results(_campaign()[:3], data / "multi-turn-runs.json", outcomes=False)
    generated = render(data)
    # The campaign's own scenarios first, titled; others after, under their names.
    assert generated.startswith("### Multi-turn chat, KV for every prefix (`multi-turn`)")
    assert "\n### churn\n" in generated and "epp bench live --name churn" in generated
    assert "abababababab" in generated and "epp_approx / envoy_round_robin" in generated
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nwhat we saw\n\n{BEGIN}\nold\n{END}\n\nmore text\n")
    write_page(data, page)
    text = page.read_text()
    assert text.startswith("# Title\n\nwhat we saw\n\n") and text.endswith("\n\nmore text\n")
    assert "old" not in text and generated in text
    assert splice("", "x") == f"{BEGIN}\n\nx\n\n{END}\n"
    with pytest.raises(ValueError):
        render(tmp_path / "empty")


# -- one run of each variant through the real stack ---------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("variant", ["epp_precise", "epp_approx"])
def test_one_live_run_of_each_index_mode(tmp_path: Path, variant: str) -> None:
    workload = shared_prefix(SharedPrefixShape(4, 3, 200, 40, 8), rate=10.0, seed=1)
    tokenizer = ensure_tokenizer(tmp_path / "tok", [workload])
    settings = LiveSettings(
        pods=2,
        sim_args=(*FAST_SIM, "--tokenizer", str(tokenizer)),
        idle_probe_s=0.3,
        drain_s=20.0,
        kv_events=True,
    )
    result = run_once(ROUTERS[variant], BENCH, workload, 10.0, settings, work_dir=tmp_path / "run")
    assert all(o.ok for o in result.outcomes), [o.error for o in result.outcomes]
    mode = "precise" if variant == "epp_precise" else "approximate"
    assert result.extra["index_modes"] == {"pod-0": mode, "pod-1": mode}
    epp = result.extra["epp"]
    # The pods published in both runs; only the precise EPP listened.
    assert (epp["kv_events"] > 0) == (variant == "epp_precise")
    engine = epp["stale_engine_side"]
    # Every request's decision was found in the EPP's log by the id Envoy echoed, and the
    # groups' later prompts were predicted on the pod that had their prefix.
    assert engine["joined"] == len(result.outcomes) == 12
    assert engine["checked"] >= 4 and engine["rate"] is not None
    assert set(epp["stale_from_epp"]) == {"stale", "checked", "rate"}
    assert result.pod_hit_rate is not None and result.pod_hit_rate > 0.2
