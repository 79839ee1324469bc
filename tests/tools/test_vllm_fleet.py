"""The pure helpers of tools/vllm_fleet (no vLLM, no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "vllm_fleet"))

import summary

VLLM_PAGE = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 1344.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 1888.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-llama"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-llama"} 4.0
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 5.0
"""


def test_parse_metrics_sums_label_sets_and_filters() -> None:
    parsed = summary.parse_metrics(VLLM_PAGE)
    assert summary.metric_sum(parsed, "vllm:request_success_total") == 5.0
    assert summary.metric_sum(parsed, "vllm:request_success_total", finished_reason="stop") == 1.0
    assert summary.metric_sum(parsed, "vllm:request_success_total", finished_reason="x") is None
    assert summary.metric_sum(parsed, "vllm:absent") is None
    labels, value = parsed["vllm:e2e_request_latency_seconds_bucket"][0]
    assert labels["le"] == "+Inf" and value == 5.0


def test_engine_snapshot_and_deltas() -> None:
    before = summary.engine_snapshot(VLLM_PAGE)
    assert before["vllm:prefix_cache_hits_total"] == 1344.0
    assert before["vllm:num_requests_running"] == 2.0
    after = dict(before, **{"vllm:prefix_cache_hits_total": 1400.0})
    deltas = summary.counter_deltas(before, after)
    assert deltas["vllm:prefix_cache_hits_total"] == 56.0
    assert deltas["vllm:prefix_cache_queries_total"] == 0.0
    assert "vllm:num_requests_running" not in deltas  # gauges are not deltas


def test_percentile_interpolates() -> None:
    assert summary.percentile([], 50) is None
    assert summary.percentile([3.0], 99) == 3.0
    assert summary.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert summary.percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert summary.percentile(list(range(101)), 90) == pytest.approx(90.0)


def _request(conv: int, turn: int, group: int, server: str, ttft: float, ok: bool = True):
    return {
        "conversation": conv,
        "turn": turn,
        "system_prompt": group,
        "server": server,
        "ok": ok,
        "ttft_s": ttft if ok else None,
        "started_s": 0.5 * turn,
        "latency_s": ttft + 0.1,
        "prompt_tokens": 100,
        "cached_tokens": 50 if turn else 0,
        "error": None if ok else "HTTP 503: x",
    }


def _run(router: str, repeat: int, requests: list[dict], load: str = "low") -> dict:
    return {
        "router": router,
        "load": load,
        "concurrency": 2,
        "repeat": repeat,
        "wall_s": 1.0,
        "servers": ["vllm-0", "vllm-1"],
        "requests": requests,
        "engine_deltas": {
            "vllm-0": {
                "vllm:prefix_cache_hits_total": 30.0,
                "vllm:prefix_cache_queries_total": 100.0,
            },
            "vllm-1": {
                "vllm:prefix_cache_hits_total": 10.0,
                "vllm:prefix_cache_queries_total": 100.0,
            },
        },
        "engine_peaks": {"vllm-0": {"waiting": 2.0, "running": 4.0}},
    }


def test_summarize_run_splits_conversations_and_counts_moves() -> None:
    requests = [
        # conversation 0 stays on vllm-0; conversation 1 starts on vllm-1 and moves once;
        # conversation 2 on vllm-0 fails at turn 1.
        _request(0, 0, 0, "vllm-0", 0.01),
        _request(0, 1, 0, "vllm-0", 0.02),
        _request(1, 0, 1, "vllm-1", 0.03),
        _request(1, 1, 1, "vllm-0", 0.04),
        _request(2, 0, 0, "vllm-0", 0.05),
        _request(2, 1, 0, "vllm-0", 0.0, ok=False),
    ]
    s = summary.summarize_run(_run("epp", 0, requests))
    assert s["ok"] == 5 and s["failed"] == 1
    assert s["requests_per_server"] == {"vllm-0": 4, "vllm-1": 1}
    assert s["conversations_per_server"] == {"vllm-0": 2, "vllm-1": 1}
    assert s["split_conversations"] == 1
    assert s["moved_turns"] == 1
    assert s["groups_per_server"] == {
        "0": {"vllm-0": 2, "vllm-1": 0},
        "1": {"vllm-0": 0, "vllm-1": 1},
    }
    assert s["ttft_ms"]["p50"] == 30.0 and s["ttft_ms"]["max"] == 50.0
    assert s["engine_hit_rate"] == pytest.approx(0.2)
    assert s["engine"]["vllm-0"]["hit_rate"] == pytest.approx(0.3)
    assert s["client_cached_ratio"] == pytest.approx(100 / 500)
    assert s["engine_peak_waiting"] == {"vllm-0": 2.0, "vllm-1": None}
    assert s["failure_samples"] == ["HTTP 503: x"]
    assert s["engine_metrics_get_max_ms"] == {"vllm-0": None, "vllm-1": None}
    run = _run("epp", 0, requests)
    run["engine_peaks"]["vllm-1"] = {"waiting": 0.0, "running": 1.0, "metrics_get_max_ms": 812.5}
    s = summary.summarize_run(run)
    assert s["engine_metrics_get_max_ms"] == {"vllm-0": None, "vllm-1": 812.5}
    assert summary.runs_table([s]).splitlines()[2].endswith("| -/812 |")


