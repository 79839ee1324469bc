"""The gRPC servicer driven directly (no network): routing streams end once routed,
observer streams report completions, and failures stay inside one stream."""

from __future__ import annotations

import asyncio
import logging

import pytest
import structlog
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from extproc.fakes import (
    ADDRESSES,
    BUFFERED,
    DUPLEX,
    FakeRouter,
    body_msg,
    body_of,
    destination,
    headers_msg,
    response_headers_msg,
    set_headers,
)

from epp.config import ServerConfig
from epp.extproc.observer import ObserverStream
from epp.extproc.server import INTERNAL_ERROR_BODY, ExternalProcessor, RoutingStreams
from epp.observability.metrics import EppMetrics
from epp.request import RequestRejected


class Context:
    def __init__(self, metadata=()):
        self._metadata = tuple(metadata)

    def invocation_metadata(self):
        return self._metadata


OBSERVER = [("x-epp-stream", "observer")]


class Envoy:
    """The request side of one stream: messages, then (unless `close`) it stays open, as
    Envoy's does until the request ends."""

    def __init__(self, messages, close=False):
        self.messages = list(messages)
        self.close = close
        self.forever = asyncio.Event()

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for message in self.messages:
            yield message
        if not self.close:
            await self.forever.wait()


def processor(router, streams=None) -> ExternalProcessor:
    return ExternalProcessor(router, ServerConfig(), EppMetrics(), streams)


async def until(condition, turns: int = 1000) -> None:
    """Lets the event loop run until `condition()` holds: no wall-clock wait."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not true after {turns} turns of the event loop")


async def settle(turns: int = 50) -> None:
    """Lets every task that can run, run (a bounded number of event-loop turns)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def replies_of(proc, envoy, metadata=(), timeout=2.0):
    out = []

    async def run():
        async for reply in proc.Process(envoy, Context(metadata)):
            out.append(reply)

    await asyncio.wait_for(run(), timeout)
    return out


async def test_routing_stream_ends_with_ok_right_after_routing_while_envoy_keeps_it_open():
    router = FakeRouter()
    envoy = Envoy([headers_msg(mode=DUPLEX), body_msg(body_of(), True)])
    replies = await replies_of(processor(router), envoy)  # would time out if it waited
    assert destination(replies[0]) == "127.0.0.1:8001"
    assert replies[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    assert router.completed == []  # the observer reports the end, not the routing stream


async def test_route_is_awaited_with_the_request_headers():
    router = FakeRouter(gate=asyncio.Event())
    envoy = Envoy([headers_msg(mode=BUFFERED, extra=[("x-gateway-inference-objective", "o")])])
    envoy.messages.append(body_msg(body_of(), True))
    task = asyncio.ensure_future(replies_of(processor(router), envoy))
    await until(lambda: router.calls)
    await settle()
    assert not task.done()  # waiting in the "admission queue"
    router.gate.set()
    replies = await task
    assert replies[0].HasField("request_headers") and destination(replies[1])
    assert router.calls[0]["headers"]["x-gateway-inference-objective"] == "o"


async def test_rejection_with_retry_after_through_the_server():
    rejected = RequestRejected(429, "queue full", reason="rejected-saturated")
    rejected.retry_after_s = 1.5
    router = FakeRouter(reject=rejected)
    envoy = Envoy([headers_msg(mode=DUPLEX), body_msg(body_of(), True)])
    (reply,) = await replies_of(processor(router), envoy)
    headers = set_headers(reply.immediate_response)
    assert reply.immediate_response.status.code == 429 and headers["retry-after"] == "2"


async def test_a_reset_after_the_destination_was_handed_to_grpc_keeps_the_request_counted():
    # Envoy may read the destination and reset the stream before the generator resumes:
    # the request is then being served, and releasing it would under-count its pod. Its
    # end is the observer's to report (or a page's, or the TTL's), not the reset's.
    router = FakeRouter()
    proc = processor(router)
    gen = proc.Process(Envoy([headers_msg(eos=True, mode=DUPLEX)]), Context())
    first = await anext(gen)  # the destination reply went to gRPC ...
    assert destination(first) == ADDRESSES[0]
    await gen.aclose()  # ... and the stream was reset before the generator resumed
    assert router.completed == []


class ResetOnceRouted(FakeRouter):
    """Envoy resets the stream as the decision is made, before any reply carries it."""

    consumer: asyncio.Task | None = None

    async def route(self, request):
        routed = await super().route(request)
        assert self.consumer is not None
        self.consumer.cancel()
        return routed


async def test_a_reset_before_the_destination_was_handed_to_grpc_releases_the_decision():
    router = ResetOnceRouted()
    out: list = []

    async def consume():
        async for reply in processor(router).Process(duplex_request(), Context()):
            out.append(reply)

    router.consumer = asyncio.ensure_future(consume())
    with pytest.raises(asyncio.CancelledError):
        await router.consumer
    assert out == [] and router.completed == [("token-0", None, None)]


async def test_observer_reports_status_and_served_address_once_at_the_end():
    router = FakeRouter()
    messages = [
        headers_msg(extra=[("x-epp-route-token", "tok-9")]),
        response_headers_msg(
            "200", attributes={"upstream.address": "127.0.0.1:8002"}, observability=True
        ),
    ]
    messages[0].observability_mode = True
    replies = await replies_of(processor(router), Envoy(messages, close=True), OBSERVER)
    assert replies == []  # observability mode: Envoy expects no answer
    assert router.completed == [("tok-9", 200, "127.0.0.1:8002")]


async def test_observer_takes_the_token_from_attributes_and_ends_on_trailers():
    router = FakeRouter()
    attributes = {"request.headers['x-epp-route-token']": "tok-3", "upstream.address": "1.2.3.4:5"}
    messages = [
        response_headers_msg("503", attributes=attributes, observability=True),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers(), observability_mode=True),
    ]
    envoy = Envoy(messages)  # stays open: the trailers are the end
    task = asyncio.ensure_future(replies_of(processor(router), envoy))
    await until(lambda: router.completed)
    await settle()
    assert router.completed == [("tok-3", 503, "1.2.3.4:5")] and not task.done()
    envoy.forever.set()
    await task
    assert len(router.completed) == 1


