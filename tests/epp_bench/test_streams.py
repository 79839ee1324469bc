"""The parsing and reporting of `epp bench streams` (the run itself is a benchmark)."""

from __future__ import annotations

import json
from collections import Counter

from epp_bench.picker.streams import StreamsResult, parse_envoy_stats, parse_epp_counts


def test_envoy_stats_keep_counters_and_gauges_only():
    text = (
        "cluster.pods.upstream_rq_active: 10000\n"
        "cluster.epp.upstream_rq_active_overflow: 0\n"
        "cluster.pods.upstream_rq_time: P0(nan,1.0) P25(nan,2.0)\n"
        "http.llm.ext_proc.streams_failed: 3\n"
    )
    assert parse_envoy_stats(text) == {
        "cluster.pods.upstream_rq_active": 10000,
        "cluster.epp.upstream_rq_active_overflow": 0,
        "http.llm.ext_proc.streams_failed": 3,
    }


def test_epp_counts_sum_over_pods_and_skip_requests_naming_no_model():
    text = """\
# TYPE epp_pod_in_flight_requests gauge
epp_pod_in_flight_requests{pod="pod-0"} 3.0
epp_pod_in_flight_requests{pod="pod-1"} 4.0
# TYPE llm_d_epp_inflight_requests gauge
llm_d_epp_inflight_requests{endpoint_name="pod-0",producer_name="epp"} 7.0
# TYPE llm_d_epp_request_duration_seconds histogram
llm_d_epp_request_duration_seconds_count{model_name="",target_model_name=""} 1.0
llm_d_epp_request_duration_seconds_count{model_name="m",target_model_name="m"} 5.0
"""
    counts = parse_epp_counts(text)
    assert counts.in_flight == {
        "epp_pod_in_flight_requests": 7.0,
        "llm_d_epp_inflight_requests": 7.0,
    }
    assert counts.completions == 5.0


def test_result_json_has_string_keys_and_the_5xx_total():
    result = StreamsResult(3, ok=1, statuses=Counter({200: 1, 500: 1, 503: 1}))
    result.errors["ServerDisconnectedError"] += 2
    data = json.loads(json.dumps(result.to_json()))
    assert data["statuses"] == {"200": 1, "500": 1, "503": 1}
    assert data["errors"] == {"ServerDisconnectedError": 2}
    assert data["five_xx"] == 2
