"""The spec's three log points at each level, through the real logging pipeline (JSON
lines): INFO one line per request; DEBUG adds `request_received` and `scoring_complete`
(top 3 + the chosen pod); TRACE adds block-level `prefix_match`; WARNING nothing. Every
line carries the request id; the prompt never appears at any level."""

from __future__ import annotations

import io
import json

import pytest
import structlog
from helpers import router_with

from epp.observability import logs
from epp.observability.logs import trace_enabled
from epp.request import IncomingRequest
from epp.routing.observation import selection_reason, top_with_chosen
from epp.scheduling.types import Decision

PODS = [{"name": f"pod-{i}", "address": f"10.0.0.{i + 1}:8000", "model": "m"} for i in range(5)]
MARKER = "zebra-secret-prompt"


def body(text: str = f"{MARKER} " * 200) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    ).encode()


def route_three(level: str, json_logs):
    lines = json_logs(level)
    router = router_with(PODS)[0]
    for i in range(3):
        routed = router.route_now(
            IncomingRequest(path="/v1/chat/completions", body=body(), request_id=f"req-{i}")
        )
        router.complete(routed, 200)
    return lines(), lines.raw()  # type: ignore[attr-defined]


def events(lines: list[dict]) -> list[tuple[str, str, str]]:
    return [(line["event"], line["level"], line.get("request_id")) for line in lines]


def test_info_writes_one_line_per_request_with_the_three_points_fields(json_logs):
    lines, raw = route_three("info", json_logs)
    assert events(lines) == [("request_routed", "info", f"req-{i}") for i in range(3)]
    first, second = lines[0], lines[1]
    for key in ("model", "adapter", "input_tokens", "pod", "address", "reason", "score"):
        assert key in first, key
    assert first["model"] == "m" and first["input_tokens"] > 200
    assert first["address"].startswith("10.0.0.") and first["address"].endswith(":8000")
    # Five idle pods and a new prompt: a tie; then the pod holding the prompt wins on cache.
    assert first["reason"] == "tie"
    assert second["reason"] in ("cache", "prefill") and second["pod"] == first["pod"]
    assert second["margin"] > 0
    assert MARKER not in raw


def test_debug_adds_received_and_scoring_complete_with_the_top_three(json_logs):
    lines, raw = route_three("debug", json_logs)
    per_request = [
        ("request_received", "debug"),
        ("scoring_complete", "debug"),
        ("request_routed", "info"),
    ]
    expected = [(e, lvl, f"req-{i}") for i in range(3) for e, lvl in per_request]
    assert events(lines) == expected
    scoring = lines[4]  # the second request's
    assert len(scoring["top"]) == 3 and scoring["candidates"] == 5
    assert set(scoring["top"][0]) >= {"pod", "score", "cache", "load", "queue", "health"}
    assert scoring["top"][0]["pod"] == lines[5]["pod"]
    received = lines[3]
    assert received["input_tokens"] == lines[5]["input_tokens"] and received["adapter"] is None
    assert "prefix_match" not in raw and MARKER not in raw


def test_trace_adds_matched_blocks_per_pod(json_logs):
    lines, raw = route_three("trace", json_logs)
    traces = [line for line in lines if line["level"] == "trace"]
    assert [t["request_id"] for t in traces] == ["req-0", "req-1", "req-2"]
    assert all(t["event"] == "prefix_match" for t in traces)
    assert traces[0]["matched_blocks"] == {}
    chosen = lines[[line["event"] for line in lines].index("request_routed")]["pod"]
    assert traces[1]["matched_blocks"] == {chosen: traces[1]["blocks"]}
    assert traces[1]["block_size"] == 16 and len(traces[1]["first_block"]) == 16
    assert MARKER not in raw
    assert trace_enabled()


def test_warning_logs_nothing_for_routed_requests(json_logs):
    lines, raw = route_three("warning", json_logs)
    assert lines == [] and raw == ""


def test_trace_lines_are_dropped_at_debug_even_if_logged(json_logs):
    lines = json_logs("debug")
    logs.trace(structlog.get_logger("t"), "deep", request_id="r")
    structlog.get_logger("t").debug("shallow", request_id="r")
    assert [line["event"] for line in lines()] == ["shallow"]


