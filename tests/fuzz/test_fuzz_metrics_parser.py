"""The model servers' metrics page reader (epp.datalayer.metrics_parser), fuzzed.

Contract: any page raises nothing but `MetricsFormatError` (a page with none of the
series routing needs); what it returns is finite and in range: KV usage in [0, 1], queue
and running counts, counters, block sizes and block counts >= 0, so that a broken or
hostile pod can never hand the scheduler a NaN, an infinity or a negative load.
"""

from __future__ import annotations

import math

from fuzz.budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datalayer.metrics_parser import (
    BLOCK_SIZE_LABELS,
    DEFAULT_CACHE_INFO,
    DEFAULT_KV_USAGE,
    DEFAULT_LORA_INFO,
    DEFAULT_RUNNING,
    DEFAULT_WAITING,
    NUM_BLOCKS_LABELS,
    OLD_KV_USAGE,
    START_TIME,
    VLLM_COUNTERS,
    MetricsFormatError,
    PageReader,
    PodMetrics,
    parse_metric_spec,
)

NAMES = [
    DEFAULT_WAITING,
    DEFAULT_RUNNING,
    DEFAULT_KV_USAGE,
    OLD_KV_USAGE,
    DEFAULT_LORA_INFO,
    DEFAULT_CACHE_INFO,
    START_TIME,
    *VLLM_COUNTERS,
    "sglang:num_queue_reqs",
    "vllm:num_requests_waiting_bucket",
]
LABEL_KEYS = [
    "model_name",
    "engine",
    "running_lora_adapters",
    "waiting_lora_adapters",
    "max_lora",
    *BLOCK_SIZE_LABELS,
    *NUM_BLOCKS_LABELS,
    "x",
]
VALUES = (
    st.sampled_from(
        [
            "0",
            "1",
            "-1",
            "0.5",
            "1e308",
            "1.7976931348623157e308",
            "-1e308",
            "NaN",
            "+Inf",
            "-Inf",
            "nan",
            "1_0",
            "0x10",
            "",
            "inf",
            "9" * 400,
            "1e-400",
            "٣",
            "²",
            "-0",
        ]
    )
    | st.floats().map(repr)
    | st.integers(-(2**80), 2**80).map(str)
)
LABEL_VALUES = VALUES | st.text(max_size=12) | st.sampled_from(["a,b", 'a\\"b', "\\n", "9" * 5000])


@st.composite
def series_line(draw):
    name = draw(st.sampled_from(NAMES) | st.text(max_size=20))
    labels = draw(st.dictionaries(st.sampled_from(LABEL_KEYS), LABEL_VALUES, max_size=4))
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    block = draw(st.sampled_from([f"{{{inner}}}", "", "{", "}", f"{{{inner}", "{}"]))
    sep = draw(st.sampled_from([" ", "\t", "", "  "]))
    stamp = draw(st.sampled_from(["", " 1700000000000", " x"]))
    return f"{name}{block}{sep}{draw(VALUES)}{stamp}"


@st.composite
def pages(draw):
    lines = draw(st.lists(series_line() | st.text(max_size=40), max_size=25))
    if draw(st.booleans()):
        lines.insert(
            0, "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge"
        )
    return draw(st.sampled_from(["\n", "\r\n", "\n\n"])).join(lines)


def check(metrics: PodMetrics) -> None:
    assert 0.0 <= metrics.kv_usage <= 1.0
    for name in ("waiting", "running", "prefix_queries", "prefix_hits", "preemptions"):
        value = getattr(metrics, name)
        assert math.isfinite(value) and value >= 0, (name, value)
    for name in ("generation_tokens", "finished_requests", "finished_prompt_tokens", "start_time"):
        value = getattr(metrics, name)
        assert value is None or (math.isfinite(value) and value >= 0), (name, value)
    for name in ("max_loras", "block_size", "num_gpu_blocks"):
        value = getattr(metrics, name)
        assert value is None or (isinstance(value, int) and value >= 0), (name, value)


READERS = [
    PageReader(),
    PageReader(
        parse_metric_spec('sglang:num_queue_reqs{engine="0"}'),
        parse_metric_spec(DEFAULT_RUNNING),
        parse_metric_spec('vllm:kv_cache_usage_perc{model_name="m"}'),
        None,
        parse_metric_spec(DEFAULT_CACHE_INFO),
    ),
]


def read(reader: PageReader, page: str) -> None:
    try:
        metrics = reader.parse(page)
    except MetricsFormatError:
        return
    check(metrics)


@settings(max_examples=examples(300))
@given(page=pages(), which=st.sampled_from(range(len(READERS))))
def test_any_page_is_read_in_range_or_refused_with_metrics_format_error(page, which):
    read(READERS[which], page)


@settings(max_examples=examples(200))
@given(page=st.text(max_size=2000) | st.binary(max_size=2000).map(lambda b: b.decode("latin-1")))
def test_arbitrary_text_is_read_in_range_or_refused(page):
    read(READERS[0], page)


# Label values made of digits of any script: str.isdigit() and int() disagree on some.
DIGITS = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=6) | st.builds(
    lambda n: "9" * n, st.integers(1, 6000)
)


@settings(max_examples=examples(100))
@given(
    name=st.sampled_from([DEFAULT_CACHE_INFO, DEFAULT_LORA_INFO]),
    labels=st.dictionaries(
        st.sampled_from(["max_lora", *BLOCK_SIZE_LABELS, *NUM_BLOCKS_LABELS]), DIGITS, min_size=1
    ),
)
def test_integer_labels_of_any_digits_are_read_or_absent(name, labels):
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    read(READERS[0], f"{name}{{{inner}}} 1\n")


@settings(max_examples=examples(60))
@given(
    values=st.lists(VALUES | st.floats(min_value=0).map(repr), min_size=1, max_size=6),
    name=st.sampled_from([DEFAULT_WAITING, DEFAULT_KV_USAGE, "vllm:prefix_cache_hits_total"]),
)
def test_summed_engines_stay_finite(values, name):
    # Data-parallel engines are summed: two huge finite values must not make an infinity.
    page = "\n".join(f'{name}{{engine="{i}"}} {v}' for i, v in enumerate(values))
    read(READERS[0], page)


# -- what the fuzzing found (each failed before the fix in metrics_parser.py) ----------------


def test_a_negative_sample_is_garbage_not_a_negative_load():
    metrics = READERS[0].parse(f"{DEFAULT_WAITING} -5\n{DEFAULT_RUNNING} 2\n")
    assert (metrics.waiting, metrics.running) == (0.0, 2.0)


def test_huge_engine_values_sum_to_a_finite_value():
    page = "".join(f'{DEFAULT_WAITING}{{engine="{i}"}} 1.7e308\n' for i in range(3))
    assert math.isfinite(READERS[0].parse(page).waiting)


def test_digit_labels_int_cannot_read_are_absent_not_a_crash():
    # "²" passes str.isdigit() but not int(); 5,000 digits pass both checks but int()
    # refuses strings past 4,300 digits (CPython's limit).
    for bad in ("²", "9" * 5000):
        page = (
            f'{DEFAULT_CACHE_INFO}{{block_size="{bad}",num_gpu_blocks="{bad}"}} 1\n'
            f'{DEFAULT_LORA_INFO}{{max_lora="{bad}",running_lora_adapters=""}} 1\n'
        )
        metrics = READERS[0].parse(page)
        assert (metrics.block_size, metrics.num_gpu_blocks, metrics.max_loras) == (None,) * 3