async def test_observer_stream_ending_without_a_response_reports_none():
    router = FakeRouter()
    messages = [headers_msg(extra=[("x-epp-route-token", "tok-1")])]
    messages[0].observability_mode = True
    await replies_of(processor(router), Envoy(messages, close=True))  # no metadata needed
    assert router.completed == [("tok-1", None, None)]


async def test_observer_without_observability_mode_answers_every_message():
    router = FakeRouter()
    messages = [
        headers_msg(extra=[("x-epp-route-token", "tok-1")]),
        response_headers_msg("200", eos=True),
    ]
    replies = await replies_of(processor(router), Envoy(messages, close=True), OBSERVER)
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "response_headers"]
    assert router.completed == [("tok-1", 200, None)]


async def test_unsupported_body_mode_is_logged_once_as_an_error(caplog):
    structlog.configure(logger_factory=structlog.stdlib.LoggerFactory())
    try:
        router = FakeRouter()
        proc = processor(router)
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                envoy = Envoy([headers_msg(mode=ProcessingMode.BodySendMode.STREAMED)])
                (reply,) = await replies_of(proc, envoy)
                assert reply.immediate_response.status.code == 500
        errors = [r for r in caplog.records if "unsupported_body_mode" in r.getMessage()]
        assert len(errors) == 1 and "request_body_mode" in errors[0].getMessage()
        assert "STREAMED" in errors[0].getMessage()
        assert router.calls == []
    finally:
        structlog.reset_defaults()


async def test_routing_streams_are_counted_observers_are_not():
    now = [100.0]
    streams = RoutingStreams(clock=lambda: now[0])
    router = FakeRouter(gate=asyncio.Event())
    proc = processor(router, streams)
    routing = asyncio.ensure_future(replies_of(proc, Envoy([headers_msg(eos=True, mode=DUPLEX)])))
    observing = asyncio.ensure_future(
        replies_of(proc, Envoy([headers_msg(extra=[("x-epp-route-token", "t")])]), OBSERVER)
    )
    await until(lambda: router.calls)
    await settle()
    assert streams.open == 1 and streams.quiet_for() == 0.0
    router.gate.set()
    await routing
    now[0] += 2.5
    assert streams.open == 0 and streams.quiet_for() == pytest.approx(2.5)
    observing.cancel()


def duplex_request() -> Envoy:
    return Envoy([headers_msg(mode=DUPLEX), body_msg(body_of(), True)])


async def test_an_exception_inside_routing_is_a_500_for_that_stream_only():
    metrics = EppMetrics()
    router = FakeRouter(error=RuntimeError("a bug in routing"))
    proc = ExternalProcessor(router, ServerConfig(), metrics)
    (reply,) = await replies_of(proc, duplex_request())
    assert reply.immediate_response.status.code == 500
    assert reply.immediate_response.body == INTERNAL_ERROR_BODY
    assert set_headers(reply.immediate_response)["x-epp-request-id"] == "rid-1"
    assert metrics.streams_failed._value.get() == 1
    assert router.completed == []  # nothing was routed, nothing to release
    router.error = None  # the next stream is served as if nothing happened
    replies = await replies_of(proc, duplex_request())
    assert destination(replies[0]) == ADDRESSES[0]
    assert metrics.streams_failed._value.get() == 1


async def test_a_decision_that_cannot_be_sent_is_released_and_the_stream_ends():
    metrics = EppMetrics()
    router = FakeRouter(addresses=[None])  # a broken decision: no address to join
    proc = ExternalProcessor(router, ServerConfig(), metrics)
    await replies_of(proc, duplex_request())  # ends, no exception escapes
    assert router.completed == [("token-0", None, None)]  # the reservation is released
    assert metrics.streams_failed._value.get() == 1


@pytest.mark.parametrize(
    "kind",
    [
        "request_headers",
        "request_body",
        "request_trailers",
        "response_headers",
        "response_body",
        "response_trailers",
    ],
)
def test_an_observer_outside_observability_mode_lets_every_message_through_unchanged(kind):
    message = pb.ProcessingRequest()
    getattr(message, kind).SetInParent()
    reply = ObserverStream.reply(message)
    assert reply.WhichOneof("response") == kind
    assert reply == pb.ProcessingResponse(**{kind: getattr(reply, kind).__class__()})
    message.observability_mode = True
    assert ObserverStream.reply(message) is None