def test_even_split_and_labels() -> None:
    assert summary.is_even_split({"a": 32, "b": 32})
    assert summary.is_even_split({"a": 33, "b": 32})  # odd total: off by one is even
    assert not summary.is_even_split({"a": 33, "b": 31})
    assert not summary.is_even_split({"a": 48, "b": 16})
    assert summary.is_even_split({"a": 33, "b": 31}, tolerance=2)
    assert summary.split_label({"a": 48, "b": 16}) == "48/16"


def test_verdicts_pairs_by_load_and_repeat() -> None:
    even = [_request(c, 0, 0, f"vllm-{c % 2}", 0.01 * (c + 1)) for c in range(4)]
    uneven = [_request(c, 0, 0, "vllm-0" if c else "vllm-1", 0.02 * (c + 1)) for c in range(4)]
    summaries = [
        summary.summarize_run(_run("epp", 0, uneven)),
        summary.summarize_run(_run("round_robin", 0, even)),
        summary.summarize_run(_run("round_robin", 1, even)),
        summary.summarize_run(_run("epp", 1, even)),
        summary.summarize_run(_run("epp", 2, even)),  # no partner: not a pair
    ]
    v = summary.verdicts(summaries)
    assert v["epp_runs"] == 3
    assert v["epp_uneven_request_splits"] == 1
    assert v["epp_request_splits"] == ["3/1", "2/2", "2/2"]
    assert v["pairs"] == 2
    assert v["epp_worse_ttft_max"] == 1
    table = summary.runs_table(summaries)
    assert "| 1 | low (2) | epp | 3/1 |" in table
    assert "20.0% (30.0% / 10.0%)" in table
    agg = summary.aggregate_table(summaries)
    assert "| low (2) | epp | 3 | 2/3 |" in agg


def test_reply_mismatches() -> None:
    a = {"requests": [dict(_request(0, 0, 0, "vllm-0", 0.01), reply_sha="x")]}
    b = {"requests": [dict(_request(0, 0, 0, "vllm-1", 0.01), reply_sha="y")]}
    c = {"requests": [dict(_request(1, 0, 0, "vllm-1", 0.01), reply_sha="z")]}
    assert summary.reply_mismatches([a, a, c]) == (0, 2)
    assert summary.reply_mismatches([a, b, c]) == (1, 2)


def test_in_flight_profile() -> None:
    reqs = [
        {"server": "a", "started_s": 0.0, "latency_s": 2.0},
        {"server": "a", "started_s": 0.0, "latency_s": 1.0},
        {"server": "b", "started_s": 1.0, "latency_s": 1.0},
        {"server": "?", "started_s": 0.0, "latency_s": 9.0},  # unknown server: ignored
    ]
    prof = summary.in_flight_profile(reqs, ["a", "b"])
    assert prof["peak"] == {"a": 2, "b": 1}
    # 0-1 s: a=2, b=0 (gap 2); 1-2 s: a=1, b=1 (gap 0) -> mean 1.0
    assert prof["mean_gap"] == 1.0
    assert summary.in_flight_profile([], ["a", "b"]) == {"peak": {"a": 0, "b": 0}, "mean_gap": None}


CALIBRATE_OUT = """\
scheduling:
  prefill_estimate:
    overhead_s: 0.0123
    per_token_s: 0.000131
    per_cached_token_s: 4.5e-06
"""


def test_parse_calibration_reads_epp_calibrate_output() -> None:
    assert summary.parse_calibration(CALIBRATE_OUT) == {
        "overhead_s": 0.0123,
        "per_token_s": 0.000131,
        "per_cached_token_s": 4.5e-06,
    }
    with pytest.raises(ValueError, match="per_cached_token_s"):
        summary.parse_calibration("scheduling:\n  prefill_estimate:\n    overhead_s: 1\n"
                                  "    per_token_s: 2\n")  # fmt: skip
    # Keys outside scheduling.prefill_estimate do not count.
    with pytest.raises(ValueError):
        summary.parse_calibration("overhead_s: 1\nper_token_s: 2\nper_cached_token_s: 3\n")


