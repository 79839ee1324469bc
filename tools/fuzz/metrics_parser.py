"""atheris harness: the metrics page reader (epp.datalayer.metrics_parser). Contract: any
page is read finite and in range, or refused with MetricsFormatError only."""

from __future__ import annotations

import math
import sys

import atheris

with atheris.instrument_imports():
    from epp.datalayer.metrics_parser import MetricsFormatError, PageReader, parse_metric_spec

from harness import run

READERS = [
    PageReader(),
    PageReader(
        parse_metric_spec('sglang:num_queue_reqs{engine="0"}'),
        parse_metric_spec("sglang:num_running_reqs"),
        parse_metric_spec("sglang:token_usage"),
        None,
        parse_metric_spec("sglang:cache_config_info"),
    ),
]
COUNTS = ("waiting", "running", "prefix_queries", "prefix_hits", "preemptions")
OPTIONAL = ("generation_tokens", "finished_requests", "finished_prompt_tokens", "start_time")


def test_one_input(data: bytes) -> None:
    if not data:
        return
    try:
        metrics = READERS[data[0] % 2].parse(data[1:].decode("utf-8", "replace"))
    except MetricsFormatError:
        return
    if not 0.0 <= metrics.kv_usage <= 1.0:
        raise AssertionError(f"kv_usage {metrics.kv_usage}")
    for name in COUNTS + OPTIONAL:
        value = getattr(metrics, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise AssertionError(f"{name} {value}")
    for name in ("max_loras", "block_size", "num_gpu_blocks"):
        value = getattr(metrics, name)
        if value is not None and value < 0:
            raise AssertionError(f"{name} {value}")


def seeds() -> list[bytes]:
    page = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:prefix_cache_queries_total{engine="0"} 100.0\n'
        'vllm:prefix_cache_hits_total{engine="0"} 40.0\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="1024"} 1.0\n'
        "process_start_time_seconds 1.7e9\n"
        "vllm:request_prompt_tokens_count 5\nvllm:request_prompt_tokens_sum 500\n"
    )
    sglang = 'sglang:num_queue_reqs{engine="0"} 2\nsglang:cache_config_info{page_size="1",num_pages="9"} 1\n'
    return [b"\x00" + page.encode(), b"\x01" + sglang.encode()]


if __name__ == "__main__":
    sys.exit(run("metrics_parser", test_one_input, seeds()))
