"""What the page reader reads from a model server's /metrics page, field by field: real
pages (vLLM 0.32 as tools/vllm_check captured it, the vLLM 0.33 fixtures, SGLang's and
Triton's documented pages), then the line-level rules (where a series may sit on the page,
what a value or an integer label may be, escapes, old names, data-parallel engines).

The readers are built here as `epp serve` builds them (`page_reader` of a configuration),
not the module's prebuilt `VLLM_READER`."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from epp.config import DataLayerConfig
from epp.datalayer.metrics_parser import (
    MetricsFormatError,
    MetricSpec,
    PageReader,
    PodMetrics,
)
from epp.datalayer.scraper import page_reader

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
UPSTREAM = FIXTURES / "upstream"
VLLM_032_PAGE = json.loads((ROOT / "docs/benchmarks/sim-vs-vllm/vllm.json").read_text())[
    "metrics_page_first"
]
WAITING = "vllm:num_requests_waiting"


def plain_id(text: str) -> str:
    """A test id without backslashes: `mutmut` re-selects tests by id, and pytest cannot
    match an id holding an escaped newline."""
    for char, name in (("\\", "<BS>"), ("\r", "<CR>"), ("\n", "<LF>"), ("\t", "<TAB>")):
        text = text.replace(char, name)
    return text


def vllm_reader() -> PageReader:
    return page_reader(DataLayerConfig())


# -- real pages, every field --------------------------------------------------------------


def test_a_real_vllm_032_page_idle_after_start():
    """Every counter is 0 on a fresh server: zero is a value, not an absent series."""
    assert vllm_reader().parse(VLLM_032_PAGE) == PodMetrics(
        waiting=0.0,
        running=0.0,
        kv_usage=0.0,
        prefix_queries=0.0,
        prefix_hits=0.0,
        prefix_counters=True,
        preemptions=0.0,
        generation_tokens=0.0,
        model="tiny-llama",
        running_adapters=frozenset(),
        waiting_adapters=frozenset(),
        max_loras=None,
        block_size=32,
        num_gpu_blocks=40,
        finished_requests=0.0,
        finished_prompt_tokens=0.0,
        start_time=1795945000.86,
    )


def test_the_vllm_033_fixture_pages():
    page = (FIXTURES / "vllm-0.33-metrics.txt").read_text()
    assert vllm_reader().parse(page) == PodMetrics(
        waiting=3.0,
        running=7.0,
        kv_usage=0.4219,
        prefix_queries=918234.0,
        prefix_hits=512000.0,
        prefix_counters=True,
        preemptions=2.0,
        generation_tokens=120345.0,
        model="meta-llama/Llama-3.1-8B-Instruct",
        block_size=16,
        num_gpu_blocks=27153,
        finished_requests=100.0,
        finished_prompt_tokens=215477.0,
        start_time=None,
    )
    lora = vllm_reader().parse((FIXTURES / "vllm-0.33-metrics-lora.txt").read_text())
    assert (lora.running_adapters, lora.waiting_adapters, lora.max_loras) == (
        {"sql-lora", "chat-lora"},
        frozenset(),
        4,
    )


def test_sglangs_page_with_the_specs_gie_passes_for_it():
    # GIE v1.5.0 epplib/templates/_deployment.yaml, modelServerType: sglang.
    config = DataLayerConfig(
        waiting_metric="sglang:num_queue_reqs",
        running_metric="sglang:num_running_reqs",
        kv_usage_metric="sglang:token_usage",
        cache_info_metric="sglang:cache_config_info",
    )
    page = (UPSTREAM / "sglang-40ef116f" / "sglang-metrics.txt").read_text()
    assert page_reader(config).parse(page) == PodMetrics(
        waiting=2826.0,
        running=162.0,
        kv_usage=0.28,
        prefix_queries=0.0,
        prefix_hits=0.0,
        prefix_counters=False,  # no vLLM prefix-cache counters: hits cannot be judged
        preemptions=0.0,
        generation_tokens=None,  # sglang:generation_tokens_total is not vLLM's counter
        model="meta-llama/Llama-3.1-8B-Instruct",
    )


def test_tritons_page_with_the_label_matchers_gie_passes_for_it():
    config = DataLayerConfig(
        waiting_metric="nv_trt_llm_request_metrics{request_type=waiting}",
        running_metric="nv_trt_llm_request_metrics{request_type=scheduled}",
        kv_usage_metric="nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
        lora_info_metric="",
    )
    page = (UPSTREAM / "tensorrtllm_backend-v1.0.0" / "triton-metrics.txt").read_text()
    assert page_reader(config).parse(page) == PodMetrics(
        waiting=1.0,
        running=1.0,
        kv_usage=0.4875,
        prefix_counters=False,
        generation_tokens=None,
    )


# -- where a series may sit on the page -----------------------------------------------------


@pytest.mark.parametrize(
    "page",
    [
        f"{WAITING} 4",  # the whole page, no newline
        f"{WAITING} 4\n",
        f"\n{WAITING} 4\n",  # a short first line before it
        f"#\n{WAITING} 4",
        f"# HELP {WAITING} x\n# TYPE {WAITING} gauge\n{WAITING} 4\n",
        f"{WAITING}\t4\n",
        f"{WAITING} 4 1795945000000\n",  # a timestamp after the value
        f"{WAITING} 4\r\n",
        f'{WAITING}{{engine="0"}}  4\n',
        f"{WAITING}{{}} 4\n",
        f'{WAITING}{{a="x}}y"}} 4\n',  # a brace inside a label value
        f'{WAITING}{{engine="0"}}4\n',  # Prometheus needs no blank after the labels
    ],
    ids=lambda page: plain_id(page),
)
def test_a_series_is_found_wherever_it_sits(page):
    assert vllm_reader().parse(page).waiting == 4.0


@pytest.mark.parametrize("suffix", ["_by_reason", "X", "x", ":total", "2", "_bucket", "{"])
def test_a_longer_name_is_another_metric(suffix):
    page = f"{WAITING}{suffix} 9\n{WAITING} 1\n{WAITING}{suffix}{{a=1}} 9\n"
    if suffix == "{":  # an unclosed label block: not a series
        page = f'{WAITING}{{a="1" 9\n{WAITING} 1\n'
    assert vllm_reader().parse(page).waiting == 1.0


@pytest.mark.parametrize(
    "line",
    [f"{WAITING}", f"{WAITING} ", f'{WAITING}{{engine="0"}}', f"{WAITING}{{}}", f" {WAITING} 4"],
)
def test_a_line_without_a_value_is_no_series(line):
    page = f"{line}\nvllm:num_requests_running 2\n"
    metrics = vllm_reader().parse(page)
    assert (metrics.waiting, metrics.running) == (0.0, 2.0)


def test_a_one_letter_metric_after_its_bare_name():
    reader = PageReader(MetricSpec("q"), None, None, None, None)
    assert reader.parse("q\nq 1\n").waiting == 1.0
    assert reader.parse("x\nq\nq 1\n").waiting == 1.0


def test_consecutive_series_of_one_metric_are_all_read():
    page = "".join(f'{WAITING}{{engine="{i}"}} {i}\n' for i in range(5))
    assert vllm_reader().parse(page).waiting == 10.0
    assert vllm_reader().parse(page.rstrip("\n")).waiting == 10.0


# -- values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0.0),
        ("1e-300", 1e-300),
        ("2.5", 2.5),
        ("1.7976931348623157e+308", sys.float_info.max),  # the largest float is a value
        ("-0", 0.0),
        ("-0.0", 0.0),
    ],
)
def test_values_read(text, value):
    metrics = vllm_reader().parse(f"vllm:generation_tokens_total {text}\n")
    assert metrics.generation_tokens == value
    assert math.copysign(1.0, metrics.generation_tokens) == 1.0  # -0 reads as 0


@pytest.mark.parametrize("text", ["-1", "-1e-300", "inf", "+Inf", "NaN", "1e309", "x", "0x10"])
def test_values_that_are_no_count_are_absent(text):
    metrics = vllm_reader().parse(f"vllm:generation_tokens_total {text}\n{WAITING} 1\n")
    assert metrics.generation_tokens is None


def test_a_page_of_zero_values_is_a_page():
    assert vllm_reader().parse(f"{WAITING} 0\n").waiting == 0.0
    with pytest.raises(MetricsFormatError):
        vllm_reader().parse(f"{WAITING} -1\n")


@pytest.mark.parametrize(
    ("digits", "read"),
    [
        ("16", 16),
        ("0", 0),
        ("9" * 18, int("9" * 18)),
        ("9" * 19, None),
        ("+16", None),
        (" 16", None),
        ("16.0", None),
        ("", None),
        ("٣", None),
    ],
)
def test_integer_labels_are_at_most_18_ascii_digits(digits, read):
    page = (
        f'vllm:cache_config_info{{block_size="{digits}",num_gpu_blocks="{digits}"}} 1\n'
        f'vllm:lora_requests_info{{max_lora="{digits}",running_lora_adapters=""}} 1\n'
        f"{WAITING} 1\n"
    )
    metrics = vllm_reader().parse(page)
    assert (metrics.block_size, metrics.num_gpu_blocks, metrics.max_loras) == (read,) * 3


def test_escaped_label_values_are_unescaped():
    page = (
        'vllm:num_requests_waiting{model_name="org/say \\"hi\\"\\\\v1\\n"} 1\n'
        'vllm:lora_requests_info{running_lora_adapters="a\\\\b, c\\"d",max_lora="2"} 5\n'
    )
    metrics = vllm_reader().parse(page)
    assert metrics.model == 'org/say "hi"\\v1\n'
    assert metrics.running_adapters == {"a\\b", 'c"d'}


# -- which series feed which field --------------------------------------------------------


def test_the_model_is_the_first_served_model_name_of_a_summed_series():
    page = (
        'vllm:cache_config_info{block_size="16",model_name="cache-model"} 1\n'
        f'{WAITING}{{engine="0",model_name=""}} 1\n'
        f'{WAITING}{{engine="1",model_name="first"}} 1\n'
        f'{WAITING}{{engine="2",model_name="second"}} 1\n'
    )
    assert vllm_reader().parse(page).model == "first"
    assert vllm_reader().parse(f"{WAITING} 1\n").model is None
    counter = 'vllm:prefix_cache_hits_total{model_name="m"} 1\n'
    assert vllm_reader().parse(counter).model == "m"


def test_old_vllm_names_are_read_when_the_new_ones_are_absent():
    """vLLM <= 0.11: gpu_cache_usage_perc and gpu_prefix_cache_* (engines averaged and
    summed as the new ones are)."""
    old = (
        'vllm:gpu_cache_usage_perc{engine="0"} 0.2\n'
        'vllm:gpu_cache_usage_perc{engine="1"} 0.6\n'
        'vllm:gpu_prefix_cache_queries_total{engine="0"} 10\n'
        'vllm:gpu_prefix_cache_queries_total{engine="1"} 20\n'
        'vllm:gpu_prefix_cache_hits_total{engine="0"} 3\n'
    )
    metrics = vllm_reader().parse(old)
    assert metrics.kv_usage == pytest.approx(0.4)
    assert (metrics.prefix_queries, metrics.prefix_hits) == (30.0, 3.0)
    assert metrics.prefix_counters
    new = (
        "vllm:kv_cache_usage_perc 0.9\n"
        "vllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total 50\n"
    )
    metrics = vllm_reader().parse(old + new)
    assert (metrics.kv_usage, metrics.prefix_queries, metrics.prefix_hits) == (0.9, 100.0, 50.0)


def test_the_old_kv_name_is_not_read_for_a_spec_with_labels():
    reader = PageReader(kv_usage=MetricSpec("vllm:kv_cache_usage_perc", (("engine", "0"),)))
    metrics = reader.parse(f"vllm:gpu_cache_usage_perc 0.5\n{WAITING} 1\n")
    assert metrics.kv_usage == 0.0


def test_prefix_counters_need_the_hits_counter():
    metrics = vllm_reader().parse("vllm:prefix_cache_queries_total 10\n")
    assert metrics.prefix_queries == 10.0 and not metrics.prefix_counters


def test_usage_is_the_mean_of_the_engines_and_stays_in_range():
    page = "".join(f'vllm:kv_cache_usage_perc{{engine="{i}"}} {v}\n' for i, v in enumerate([1, 0]))
    assert vllm_reader().parse(page).kv_usage == 0.5
    assert vllm_reader().parse("vllm:kv_cache_usage_perc 1.5\n").kv_usage == 1.0
    assert vllm_reader().parse(f"{WAITING} 1\n").kv_usage == 0.0


def test_the_process_start_time_is_read_with_the_servers_series():
    page = f"process_start_time_seconds 1795945000.5\n{WAITING} 1\n"
    assert vllm_reader().parse(page).start_time == 1795945000.5
    zero = vllm_reader().parse(f"process_start_time_seconds -0\n{WAITING} 1\n").start_time
    assert zero == 0.0 and math.copysign(1.0, zero) == 1.0  # -0 reads as 0


def test_lora_info_alone_makes_a_page_and_the_newest_series_wins_ties_to_the_first():
    page = (
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="old"} 10\n'
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="a, b,,",'
        'waiting_lora_adapters="w"} 20\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="same-time"} 20\n'
        'vllm:lora_requests_info{max_lora="9",running_lora_adapters="oldest"} 0\n'
    )
    metrics = vllm_reader().parse(page)
    assert (metrics.running_adapters, metrics.waiting_adapters, metrics.max_loras) == (
        {"a", "b"},
        {"w"},
        3,
    )
    assert metrics.generation_tokens is None and metrics.waiting == 0.0
    bare = vllm_reader().parse("vllm:lora_requests_info 7\n")
    assert (bare.running_adapters, bare.waiting_adapters, bare.max_loras) == (
        frozenset(),
        frozenset(),
        None,
    )


def test_cache_info_alone_makes_a_page_and_engines_add_their_blocks():
    page = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="50",engine="1"} 1\n'
    )
    metrics = vllm_reader().parse(page)
    assert (metrics.block_size, metrics.num_gpu_blocks) == (16, 150)
    # vLLM's label names first, then SGLang's.
    both = 'vllm:cache_config_info{page_size="1",block_size="32",num_pages="7"} 1\n'
    assert (vllm_reader().parse(both).block_size, vllm_reader().parse(both).num_gpu_blocks) == (
        32,
        7,
    )
    # Without a block size, cache info alone is no model server page.
    with pytest.raises(MetricsFormatError):
        vllm_reader().parse('vllm:cache_config_info{num_gpu_blocks="7"} 1\n')


def test_a_spec_left_out_is_not_read():
    reader = PageReader(None, None, MetricSpec("kv"), None, None)
    page = (
        f"{WAITING} 5\nvllm:num_requests_running 5\nkv 0.5\n"
        'vllm:lora_requests_info{running_lora_adapters="a"} 1\n'
        'vllm:cache_config_info{block_size="16"} 1\n'
    )
    metrics = reader.parse(page)
    assert (metrics.waiting, metrics.running, metrics.kv_usage) == (0.0, 0.0, 0.5)
    assert (metrics.running_adapters, metrics.block_size) == (frozenset(), None)


# -- bytes as fetched ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        FIXTURES / "vllm-0.33-metrics.txt",
        FIXTURES / "vllm-0.33-metrics-lora.txt",
        UPSTREAM / "sglang-40ef116f" / "sglang-metrics.txt",
    ],
    ids=lambda p: p.name,
)
def test_a_page_read_as_fetched_bytes_reads_as_its_text(path):
    """The scraper hands the page over undecoded: the same fields as the decoded text."""
    raw = path.read_bytes()
    reader = vllm_reader()
    try:
        expected = reader.parse(raw.decode())
    except MetricsFormatError as exc:
        with pytest.raises(MetricsFormatError, match=re.escape(str(exc))):
            reader.parse(raw)
        return
    assert reader.parse(raw) == expected


def test_invalid_utf8_in_a_read_line_is_replaced_as_a_decode_would():
    """A model name with an invalid byte, a value after one: the bytes read as their
    `decode("utf-8", "replace")` reads (U+FFFD in the label, the value garbage)."""
    raw = (
        b'vllm:num_requests_running{model_name="m\xff\xe2\x82"} 2\n'
        b"vllm:num_requests_waiting \xed\xa0\x80 5\n"
        b"vllm:num_requests_waiting 1\n\xf0\x9f\x98"
    )
    metrics = vllm_reader().parse(raw)
    assert metrics == vllm_reader().parse(raw.decode("utf-8", "replace"))
    assert (metrics.model, metrics.running, metrics.waiting) == ("m\ufffd\ufffd", 2.0, 1.0)


def test_garbage_bytes_are_a_clear_format_error():
    with pytest.raises(MetricsFormatError, match=r"^no model server metrics on the page"):
        vllm_reader().parse(bytes(range(256)) * 40 + b"\x00\n<html>oops</html>")


def test_the_reader_names_every_series_it_reads_once():
    """What a scrape may ask a server for (`name[]=`): the specs' names, vLLM's counters,
    its old names and the start time."""
    names = vllm_reader().names
    assert len(names) == len(set(names))
    assert {WAITING, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"} <= set(names)
    assert {"vllm:request_prompt_tokens_sum", "process_start_time_seconds"} <= set(names)
    custom = PageReader(MetricSpec("q"), MetricSpec("q", (("a", "1"),)), None, None, None)
    assert custom.names[0] == "q" and "vllm:gpu_cache_usage_perc" not in custom.names


def test_a_reader_reading_page_after_page_reads_each_as_a_new_reader_would():
    """Label texts are kept between pages: a changed label set is read anew, escapes too."""
    pages = [
        (FIXTURES / "vllm-0.33-metrics.txt").read_text(),
        (FIXTURES / "vllm-0.33-metrics-lora.txt").read_text(),
        'vllm:num_requests_waiting{model_name="a\\"b"} 1\n',
        'vllm:num_requests_waiting{model_name="c"} 1\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="9"} 1\n',
        (FIXTURES / "vllm-0.33-metrics.txt").read_text(),
    ]
    reader = vllm_reader()
    for page in pages * 2:
        assert reader.parse(page) == vllm_reader().parse(page)