def test_with_prefill_estimate_keeps_the_rest_of_the_config() -> None:
    base = {"scheduling": {"tie_epsilon": 0.01, "prefill_estimate": {"overhead_s": 9.0}},
            "prefix": {"block_size": 32}}  # fmt: skip
    est = summary.parse_calibration(CALIBRATE_OUT)
    out = summary.with_prefill_estimate(base, est)
    assert out["prefix"] == {"block_size": 32}
    assert out["scheduling"]["tie_epsilon"] == 0.01
    assert out["scheduling"]["prefill_estimate"] == est
    assert base["scheduling"]["prefill_estimate"] == {"overhead_s": 9.0}  # not mutated
    assert summary.with_prefill_estimate({}, est) == {"scheduling": {"prefill_estimate": est}}


def test_calibrated_estimate_joins_configured_running_slots() -> None:
    # --epp-config docs/benchmarks/vllm-fleet/epp-slots-4.yaml with --calibrate: both kept.
    path = Path(__file__).parents[2] / "docs/benchmarks/vllm-fleet/epp-slots-4.yaml"
    base = yaml.safe_load(path.read_text())
    est = summary.parse_calibration(CALIBRATE_OUT)
    out = summary.with_prefill_estimate(base, est)
    assert out == {"scheduling": {"running_slots": 4, "prefill_estimate": est}}


def test_placement_table_and_pair_counts_by_load() -> None:
    even = [_request(c, 0, 0, f"vllm-{c % 2}", 0.01 * (c + 1)) for c in range(4)]
    uneven = [_request(c, 0, 0, "vllm-0" if c else "vllm-1", 0.02 * (c + 1)) for c in range(4)]
    summaries = [
        summary.summarize_run(_run("epp", 0, uneven)),
        summary.summarize_run(_run("round_robin", 0, even)),
        summary.summarize_run(_run("round_robin", 1, even)),
        summary.summarize_run(_run("epp", 1, even)),
        summary.summarize_run(_run("epp", 0, even, load="high")),
        summary.summarize_run(_run("round_robin", 0, uneven, load="high")),
    ]
    table = summary.placement_table(summaries)
    assert "| low (2) | epp | 3/1, 2/2 | 3/1, 2/2 | 1/2 | 0 (0-0) | 30.0% (30.0%-30.0%) |" in table
    assert "hit rate vllm-1" in table.splitlines()[0]
    counts = summary.pair_counts_by_load(summaries)
    assert list(counts) == ["low", "high"]
    # low: repeat 0 the EPP (uneven, slower) is worse, repeat 1 equal.
    assert counts["low"]["max"] == {"better": 0, "worse": 1, "equal": 1, "pairs": 2}
    assert counts["high"]["p99"] == {"better": 1, "worse": 0, "equal": 0, "pairs": 1}


def test_debug_endpoints_summary() -> None:
    pod = {"name": "vllm-0", "health": 1.0, "excluded": False, "in_flight": 2,
           "queue_depth": 0, "running_slots": None, "scrape_failures": 0}  # fmt: skip
    samples = [
        {"t": "10:00:00.000", "pods": [pod]},
        {
            "t": "10:00:00.100",
            "pods": [
                dict(
                    pod, health=0.0, excluded=True, in_flight=5, running_slots=4, scrape_failures=1
                )
            ],
        },
        {"t": "10:00:00.200", "pods": [dict(pod, excluded=True, running_slots=4)]},
    ]
    s = summary.debug_endpoints_summary(samples)["vllm-0"]
    assert s["samples"] == 3 and s["excluded"] == 2 and s["health_below_0.3"] == 1
    assert s["min_health"] == 0.0 and s["max_in_flight"] == 5 and s["running_slots"] == [4]
    assert (s["excluded_first"], s["excluded_last"]) == ("10:00:00.100", "10:00:00.200")
    assert s["scrape_failures"] == 1


def test_request_path_legs() -> None:
    reqs = [
        {"sent_unix": 100.0, "envoy_start_unix": 100.001, "epp_routed_unix": 100.003},
        {"sent_unix": 200.0, "envoy_start_unix": 200.002, "epp_routed_unix": 200.602},
        {"sent_unix": 300.0, "envoy_start_unix": 300.001, "epp_routed_unix": None},  # rr
        {"sent_unix": None},
    ]
    path = summary.request_path(reqs)
    assert path["to_envoy"]["n"] == 3 and path["to_envoy"]["max"] == pytest.approx(2.0, abs=0.01)
    assert path["envoy_to_routed"]["n"] == 2
    assert path["envoy_to_routed"]["max"] == pytest.approx(600.0, abs=0.01)
    assert summary.request_path([{"sent_unix": None}]) is None
    s = {"load": "low", "concurrency": 2, "router": "epp", "path_ms": path}
    row = summary.path_table([s]).splitlines()[2]
    assert row.startswith("| 1 | low (2) | epp | 1.0 / 2 / 2 | ")
    assert row.endswith("/ 600 |")
