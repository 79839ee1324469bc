"""The /metrics page against vLLM 0.33's own pages."""

from __future__ import annotations

import re
from array import array
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_sim.engine import EngineConfig, FinishReason, SimEngine
from vllm_sim.hashing import block_hashes
from vllm_sim.latency import Histogram, LatencyStats, RequestTimeline
from vllm_sim.metrics_page import (
    MAX_LORA_INFO_SERIES,
    LoraInfoSeries,
    format_value,
    render_metrics_page,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LORA_FIXTURE = FIXTURES / "vllm-0.33-metrics-lora.txt"
PLAIN_FIXTURE = FIXTURES / "vllm-0.33-metrics.txt"
CREATED = 1795939121.8106837

# Families of vLLM 0.33's page the simulator leaves out, and why. A family that goes
# missing, or one that gets added, must change this list (and say why).
NOT_SIMULATED = {
    # Tokens per engine step. The simulator has no lock-step engine iterations: each
    # request decodes on its own timer (`decode_step_seconds` as the batch is now), so
    # there is no honest per-step token count to observe.
    "vllm:iteration_tokens_total",
    "vllm:iteration_tokens_total_created",
}

# `cache_config_info` follows vLLM 0.32 (the real vLLM of docs/benchmarks/sim-vs-vllm.md),
# whose label set is the 0.33 fixture's without this one.
CACHE_CONFIG_LABELS_ONLY_IN_033 = {"simple_cpu_offload_num_blocks"}
# The label names vLLM 0.32 printed (docs/benchmarks/sim-vs-vllm/vllm.json).
VLLM_032_CACHE_CONFIG_LABELS = {
    "_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens",
    "effective_attention_block_size", "enable_mamba_shared_prefix_checkpoint",
    "enable_prefix_caching", "engine", "gpu_memory_utilization", "hash_block_size",
    "is_attention_free", "kv_cache_dtype_skip_layers", "kv_cache_layout",
    "kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens",
    "kv_offloading_backend", "kv_offloading_size", "kv_sharing_fast_prefill",
    "mamba_block_size", "mamba_cache_dtype", "mamba_cache_mode", "mamba_page_size_padded",
    "mamba_ssm_cache_dtype", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
    "prefix_cache_retention_interval", "prefix_caching_hash_algo", "prefix_match_unit",
    "replayssm_buffer_len", "skip_page_size_padded", "sliding_window", "swa_bounded_replay",
    "use_kda_recoverssm", "use_replayssm", "user_specified_block_size",
}  # fmt: skip


def busy_engine() -> SimEngine:
    """Two requests served (the second a prefix hit), one running, one waiting."""
    engine = SimEngine(EngineConfig(max_num_seqs=1, num_gpu_blocks=100))
    toks = array("I", range(40))
    hashes = block_hashes(toks, 16)
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


def families(page: str) -> list[str]:
    """Family names in page order, as their `# TYPE` lines give them."""
    return re.findall(r"^# TYPE (\S+) ", page, re.MULTILINE)


def label_names(page: str) -> dict[str, set[frozenset[str]]]:
    """Sample name -> the label-name sets it appears with."""
    out: dict[str, set[frozenset[str]]] = {}
    for name, labels in re.findall(r"^([^#\s{]+)\{([^}]*)\}", page, re.MULTILINE):
        out.setdefault(name, set()).add(frozenset(re.findall(r'(\w+)="', labels)))
    return out


def help_texts(page: str) -> dict[str, str]:
    return dict(re.findall(r"^# HELP (\S+) (.*)$", page, re.MULTILINE))


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


def test_every_histogram_has_the_fixtures_bucket_bounds() -> None:
    pattern = re.compile(r'^(vllm:\w+)_bucket\{engine="0",le="([^"]+)"', re.MULTILINE)

    def bounds(page: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, le in pattern.findall(page):
            out.setdefault(name, []).append(le)
        return out

    ours = bounds(render(busy_engine()))
    theirs = bounds(LORA_FIXTURE.read_text())
    assert len(ours) == 15
    assert ours == {name: theirs[name] for name in ours}


def page_with_everything() -> str:
    lora = LoraInfoSeries(4)
    lora.observe(("sql-lora",), (), 1000.0)
    return render(busy_engine(), lora)


@pytest.mark.parametrize("fixture", [LORA_FIXTURE, PLAIN_FIXTURE], ids=["lora", "plain"])
def test_the_fixture_families_we_lack_are_exactly_the_allow_listed_ones(fixture: Path) -> None:
    lora = fixture is LORA_FIXTURE
    page = page_with_everything() if lora else render(busy_engine())
    missing = set(families(fixture.read_text())) - set(families(page))
    assert missing == NOT_SIMULATED
    assert set(families(page)) <= set(families(fixture.read_text()))  # nothing invented


def test_families_keep_the_fixtures_order_help_and_label_sets() -> None:
    page = page_with_everything()
    fixture = LORA_FIXTURE.read_text()
    fixture_order = families(fixture)
    assert [name for name in fixture_order if name not in NOT_SIMULATED] == families(page)
    theirs_help = help_texts(fixture)
    assert {name: theirs_help[name] for name in help_texts(page)} == help_texts(page)
    theirs_labels = label_names(fixture)
    theirs_labels["vllm:cache_config_info"] = {
        labels - CACHE_CONFIG_LABELS_ONLY_IN_033
        for labels in theirs_labels["vllm:cache_config_info"]
    }
    for name, label_sets in label_names(page).items():
        assert label_sets == theirs_labels[name], name


def test_series_of_every_labelled_family_come_in_the_fixtures_order() -> None:
    def series_order(page: str, family: str) -> list[str]:
        return re.findall(rf"^{re.escape(family)}\{{([^}}]*)\}}", page, re.MULTILINE)

    page = render(busy_engine())
    fixture = LORA_FIXTURE.read_text()
    for family in (
        "vllm:num_requests_waiting_by_reason",
        "vllm:engine_sleep_state",
        "vllm:prompt_tokens_by_source_total",
        "vllm:prompt_tokens_cached_by_source_total",
        "vllm:request_success_total",
        "vllm:admission_rejections_total",
    ):
        assert series_order(page, family) == series_order(fixture, family), family


def test_new_gauges_and_counters_reflect_engine_state() -> None:
    engine = busy_engine()
    engine.submit("e", [], 8, 1)
    engine.submit("f", [], 8, 1)  # max_waiting is 64, so these queue
    got = samples(render(engine))
    base = 'engine="0",model_name="m"'
    expected = {
        # One slot: d, e and f wait for it; no adapter lacks a slot (max_loras is 4).
        f'vllm:num_requests_waiting_by_reason{{{base},reason="capacity"}}': "3.0",
        f'vllm:num_requests_waiting_by_reason{{{base},reason="deferred"}}': "0.0",
        f'vllm:engine_sleep_state{{{base},sleep_state="awake"}}': "1.0",
        f'vllm:engine_sleep_state{{{base},sleep_state="discard_all"}}': "0.0",
        f"vllm:prompt_tokens_cached_total{{{base}}}": "64.0",
        f'vllm:prompt_tokens_by_source_total{{{base},source="local_compute"}}': "56.0",
        f'vllm:prompt_tokens_by_source_total{{{base},source="local_cache_hit"}}': "64.0",
        f'vllm:prompt_tokens_by_source_total{{{base},source="external_kv_transfer"}}': "0.0",
        f'vllm:prompt_tokens_cached_by_source_total{{{base},source="device"}}': "64.0",
        f"vllm:external_prefix_cache_queries_total{{{base}}}": "0.0",
        f"vllm:mm_cache_hits_total{{{base}}}": "0.0",
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"}': "0.0",
        # Two requests finished normally: 40 prompt tokens each, 4 output, max_tokens 4.
        f"vllm:request_prompt_tokens_count{{{base}}}": "2.0",
        f"vllm:request_prompt_tokens_sum{{{base}}}": "80.0",
        f"vllm:request_generation_tokens_sum{{{base}}}": "8.0",
        f"vllm:request_params_max_tokens_sum{{{base}}}": "8.0",
        f"vllm:request_max_num_generation_tokens_sum{{{base}}}": "8.0",
        f"vllm:request_params_n_sum{{{base}}}": "2.0",
        f"vllm:request_num_preemptions_sum{{{base}}}": "0.0",
        f"vllm:request_prefill_kv_computed_tokens_sum{{{base}}}": "48.0",  # 40 + (40 - 32)
    }
    assert {key: got.get(key) for key in expected} == expected


def test_deferred_waiting_requests_are_those_whose_adapter_has_no_slot() -> None:
    engine = SimEngine(EngineConfig(max_num_seqs=4, max_loras=1))
    engine.submit("a", [], 8, 4, adapter="x")
    engine.start_ready(0.0)
    engine.submit("b", [], 8, 4, adapter="y")  # x holds the only slot
    engine.submit("c", [], 8, 4)
    engine.submit("d", [], 8, 4, adapter="x")  # x is resident: could run
    engine.submit("e", [], 12, 4)  # base model: runs
    assert engine.num_waiting_deferred == 1
    got = samples(render(engine))
    assert (
        got['vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"}']
        == "1.0"
    )


def test_queue_full_rejections_are_admission_rejections() -> None:
    engine = SimEngine(EngineConfig(max_num_seqs=1, max_waiting=0))
    engine.submit("a", [], 8, 4)
    engine.start_ready(0.0)
    engine.submit("b", [], 8, 4)
    engine.submit("c", [], 8, 4)
    got = samples(render(engine))
    assert (
        got['vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"}'] == "2.0"
    )


def test_request_time_histograms_from_a_timeline() -> None:
    latency = LatencyStats()
    latency.observe_finished(
        RequestTimeline(
            arrived=10.0, scheduled=10.5, first_token=11.0, finished=13.0, output_tokens=5
        )
    )
    page = render_metrics_page(SimEngine(), model_name="m", created_unix=CREATED, latency=latency)
    got = samples(page)
    base = 'engine="0",model_name="m"'
    assert {
        name: float(got[f"vllm:{name}_sum{{{base}}}"])
        for name in (
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_inference_time_seconds",
            "request_time_per_output_token_seconds",
        )
    } == {
        "e2e_request_latency_seconds": 3.0,
        "request_queue_time_seconds": 0.5,
        "request_prefill_time_seconds": 0.5,
        "request_decode_time_seconds": 2.0,
        "request_inference_time_seconds": 2.5,
        "request_time_per_output_token_seconds": 0.5,
    }


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
    page = render(
        SimEngine(EngineConfig(block_size=32, num_gpu_blocks=27153, gpu_memory_utilization=0.92))
    )
    [line] = [x for x in page.splitlines() if x.startswith("vllm:cache_config_info{")]
    assert 'block_size="32"' in line
    assert 'num_gpu_blocks="27153"' in line
    assert 'kv_cache_size_tokens="868896"' in line
    assert 'gpu_memory_utilization="0.92"' in line
    assert 'enable_prefix_caching="True"' in line
    assert line.endswith("} 1.0")


def test_cache_config_info_labels_and_values_are_vllm_032s() -> None:
    page = render(SimEngine(EngineConfig(block_size=32, num_gpu_blocks=40)))
    [line] = [x for x in page.splitlines() if x.startswith("vllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert set(labels) == VLLM_032_CACHE_CONFIG_LABELS
    # As vLLM 0.32's API server prints them: the hash block size is resolved elsewhere.
    assert labels["hash_block_size"] == "None"
    assert labels["prefix_caching_hash_algo"] == "sha256"
    assert (labels["block_size"], labels["num_gpu_blocks"]) == ("32", "40")


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


def test_the_process_start_time_comes_first_as_on_vllms_page() -> None:
    latency = LatencyStats()
    page = render_metrics_page(
        busy_engine(), model_name="m", created_unix=CREATED, latency=latency,
        process_start_unix=1795945000.86,
    )  # fmt: skip
    assert page.splitlines()[:3] == [
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        "process_start_time_seconds 1.79594500086e+09",  # vLLM 0.32's page prints this
    ]
    family = next(
        f for f in text_string_to_metric_families(page) if f.name == "process_start_time_seconds"
    )
    assert family.samples[0].value == 1795945000.86
