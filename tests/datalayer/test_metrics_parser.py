from __future__ import annotations

from pathlib import Path

import pytest

from epp.datalayer.metrics_parser import MetricsFormatError, parse_vllm_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_reads_vllm_033_page():
    m = parse_vllm_metrics(fixture("vllm-0.33-metrics.txt"))
    assert (m.waiting, m.running) == (3.0, 7.0)
    assert m.kv_usage == pytest.approx(0.4219)
    assert (m.prefix_queries, m.prefix_hits, m.preemptions) == (918234.0, 512000.0, 2.0)
    assert m.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert (m.block_size, m.num_gpu_blocks) == (16, 27153)
    assert m.running_adapters == frozenset() and m.max_loras is None


def test_reads_the_finished_prompt_histogram_and_the_process_start_time():
    m = parse_vllm_metrics(fixture("vllm-0.33-metrics.txt"))
    assert (m.finished_requests, m.finished_prompt_tokens) == (100.0, 215477.0)
    assert m.start_time is None  # the fixture has vLLM's own families only
    # Real vLLM 0.32 (docs/benchmarks/sim-vs-vllm/vllm.json): the process collector first.
    page = "\n".join(
        [
            "# TYPE process_start_time_seconds gauge",
            "process_start_time_seconds 1.79594500086e+09",
            'vllm:request_prompt_tokens_count{engine="0",model_name="m"} 3.0',
            'vllm:request_prompt_tokens_count{engine="1",model_name="m"} 2.0',
            'vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 300.0',
            'vllm:request_prompt_tokens_sum{engine="1",model_name="m"} 20.0',
            'vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="m"} 3.0',
        ]
    )
    m = parse_vllm_metrics(page)
    assert m.start_time == 1795945000.86
    assert (m.finished_requests, m.finished_prompt_tokens) == (5.0, 320.0)  # engines summed


def test_reads_lora_info():
    m = parse_vllm_metrics(fixture("vllm-0.33-metrics-lora.txt"))
    assert m.running_adapters == {"sql-lora", "chat-lora"}
    assert m.waiting_adapters == frozenset() and m.max_loras == 4


def test_newest_lora_series_wins_and_engines_are_summed():
    page = "\n".join(
        [
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6',
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",waiting_lora_adapters="w"} 1.9e+09',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e+09',
        ]
    )
    m = parse_vllm_metrics(page)
    assert m.waiting == 5.0
    assert m.kv_usage == pytest.approx(0.4)
    assert m.running_adapters == {"new"} and m.waiting_adapters == {"w"}


def test_old_metric_names_are_accepted_and_new_ones_preferred():
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\nvllm:num_requests_waiting 1\n'
    assert parse_vllm_metrics(old).kv_usage == 0.5
    both = old + 'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    assert parse_vllm_metrics(both).kv_usage == 0.25


@pytest.mark.parametrize(
    "page",
    [
        "",
        "garbage\x00\x01 not metrics",
        "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n",
        "<html>502 Bad Gateway</html>",
        # Any Python exporter has it: alone, it is not a vLLM page.
        "process_start_time_seconds 1.79594500086e+09\n",
    ],
)
def test_pages_without_vllm_series_are_an_error(page):
    with pytest.raises(MetricsFormatError):
        parse_vllm_metrics(page)


def test_garbage_values_are_skipped_not_fatal():
    page = "\n".join(
        [
            'vllm:num_requests_waiting{engine="0"} NaN',
            'vllm:num_requests_running{engine="0"} +Inf',
            'vllm:kv_cache_usage_perc{engine="0"} banana',
            'vllm:kv_cache_usage_perc{engine="0" 0.3',
            'vllm:num_requests_running{engine="0"} 4',
            "vllm:num_requests_waiting",
        ]
    )
    m = parse_vllm_metrics(page)
    assert m.running == 4.0 and m.waiting == 0.0


def test_usage_is_clamped():
    assert parse_vllm_metrics("vllm:kv_cache_usage_perc 7\n").kv_usage == 1.0
