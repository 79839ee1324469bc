"""Request trailers in both body modes, fed to the machine as Envoy 1.40 sends them (what
Envoy does is shown end to end in tests/e2e/test_side_doors_e2e.py).

BUFFERED: the one body message has end_of_stream false when the client's trailers follow,
and Envoy sends those trailers (trailer mode SEND) only after the body is answered. A
body-less request ended by trailers sends no body message at all.
"""

from __future__ import annotations

import json

from extproc.fakes import (
    ADDRESSES,
    BUFFERED,
    DUPLEX,
    FakeRouted,
    _Decision,
    _Endpoint,
    body_msg,
    body_of,
    destination,
    headers_msg,
    trailers_msg,
)

from epp.extproc.machine import ExtProcStream, Phase


def stream() -> ExtProcStream:
    return ExtProcStream(max_body_bytes=1 << 20, chunk_bytes=1024, assumed_duplex=False)


def routed() -> FakeRouted:
    return FakeRouted("tok-1", "rid-1", _Decision([_Endpoint(a) for a in ADDRESSES]))


def test_buffered_body_before_trailers_is_routed_at_once():
    s = stream()
    (first,) = s.feed(headers_msg(mode=BUFFERED)).replies
    assert first.HasField("request_headers")
    body = body_of()
    step = s.feed(body_msg(body, False))  # trailers follow
    assert step.route is not None and step.route.body == body and s.phase is Phase.ROUTING
    done = s.routed(routed())
    (reply,) = done.replies
    assert reply.HasField("request_body") and destination(reply) == ",".join(ADDRESSES)
    assert done.finish  # Envoy treats the end of the stream as processing complete


def test_buffered_trailers_after_routing_are_answered_as_trailers():
    """A gateway that still sends them on an open stream gets the matching answer."""
    s = stream()
    s.feed(headers_msg(mode=BUFFERED))
    s.feed(body_msg(body_of(), False))
    s.routed(routed())
    step = s.feed(trailers_msg())
    (reply,) = step.replies
    assert reply.HasField("request_trailers") and step.finish


def test_buffered_trailers_without_a_body_get_a_400_not_a_pass_through():
    s = stream()
    s.feed(headers_msg(mode=BUFFERED))
    step = s.feed(trailers_msg())
    (reply,) = step.replies
    assert reply.HasField("immediate_response") and step.finish
    assert reply.immediate_response.status.code == 400
    assert step.answer is not None and step.answer.reason == "invalid-request"
    assert json.loads(reply.immediate_response.body)["error"]["message"] == (
        "the request has no body (only trailers); expected a JSON object"
    )


def test_duplex_routes_on_trailers_and_answers_them_last():
    s = ExtProcStream(max_body_bytes=1 << 20, chunk_bytes=1024, assumed_duplex=True)
    s.feed(headers_msg(mode=DUPLEX))
    body = body_of()
    assert s.feed(body_msg(body, False)).route is None
    step = s.feed(trailers_msg())
    assert step.route is not None and step.route.body == body
    replies = s.routed(routed()).replies
    assert replies[0].HasField("request_headers") and replies[-1].HasField("request_trailers")
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:-1]]
    assert b"".join(c.body for c in chunks) == body
    assert not any(c.end_of_stream for c in chunks)  # the trailers end the stream
