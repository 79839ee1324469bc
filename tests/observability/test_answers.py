"""Every answer the EPP gives itself is counted (epp_answers_total{status,reason}) and
logged (request_answered, INFO, rate-limited per reason), through the real ext_proc
server and Router; the prompt is never in the log."""

from __future__ import annotations

import json

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from extproc.fakes import DUPLEX, FakeRouter, body_msg, headers_msg
from helpers import router_with
from prometheus_client import CollectorRegistry

from epp.config import ServerConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.extproc.server import ExternalProcessor
from epp.observability.answers import Answers

PODS = [{"name": f"pod-{i}", "address": f"10.0.0.{i + 1}:8000", "model": "m"} for i in range(2)]
MARKER = "zebra-secret-prompt"


class Context:
    def invocation_metadata(self):
        return ()


class Envoy:
    def __init__(self, messages):
        self.messages = messages

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for message in self.messages:
            yield message


async def answer(processor: ExternalProcessor, payload: bytes, request_id: str, mode=DUPLEX):
    headers = headers_msg(path="/v1/chat/completions", mode=mode)
    for header in headers.request_headers.headers.headers:
        if header.key == "x-request-id":
            header.raw_value = request_id.encode()
    replies = [
        r async for r in processor.Process(Envoy([headers, body_msg(payload, True)]), Context())
    ]
    return replies[-1].immediate_response


def chat(model: str = "m", text: str = f"{MARKER} " * 300) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


def counts(metrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in metrics.registry.collect():
        if family.name == "epp_answers":
            for sample in family.samples:
                if sample.name == "epp_answers_total":
                    out[(sample.labels["status"], sample.labels["reason"])] = sample.value
    return out


def answered_lines(lines) -> dict[str, dict]:
    return {line["request_id"]: line for line in lines() if line["event"] == "request_answered"}


async def test_every_kind_of_answer_is_counted_and_logged_without_the_prompt(json_logs):
    lines = json_logs("info")
    router, store, _, metrics = router_with(PODS)
    proc = ExternalProcessor(router, ServerConfig(max_body_bytes=4096), metrics)
    cases = {
        "bad-json": (chat()[:300], (400, "invalid-json")),
        "no-messages": (
            json.dumps({"model": "m", "prompt": MARKER}).encode(),
            (400, "invalid-request"),
        ),
        "unknown-model": (chat(model="nope", text=MARKER), (404, "model-not-found")),
        "too-large": (chat(text=MARKER * 1000), (413, "rejected-body-too-large")),
    }
    for request_id, (payload, (status, _)) in cases.items():
        reply = await answer(proc, payload, request_id)
        assert reply.status.code == status, request_id
    # Saturated pods and no admission queue: 429; no endpoints at all: 503.
    for endpoint in store.all():
        store.scraped(endpoint, PodMetrics(model="m", waiting=50))
    router.flow_control.config = router.flow_control.config.model_copy(update={"enabled": False})
    assert (await answer(proc, chat(text=MARKER), "saturated")).status.code == 429
    store.sync([])
    assert (await answer(proc, chat(text=MARKER), "no-pods")).status.code == 503
    streamed = ProcessingMode.BodySendMode.STREAMED
    assert (await answer(proc, chat(), "bad-mode", mode=streamed)).status.code == 500
    broken = ExternalProcessor(FakeRouter(error=RuntimeError("bug")), ServerConfig(), metrics)
    assert (await answer(broken, chat(), "bug")).status.code == 500

    expected = {
        **{rid: want for rid, (_, want) in cases.items()},
        "saturated": (429, "rejected-saturated"),
        "no-pods": (503, "rejected-no-endpoints"),
        "bad-mode": (500, "unsupported-body-mode"),
        "bug": (500, "internal-error"),
    }
    assert counts(metrics) == {(str(s), r): 1.0 for s, r in expected.values()}
    logged = answered_lines(lines)
    assert {rid: (line["status"], line["reason"]) for rid, line in logged.items()} == expected
    assert all(line["level"] == "info" and line["message"] for line in logged.values())
    assert "nope" in logged["unknown-model"]["message"]  # the model is named, the prompt not
    assert MARKER not in lines.raw()  # type: ignore[attr-defined]


async def test_answers_before_routing_are_not_routing_decisions(json_logs):
    json_logs("warning")
    router, _, _, metrics = router_with(PODS)
    proc = ExternalProcessor(router, ServerConfig(), metrics)
    await answer(proc, b"{", "r1")
    await answer(proc, chat(model="nope"), "r2")
    page = metrics.exposition().decode()
    assert 'epp_routing_decisions_total{model="nope",result="model-not-found"} 1.0' in page
    assert 'result="invalid-json"' not in page
    assert 'epp_answers_total{reason="invalid-json",status="400"} 1.0' in page


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_is_counted_in_full_but_logged_at_the_budget(json_logs):
    lines = json_logs("info")
    clock = Clock()
    answers = Answers(CollectorRegistry(), burst=20, per_second=5.0, clock=clock)
    for i in range(1000):
        answers.answered(f"r{i}", 400, "invalid-json", "bad")
    answers.answered("other", 404, "model-not-found", "The model `x` does not exist.")
    logged = [line for line in lines() if line["event"] == "request_answered"]
    assert len(logged) == 21  # 20 of the flood, and the 404 has its own budget
    assert "suppressed" not in logged[0] and logged[-1]["request_id"] == "other"
    clock.now = 1.0  # five more lines a second; the first says how many were dropped
    for i in range(10):
        answers.answered(f"s{i}", 400, "invalid-json", "bad")
    later = [line for line in lines() if line["event"] == "request_answered"][21:]
    assert len(later) == 5 and later[0]["suppressed"] == 980
    assert "suppressed" not in later[1]
    assert answers.total.labels("400", "invalid-json")._value.get() == 1010
    assert answers.suppressed.labels("invalid-json")._value.get() == 985


def test_long_messages_are_cut(json_logs):
    lines = json_logs("info")
    answers = Answers(CollectorRegistry())
    answers.answered("r", 404, "model-not-found", "x" * 5000)
    (line,) = lines()
    assert len(line["message"]) == 203


@pytest.mark.parametrize("level", ["warning", "error"])
def test_above_info_answers_are_counted_not_logged(json_logs, level):
    lines = json_logs(level)
    answers = Answers(CollectorRegistry())
    answers.answered("r", 400, "invalid-json", "bad")
    assert lines() == []
    assert answers.total.labels("400", "invalid-json")._value.get() == 1
