"""The ext_proc stream machine (epp.extproc.machine, sans-I/O), fuzzed with message sequences.

Contract: a stream Envoy can send (headers, the body in chunks of any sizes, trailers, in
BUFFERED or FULL_DUPLEX_STREAMED) never raises and ends with exactly one answer: one
routing decision (the destination) or one immediate response. The body forwarded is the
body received, byte for byte (never more), in chunks of at most `chunk_bytes`; a body over
`max_body_bytes` is a 413 and is never handed to the router. A sequence Envoy cannot send
raises only `ProtocolViolation` (the server ends that stream), and still never produces a
second answer.
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from extproc.fakes import (
    BUFFERED,
    DUPLEX,
    FakeRouted,
    _Decision,
    _Endpoint,
    body_msg,
    headers_msg,
    response_headers_msg,
    trailers_msg,
)
from fuzz.budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.extproc.machine import ExtProcStream, Phase, ProtocolViolation
from epp.extproc.messages import DESTINATION_HEADER
from epp.request import RequestRejected

ADDRESS = "10.0.0.1:8000"
NONE_MODE = 0  # ProcessingMode.BodySendMode.NONE
STREAMED = 1


def _answers(reply: pb.ProcessingResponse) -> tuple[int, int]:
    """(decisions, immediate responses) in one reply."""
    if reply.HasField("immediate_response"):
        return 0, 1
    kind = reply.WhichOneof("response")
    common = getattr(reply, kind).response if kind in ("request_headers", "request_body") else None
    if common is not None and any(
        o.header.key == DESTINATION_HEADER for o in common.header_mutation.set_headers
    ):
        return 1, 0
    return 0, 0


def _forwarded(replies: list[pb.ProcessingResponse]) -> list[pb.StreamedBodyResponse]:
    return [
        r.request_body.response.body_mutation.streamed_response
        for r in replies
        if r.HasField("request_body")
        and r.request_body.response.body_mutation.HasField("streamed_response")
    ]


class Driver:
    """Feeds a machine, resolves its routing asks, and collects every reply."""

    def __init__(self, stream: ExtProcStream, answer: str, replacement: bytes | None) -> None:
        self.stream = stream
        self.answer = answer  # "route" or "reject": what the router says
        self.replacement = replacement
        self.replies: list[pb.ProcessingResponse] = []
        self.route_bodies: list[bytes] = []
        self.finished = False

    def feed(self, message: pb.ProcessingRequest) -> None:
        step = self.stream.feed(message)
        self._take(step)

    def _take(self, step) -> None:
        self.replies += step.replies
        if step.finish:
            self.finished = True
        if step.route is not None:
            assert not step.replies and not step.finish
            self.route_bodies.append(step.route.body)
            if self.answer == "route":
                routed = FakeRouted("tok", "rid", _Decision([_Endpoint(ADDRESS)]), self.replacement)
                self._take(self.stream.routed(routed))
            else:
                self._take(self.stream.rejected(RequestRejected(429, "busy", reason="x")))

    def counts(self) -> tuple[int, int]:
        decisions = sum(_answers(r)[0] for r in self.replies)
        immediates = sum(_answers(r)[1] for r in self.replies)
        return decisions, immediates


@st.composite
def valid_streams(draw):
    """(mode, messages, body, chunk sizes) of a stream Envoy sends."""
    mode = draw(st.sampled_from([DUPLEX, BUFFERED]))
    body = draw(st.binary(max_size=3000) | st.builds(lambda n: b"x" * n, st.integers(0, 20_000)))
    headers_only = draw(st.integers(0, 9)) == 0
    length = draw(st.sampled_from(["none", "none", "right", "wrong", "huge"]))
    extra = []
    if length == "right":
        extra.append(("content-length", str(len(body))))
    elif length == "wrong":
        extra.append(("content-length", draw(st.sampled_from(["-1", "abc", "", "١٢", "0"]))))
    elif length == "huge":
        extra.append(("content-length", str(draw(st.integers(0, 10**30)))))
    trailers = draw(st.booleans())
    messages = [headers_msg(mode=mode, eos=headers_only, extra=extra)]
    if headers_only:
        return mode, messages, b"", True
    if mode == BUFFERED:
        # Envoy buffers the whole body into one message (with trailers: no end_of_stream).
        if body or not trailers:
            messages.append(body_msg(body, not trailers))
    else:
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=8)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        for i, piece in enumerate(pieces):
            messages.append(body_msg(piece, i == len(pieces) - 1 and not trailers))
    if trailers:
        messages.append(trailers_msg())
    return mode, messages, body, False


@st.composite
def streams_and_limits(draw):
    """A valid stream and a body limit, often within a few bytes of the body's size."""
    mode, messages, body, headers_only = draw(valid_streams())
    offset = draw(st.sampled_from([-1, 0, 1]) | st.integers(-25_000, 25_000))
    return (mode, messages, body, headers_only), max(0, len(body) + offset)