def test_the_chosen_pod_is_added_when_not_in_the_top_three():
    from helpers import endpoint

    pods = [endpoint(f"p{i}") for i in range(5)]
    decision = Decision(
        request_id="r",
        endpoints=[pods[4]],
        candidates=pods,
        totals=[0.9, 0.8, 0.7, 0.6, 0.5],
        factors={"cache": [0.9, 0.8, 0.7, 0.6, 0.5]},
        weights={"cache": 1.0},
        chosen_index=4,
    )
    top = top_with_chosen(decision, 3)
    assert [row["pod"] for row in top] == ["p0", "p1", "p2", "p4"]
    assert top[-1]["selected"] is True and "selected" not in top[0]


@pytest.mark.parametrize(
    ("totals", "factors", "chosen", "reason"),
    [
        ([0.7], {"cache": [0.7]}, 0, "only-candidate"),
        ([0.701, 0.700], {"cache": [0.7, 0.7]}, 0, "tie"),
        ([0.9, 0.4], {"cache": [1.0, 0.0], "load": [0.5, 1.0]}, 0, "cache"),
        ([0.4, 0.9], {"cache": [0.5, 0.5], "load": [0.0, 1.0]}, 1, "load"),
        ([0.2, 0.9, 0.5], {"queue": [0.0, 1.0, 0.5], "cache": [0.0, 0.1, 0.0]}, 1, "queue"),
    ],
)
def testselection_reason(totals, factors, chosen, reason):
    from helpers import endpoint

    pods = [endpoint(f"p{i}") for i in range(len(totals))]
    decision = Decision(
        request_id="r",
        endpoints=[pods[chosen]],
        candidates=pods,
        totals=totals,
        factors=factors,
        weights={"cache": 0.6, "load": 0.2, "queue": 0.7},
        chosen_index=chosen,
    )
    got, margin = selection_reason(decision, 0.005)
    assert got == reason
    assert margin == pytest.approx(0 if len(totals) == 1 else totals[chosen] - sorted(totals)[-2])


def test_a_value_msgspec_refuses_is_still_logged(json_logs):
    lines = json_logs("info")
    log = structlog.get_logger("t")
    log.info("odd", request_id="id-\ud800", thing=object())
    (line,) = lines()
    assert line["request_id"] == "id-\ud800" and line["thing"].startswith("<object")


def test_trace_adds_each_pod_report(json_logs):
    from epp.datalayer.metrics_parser import PodMetrics

    lines = json_logs("trace")
    store = router_with(PODS[:1])[1]
    pod = store.all()[0]
    store.scraped(pod, PodMetrics(model="m", waiting=3, prefix_hits=64))
    store.scrape_failed(pod, "TimeoutError: ")
    reports = [line for line in lines() if line["event"] == "pod_report"]
    assert [(r["level"], r["waiting"], r["failures"]) for r in reports] == [
        ("trace", 3, 0),
        ("trace", 3, 1),
    ]
    assert reports[0]["prefix_hits"] == 64 and reports[1]["error"] == "TimeoutError: "
    at_debug = json_logs("debug")
    store.scraped(pod, PodMetrics(model="m"))
    store.scrape_failed(pod, "TimeoutError: ")
    assert at_debug() == []


def test_a_logger_cached_under_a_swapped_stderr_writes_to_stderr_as_it_is_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A test runner swaps sys.stderr per test and closes the old one; a module logger
    # cached under the first must write to whatever stderr is when it logs.
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    logs.configure_logging("info")
    try:
        logger = structlog.get_logger("epp.test")
        logger.info("first_line")
        first.close()
        monkeypatch.setattr("sys.stderr", second)
        logger.info("second_line")
    finally:
        logs.configure_logging("info")
        structlog.reset_defaults()
    assert json.loads(second.getvalue())["event"] == "second_line"


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_fields_go_on_every_line_under_the_lines_own(fmt: str) -> None:
    """`epp serve --workers N`: each worker's lines say which worker wrote them."""
    out = io.StringIO()
    logs.configure_logging("info", stream=out, fmt=fmt, fields={"worker": 1})
    try:
        logger = structlog.get_logger("epp.test.fields")
        logger.info("plain")
        logger.info("own", worker="mine")
    finally:
        structlog.reset_defaults()
    lines = out.getvalue().splitlines()
    if fmt == "json":
        assert [json.loads(line)["worker"] for line in lines] == [1, "mine"]
    else:
        assert "worker=1" in lines[0] and "worker=mine" in lines[1]
