"""The /metrics page against vLLM 0.33's own pages."""

from __future__ import annotations

import re
from array import array
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.prefix.hashing import block_hashes, chain_seed
from epp.sim.engine import EngineConfig, FinishReason, SimEngine
from epp.sim.latency import Histogram, LatencyStats
from epp.sim.metrics_page import (
    MAX_LORA_INFO_SERIES,
    LoraInfoSeries,
    format_value,
    render_metrics_page,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LORA_FIXTURE = FIXTURES / "vllm-0.33-metrics-lora.txt"
CREATED = 1795939121.8106837


def busy_engine() -> SimEngine:
    """Two requests served (the second a prefix hit), one running, one waiting."""
    engine = SimEngine(EngineConfig(max_num_seqs=1, num_gpu_blocks=100))
    toks = array("I", range(40))
    hashes = block_hashes(toks, 16, chain_seed("m"))
    for req_id in ("a", "b"):
        engine.submit(req_id, hashes, 40, 4)
        engine.start_ready(0.0)
        engine.finish(req_id, 4)
    engine.submit("c", hashes, 40, 4, adapter="sql-lora")
    engine.submit("d", hashes, 40, 4, adapter="chat-lora")
    engine.start_ready(0.0)
    return engine


def render(engine: SimEngine, lora: LoraInfoSeries | None = None) -> str:
    latency = LatencyStats()
    for seconds in (0.003, 0.02, 0.5):
        latency.ttft.observe(seconds)
    latency.e2e.observe(1.2)
    return render_metrics_page(
        engine, model_name="m", created_unix=CREATED, latency=latency, lora_info=lora
    )


def samples(page: str) -> dict[str, str]:
    """Series (name and labels, as printed) -> value text."""
    out: dict[str, str] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = value
    return out


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (7, "7.0"),
        (0.4219, "0.4219"),
        (918234, "918234.0"),
        (1000000, "1e+06"),
        (1795939121.8106837, "1.7959391218106837e+09"),
        (1.75e9, "1.75e+09"),
        (12345678901.5, "1.23456789015e+10"),
        (float("inf"), "+Inf"),
        (float("nan"), "NaN"),
        (0.0, "0.0"),
    ],
)
def test_values_print_like_vllm(value: float, text: str) -> None:
    assert format_value(value) == text


def test_gauges_and_counters_reflect_engine_state() -> None:
    got = samples(render(busy_engine()))
    base = 'engine="0",model_name="m"'
    expected = {
        f"vllm:num_requests_running{{{base}}}": "1.0",
        f"vllm:num_requests_waiting{{{base}}}": "1.0",
        f"vllm:kv_cache_usage_perc{{{base}}}": "0.03",  # 2 prompt + 1 private of 100
        f"vllm:prefix_cache_queries_total{{{base}}}": "120.0",
        f"vllm:prefix_cache_hits_total{{{base}}}": "64.0",  # 32 for b, 32 for c
        f"vllm:prefix_cache_queries_created{{{base}}}": "1.7959391218106837e+09",
        f"vllm:num_preemptions_total{{{base}}}": "0.0",
        f"vllm:prompt_tokens_total{{{base}}}": "120.0",
        f"vllm:generation_tokens_total{{{base}}}": "8.0",
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"}': "2.0",
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"}': "0.0",
    }
    assert {key: got.get(key) for key in expected} == expected


def test_histograms_use_vllm_buckets_and_cumulative_counts() -> None:
    got = samples(render(busy_engine()))
    ttft = 'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{}",model_name="m"}}'
    assert [got[ttft.format(le)] for le in ("0.001", "0.005", "0.02", "0.25", "0.5", "+Inf")] == [
        "0.0", "1.0", "2.0", "2.0", "3.0", "3.0",
    ]  # fmt: skip
    assert got['vllm:time_to_first_token_seconds_count{engine="0",model_name="m"}'] == "3.0"
    assert float(got['vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"}']) == 1.2
    fixture_bounds = re.findall(
        r'^vllm:(time_to_first_token|e2e_request_latency)_seconds_bucket\{engine="0",le="([^"]+)"',
        LORA_FIXTURE.read_text(),
        re.MULTILINE,
    )
    ours = re.findall(
        r'^vllm:(time_to_first_token|e2e_request_latency)_seconds_bucket\{engine="0",le="([^"]+)"',
        render(busy_engine()),
        re.MULTILINE,
    )
    assert ours == fixture_bounds


def test_page_parses_and_keeps_vllm_order() -> None:
    page = render(busy_engine(), LoraInfoSeries(4))
    families = [f.name for f in text_string_to_metric_families(page)]
    assert "vllm:cache_config_info" in families
    # Our families appear in the same relative order as on a real vLLM page.
    fixture_order = re.findall(r"^# TYPE (\S+) ", LORA_FIXTURE.read_text(), re.MULTILINE)
    our_order = re.findall(r"^# TYPE (\S+) ", page, re.MULTILINE)
    assert [name for name in fixture_order if name in our_order] == our_order


def test_every_label_set_is_sorted_by_name() -> None:
    page = render(busy_engine(), LoraInfoSeries(4))
    for labels in re.findall(r"^[^#][^{]*\{([^}]*)\}", page, re.MULTILINE):
        names = re.findall(r'(\w+)="', labels)
        assert names == sorted(names), labels


def test_cache_config_info_names_block_size_and_capacity() -> None:
    page = render(SimEngine(EngineConfig(block_size=32, num_gpu_blocks=27153)))
    [line] = [x for x in page.splitlines() if x.startswith("vllm:cache_config_info{")]
    assert 'block_size="32"' in line
    assert 'num_gpu_blocks="27153"' in line
    assert 'enable_prefix_caching="True"' in line
    assert line.endswith("} 1.0")


def test_lora_info_only_with_adapters_and_newest_series_is_current() -> None:
    engine = busy_engine()
    assert "lora_requests_info" not in render(engine)
    lora = LoraInfoSeries(4)
    lora.observe(engine.running_adapters, engine.waiting_adapters, 1000.0)
    lora.observe((), (), 2000.0)
    got = samples(render(engine, lora))
    assert got == got | {
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora",'
        'waiting_lora_adapters="chat-lora"}': "1000.0",
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters=""}': "2000.0",
    }


def test_lora_info_keeps_a_bounded_number_of_old_series() -> None:
    lora = LoraInfoSeries(2)
    for i in range(MAX_LORA_INFO_SERIES + 5):
        lora.observe([f"a{i}"], [], float(i))
    series = lora.series()
    assert len(series) == MAX_LORA_INFO_SERIES
    assert max(seen for _, seen in series) == MAX_LORA_INFO_SERIES + 4


def test_label_values_are_escaped() -> None:
    page = render_metrics_page(
        SimEngine(), model_name='we"ird\\model\n', created_unix=CREATED, latency=LatencyStats()
    )
    assert 'model_name="we\\"ird\\\\model\\n"' in page
    assert len(list(text_string_to_metric_families(page))) > 5


def test_histogram_rejects_unsorted_bounds() -> None:
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


def test_finish_reasons_are_all_listed() -> None:
    page = render(SimEngine())
    for reason in FinishReason:
        assert f'finished_reason="{reason.value}"' in page