@settings(max_examples=examples(200))
@given(
    stream_and_limit=streams_and_limits(),
    chunk=st.integers(1, 5000),
    answer=st.sampled_from(["route", "reject"]),
    replacement=st.none() | st.binary(max_size=4000),
)
def test_a_valid_stream_ends_with_exactly_one_answer_and_forwards_only_its_body(
    stream_and_limit, chunk, answer, replacement
):
    stream, max_body = stream_and_limit
    mode, messages, body, headers_only = stream
    machine = ExtProcStream(max_body_bytes=max_body, chunk_bytes=chunk)
    driver = Driver(machine, answer, replacement)
    for message in messages:
        if driver.finished:
            break  # the server ends the stream: Envoy sends nothing more on it
        driver.feed(message)
    decisions, immediates = driver.counts()
    assert decisions + immediates == 1, (decisions, immediates, machine.phase)
    assert driver.finished and machine.phase in (Phase.ROUTED, Phase.DONE)
    assert len(driver.route_bodies) <= 1
    for routed_body in driver.route_bodies:
        assert routed_body == body and len(routed_body) <= max_body
    declared = [h.raw_value for h in messages[0].request_headers.headers.headers]
    declared = [v.decode() for v in declared if v.decode().isdigit()]
    # A body over the limit, or a Content-Length over it (refused before the body comes).
    too_large = not headers_only and (
        len(body) > max_body or any(int(v) > max_body for v in declared)
    )
    if too_large:
        (reply,) = [r for r in driver.replies if r.HasField("immediate_response")]
        assert reply.immediate_response.status.code == 413 and not driver.route_bodies
        return
    trailers = messages[-1].HasField("request_trailers")
    if mode == BUFFERED and trailers and not body:
        # No body message came before the trailers: the headers went on without a
        # destination, so the machine answers 400 (machine.py).
        (reply,) = [r for r in driver.replies if r.HasField("immediate_response")]
        assert reply.immediate_response.status.code == 400 and not driver.route_bodies
        return
    if answer == "reject":
        assert immediates == 1 and decisions == 0
        return
    assert decisions == 1
    pieces = _forwarded(driver.replies)
    if mode == DUPLEX and not headers_only:
        sent = replacement if replacement is not None else body
        assert b"".join(p.body for p in pieces) == sent  # never more than received
        assert all(len(p.body) <= chunk for p in pieces)
        ends = [p.end_of_stream for p in pieces]
        assert ends == [False] * (len(ends) - 1) + [not trailers]
    else:
        assert pieces == []  # BUFFERED: Envoy forwards its own buffered copy


def _any_message(draw) -> pb.ProcessingRequest:
    kind = draw(st.sampled_from(["headers", "body", "trailers", "response_headers", "resp_body"]))
    if kind == "headers":
        mode = draw(st.sampled_from([DUPLEX, BUFFERED, NONE_MODE, STREAMED, 7, None]))
        extra = [("content-length", draw(st.sampled_from(["5", "999999", "x"])))]
        return headers_msg(
            mode=mode, eos=draw(st.booleans()), extra=extra if draw(st.booleans()) else ()
        )
    if kind == "body":
        return body_msg(draw(st.binary(max_size=200)), draw(st.booleans()))
    if kind == "trailers":
        return trailers_msg()
    if kind == "response_headers":
        return response_headers_msg()
    return pb.ProcessingRequest(
        response_body=pb.HttpBody(
            body=draw(st.binary(max_size=50)), end_of_stream=draw(st.booleans())
        )
    )


@settings(max_examples=examples(300))
@given(
    data=st.data(),
    assumed_duplex=st.booleans(),
    max_body=st.integers(0, 600),
    answer=st.sampled_from(["route", "reject"]),
)
def test_any_sequence_raises_only_protocol_violation_and_never_answers_twice(
    data, assumed_duplex, max_body, answer
):
    machine = ExtProcStream(max_body_bytes=max_body, chunk_bytes=64, assumed_duplex=assumed_duplex)
    driver = Driver(machine, answer, None)
    received = 0
    for _ in range(data.draw(st.integers(1, 12))):
        message = _any_message(data.draw)
        if message.HasField("request_body"):
            received += len(message.request_body.body)
        try:
            driver.feed(message)
        except ProtocolViolation:
            break  # the server ends the stream with an error status
        decisions, immediates = driver.counts()
        assert decisions + immediates <= 1
        assert sum(len(p.body) for p in _forwarded(driver.replies)) <= received
        assert all(len(b) <= max_body for b in driver.route_bodies)
        if driver.finished:
            break
