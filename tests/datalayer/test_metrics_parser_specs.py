"""Metric specs (`--total-queued-requests-metric` and friends, `datalayer.*_metric`): what
`parse_metric_spec` accepts, the one-line error the operator reads for what it refuses,
and how a spec prints back (the MetricsFormatError of a page names the specs looked for)."""

from __future__ import annotations

import pytest

from epp.datalayer.metrics_parser import (
    MetricsFormatError,
    MetricSpec,
    MetricSpecError,
    PageReader,
    parse_metric_spec,
)


@pytest.mark.parametrize("text", ["", " ", "\t\n"])
def test_a_blank_spec_means_the_series_is_not_read(text):
    assert parse_metric_spec(text) is None


@pytest.mark.parametrize(
    ("text", "name", "labels"),
    [
        ("vllm:num_requests_waiting", "vllm:num_requests_waiting", ()),
        ("  sglang:num_queue_reqs \n", "sglang:num_queue_reqs", ()),
        ("_x:y_9", "_x:y_9", ()),
        ("q{}", "q", ()),
        ("q{ }", "q", ()),
        ('q {a="x"}', "q", (("a", "x"),)),
        # GIE's chart passes label values unquoted (request_type=waiting).
        (
            "nv_trt_llm_request_metrics{request_type=waiting}",
            "nv_trt_llm_request_metrics",
            (("request_type", "waiting"),),
        ),
        ("q{a='x'}", "q", (("a", "x"),)),
        ('q{ b = "y" , a = x }', "q", (("a", "x"), ("b", "y"))),  # sorted by key
        ('q{a="x",}', "q", (("a", "x"),)),  # PromQL allows a trailing comma
        ('q{a="x", }', "q", (("a", "x"),)),
        ('q{a=""}', "q", (("a", ""),)),
        ('q{a="x,y}z"}', "q", (("a", "x,y}z"),)),
        ('q{a="x{y"}', "q", (("a", "x{y"),)),  # the name ends at the first brace
        (r'q{a="say \"hi\"\\now\n"}', "q", (("a", 'say "hi"\\now\n'),)),
        (r"q{a='it\'s'}", "q", (("a", "it's"),)),
        ('q{_a1="1",B="2"}', "q", (("B", "2"), ("_a1", "1"))),
    ],
)
def test_accepted_specs(text, name, labels):
    assert parse_metric_spec(text) == MetricSpec(name, labels)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("9lives", "'9lives': not a metric name (e.g. vllm:num_requests_waiting)"),
        ("vllm-waiting", "'vllm-waiting': not a metric name (e.g. vllm:num_requests_waiting)"),
        ('{a="x"}', """'{a="x"}': not a metric name (e.g. vllm:num_requests_waiting)"""),
        ('q{a="x"', """'q{a="x"': the label block must close with '}' at the end"""),
        ('q{a="x"} 1', """'q{a="x"} 1': the label block must close with '}' at the end"""),
        ("q{a}", "'q{a}': expected label=\"value\" at 'a'"),
        ('q{a="x" b="y"}', """'q{a="x" b="y"}': expected label="value" at 'a="x" b="y"'"""),
        ('q{a="x",,b="y"}', """'q{a="x",,b="y"}': expected label="value" at ',b="y"'"""),
        ('q{a="x"}}', """'q{a="x"}}': expected label="value" at 'a="x"}'"""),
        ('q{9="x"}', """'q{9="x"}': expected label="value" at '9="x"'"""),
        ('q{a!="x"}', """'q{a!="x"}': only '=' label matchers are supported, not '!='"""),
        ('q{a=~"x"}', """'q{a=~"x"}': only '=' label matchers are supported, not '=~'"""),
        ('q{a!~"x"}', """'q{a!~"x"}': only '=' label matchers are supported, not '!~'"""),
        ('q{a="x",a="y"}', """'q{a="x",a="y"}': label 'a' is given twice"""),
    ],
)
def test_refused_specs_name_the_spec_and_the_problem_in_one_line(text, error):
    with pytest.raises(MetricSpecError) as raised:
        parse_metric_spec(text)
    assert str(raised.value) == error


def test_from_texts_refuses_the_bad_spec_by_its_text():
    with pytest.raises(MetricSpecError, match=r"^'q\{a!=\"x\"\}': only '='"):
        PageReader.from_texts("w", "r", 'q{a!="x"}', "", "")


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (MetricSpec("q"), "q"),
        (MetricSpec("q", (("a", "x"), ("b", "y"))), 'q{a="x",b="y"}'),
        (MetricSpec("q", (("a", 'say "hi"\\now\n'),)), r'q{a="say \"hi\"\\now\n"}'),
    ],
)
def test_a_spec_prints_as_a_spec_that_reads_back_the_same(spec, text):
    assert str(spec) == text
    assert parse_metric_spec(str(spec)) == spec


def test_a_page_without_the_series_names_every_spec_looked_for():
    reader = PageReader.from_texts('q{kind="waiting"}', "", "kv", "", "cache")
    with pytest.raises(MetricsFormatError) as raised:
        reader.parse("other_metric 1\n")
    assert str(raised.value) == (
        'no model server metrics on the page (wanted: q{kind="waiting"}, kv, cache)'
    )
    with pytest.raises(MetricsFormatError) as raised:
        PageReader().parse("")
    assert str(raised.value) == (
        "no model server metrics on the page (wanted: vllm:num_requests_waiting, "
        "vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:lora_requests_info, "
        "vllm:cache_config_info)"
    )


def test_a_spec_reads_only_the_series_with_every_label_it_names():
    reader = PageReader(MetricSpec("q", (("a", "1"), ("b", "2"))), None, None, None, None)
    page = 'q{a="1",b="2"} 4\nq{a="1"} 100\nq{b="2"} 200\nq{a="1",b="3"} 300\nq{b="2",a="1"} 1\n'
    assert reader.parse(page).waiting == 5.0
