"""The routing ext_proc stream machine fed with plain message lists (no gRPC, no Envoy).

The machine never calls the router: it asks for a decision (`step.route`) and is handed
the outcome, so routing may wait (admission) without the machine doing I/O."""

from __future__ import annotations

import json
import random
import uuid

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
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
    header_map,
    headers_msg,
    set_headers,
    trailers_msg,
)

from epp.extproc.machine import ExtProcStream, Phase, ProtocolViolation
from epp.request import RequestRejected


def stream(duplex=True, **kw) -> ExtProcStream:
    return ExtProcStream(
        max_body_bytes=kw.get("max_body", 1 << 20),
        chunk_bytes=kw.get("chunk", 1024),
        assumed_duplex=duplex,
    )


def routed(token="tok-1", addresses=ADDRESSES) -> FakeRouted:
    return FakeRouted(token, "rid-1", _Decision([_Endpoint(a) for a in addresses]))


def test_duplex_asks_for_a_route_when_the_body_is_complete_then_streams_body_back():
    s = stream(chunk=1024)
    body = body_of("x" * 5000)
    first = s.feed(headers_msg(mode=DUPLEX, extra=[("x-priority", "-1")]))
    assert first.replies == [] and first.route is None and not first.finish
    assert s.feed(body_msg(body[:3000], False)).route is None
    step = s.feed(body_msg(body[3000:], True))
    assert step.replies == [] and s.phase is Phase.ROUTING
    call = step.route
    assert (call.path, call.body, call.request_id) == ("/v1/completions", body, "rid-1")
    assert call.headers["x-priority"] == "-1"  # the router reads priority headers
    done = s.routed(routed())
    assert done.finish and done.route is None
    replies = done.replies
    assert replies[0].HasField("request_headers")
    assert destination(replies[0]) == ",".join(ADDRESSES)
    assert set_headers(replies[0].request_headers.response)["x-epp-route-token"] == "tok-1"
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(c.body for c in chunks) == body
    assert all(len(c.body) <= 1024 for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_duplex_body_ending_with_trailers():
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    assert s.feed(body_msg(body_of(), False)).route is None
    step = s.feed(trailers_msg())
    assert step.route is not None and step.route.body == body_of()
    replies = s.routed(routed()).replies
    assert replies[0].HasField("request_headers") and replies[-1].HasField("request_trailers")
    assert not any(
        r.request_body.response.body_mutation.streamed_response.end_of_stream for r in replies[1:-1]
    )


def test_buffered_answers_headers_at_once_and_routes_on_body():
    s = stream(duplex=True)  # protocol_config overrides the assumption
    (first,) = s.feed(headers_msg(mode=BUFFERED)).replies
    assert first.HasField("request_headers")
    assert not first.request_headers.response.HasField("header_mutation")
    step = s.feed(body_msg(body_of(), True))
    assert step.replies == [] and step.route is not None
    done = s.routed(routed(addresses=ADDRESSES[:1]))
    (reply,) = done.replies
    assert done.finish and reply.HasField("request_body")
    assert destination(reply) == ADDRESSES[0]
    assert set_headers(reply.request_body.response)["x-epp-route-token"] == "tok-1"


def test_a_replaced_body_is_streamed_in_duplex_mode_with_its_own_content_length():
    s = stream(chunk=1024)
    s.feed(headers_msg(mode=DUPLEX))
    s.feed(body_msg(body_of("x" * 3000), True))
    replacement = body_of("y" * 2500)
    replies = s.routed(
        FakeRouted("tok-1", "rid-1", _Decision([_Endpoint(ADDRESSES[0])]), replacement)
    ).replies
    assert set_headers(replies[0].request_headers.response)["content-length"] == str(
        len(replacement)
    )
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(c.body for c in chunks) == replacement
    assert chunks[-1].end_of_stream


def test_a_replaced_body_is_the_body_mutation_in_buffered_mode():
    s = stream()
    s.feed(headers_msg(mode=BUFFERED))
    s.feed(body_msg(body_of(), True))
    replacement = b'{"model": "other", "prompt": "hi"}'
    (reply,) = s.routed(
        FakeRouted("tok-1", "rid-1", _Decision([_Endpoint(ADDRESSES[0])]), replacement)
    ).replies
    common = reply.request_body.response
    assert common.body_mutation.body == replacement
    assert set_headers(common)["content-length"] == str(len(replacement))
    assert destination(reply) == ADDRESSES[0]


def test_without_a_replacement_no_content_length_is_set():
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    s.feed(body_msg(body_of(), True))
    reply = s.routed(routed()).replies[0]
    assert "content-length" not in set_headers(reply.request_headers.response)


def test_headers_only_request_routes_on_headers_and_finishes():
    s = stream()
    step = s.feed(headers_msg(path="/v1/models", eos=True, mode=DUPLEX))
    assert step.route is not None and step.route.body == b""
    done = s.routed(routed())
    (reply,) = done.replies
    assert done.finish and destination(reply) and reply.HasField("request_headers")


def test_forged_destination_and_token_headers_are_overwritten():
    s = stream()
    forged = [("x-gateway-destination-endpoint", "6.6.6.6:666"), ("x-epp-route-token", "mine")]
    s.feed(headers_msg(mode=DUPLEX, extra=forged))
    s.feed(body_msg(body_of(), True))
    reply = s.routed(routed()).replies[0]
    headers = set_headers(reply.request_headers.response)
    assert "6.6.6.6" not in destination(reply) and headers["x-epp-route-token"] == "tok-1"


@pytest.mark.parametrize(
    ("rejection", "retry_after"),
    [
        (RequestRejected(400, "bad", reason="invalid-json"), None),
        (RequestRejected(503, "none", reason="rejected-no-endpoints"), None),
    ],
)
def test_rejections_become_immediate_openai_errors(rejection, retry_after):
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    s.feed(body_msg(body_of(), True))
    done = s.rejected(rejection)
    (reply,) = done.replies
    assert done.finish and s.token is None
    immediate = reply.immediate_response
    assert immediate.status.code == rejection.status
    error = json.loads(immediate.body)["error"]
    assert error["code"] == rejection.status and error["message"]
    headers = set_headers(immediate)
    assert headers["x-request-dropped-reason"] == rejection.reason
    assert headers["content-type"] == "application/json"
    assert "retry-after" not in headers


@pytest.mark.parametrize(("seconds", "header"), [(0.2, "1"), (1.0, "1"), (2.5, "3"), (0.0, "1")])
def test_rejection_with_retry_after_carries_whole_seconds_at_least_one(seconds, header):
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    s.feed(body_msg(body_of(), True))
    rejection = RequestRejected(429, "queue full", reason="rejected-saturated")
    rejection.retry_after_s = seconds  # the attribute the Router sets on admission rejects
    (reply,) = s.rejected(rejection).replies
    assert set_headers(reply.immediate_response)["retry-after"] == header


def test_body_over_limit_is_413_without_buffering_more():
    s = stream(max_body=2048)
    s.feed(headers_msg(mode=DUPLEX))
    step = s.feed(body_msg(b"x" * 4096, False))
    assert step.finish and step.route is None
    assert step.replies[0].immediate_response.status.code == 413


@pytest.mark.parametrize("subset", [["127.0.0.1:8002"], "127.0.0.1:8002, 127.0.0.1:9999"])
def test_subset_hint_as_list_or_comma_string_reaches_the_router(subset):
    s = stream()
    s.feed(headers_msg(mode=DUPLEX, subset=subset))
    call = s.feed(body_msg(body_of(), True)).route
    assert "127.0.0.1:8002" in call.subset and "" not in call.subset


@pytest.mark.parametrize(
    "mode",
    [
        ProcessingMode.BodySendMode.NONE,
        ProcessingMode.BodySendMode.STREAMED,
        ProcessingMode.BodySendMode.BUFFERED_PARTIAL,
        57,  # a mode this build does not know
    ],
)
@pytest.mark.parametrize("eos", [False, True])
def test_unsupported_body_modes_get_a_defined_500(mode, eos):
    s = stream()
    step = s.feed(headers_msg(mode=mode, eos=eos))
    assert step.finish and step.route is None and step.problem
    (reply,) = step.replies
    immediate = reply.immediate_response
    assert immediate.status.code == 500
    assert set_headers(immediate)["x-request-dropped-reason"] == "unsupported-body-mode"
    message = json.loads(immediate.body)["error"]["message"]
    assert "FULL_DUPLEX_STREAMED" in message and "BUFFERED" in message
    assert step.problem in message


def test_routing_results_out_of_phase_are_protocol_violations():
    with pytest.raises(ProtocolViolation):
        stream().routed(routed())
    with pytest.raises(ProtocolViolation):
        stream().feed(body_msg(b"{}", True))
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    with pytest.raises(ProtocolViolation):
        s.feed(headers_msg(mode=DUPLEX))


def test_random_message_sequences_never_crash():
    rng = random.Random(11)
    bodies = [body_of(), b"{bad", b""]
    makers = [
        lambda: headers_msg(
            mode=rng.choice([DUPLEX, BUFFERED, None, ProcessingMode.BodySendMode.STREAMED]),
            eos=rng.random() < 0.2,
        ),
        lambda: body_msg(rng.choice(bodies), rng.random() < 0.7),
        lambda: trailers_msg(),
        lambda: pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(end_of_stream=rng.random() < 0.3)
        ),
        lambda: pb.ProcessingRequest(
            response_body=pb.HttpBody(body=b"x", end_of_stream=rng.random() < 0.5)
        ),
        lambda: pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
        lambda: pb.ProcessingRequest(),
    ]
    for _ in range(1500):
        s = stream(duplex=rng.random() < 0.5)
        for _ in range(rng.randrange(1, 7)):
            try:
                step = s.feed(rng.choice(makers)())
            except ProtocolViolation:
                break
            assert all(isinstance(r, pb.ProcessingResponse) for r in step.replies)
            if step.route is not None:
                step = (
                    s.routed(routed())
                    if rng.random() < 0.5
                    else s.rejected(RequestRejected(503, "x", reason="r"))
                )
            if step.finish:
                break


def bare_headers_msg(values, eos=False, mode=DUPLEX):
    """Request headers with exactly `values` (headers_msg always adds :path and an id)."""
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(values), end_of_stream=eos)
    )
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
    return msg


def test_without_protocol_config_the_assumed_body_mode_applies():
    """Envoy before 1.35 sends no protocol_config: the configured assumption decides, and
    by default the machine assumes FULL_DUPLEX_STREAMED (what the generated configs use)."""
    default = ExtProcStream(max_body_bytes=1 << 20, chunk_bytes=1024)
    step = default.feed(headers_msg())
    assert step.replies == [] and step.route is None and default.phase is Phase.BODY
    response = default.feed(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"out", end_of_stream=True))
    )
    (reply,) = response.replies
    streamed = reply.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"out", True)

    buffered = stream(duplex=False)
    (first,) = buffered.feed(headers_msg()).replies
    assert first.HasField("request_headers") and buffered.phase is Phase.BODY
    (reply,) = buffered.feed(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"out", end_of_stream=True))
    ).replies
    assert reply.HasField("response_body") and not reply.response_body.HasField("response")


@pytest.mark.parametrize("streamed", [True, False])
def test_response_messages_of_a_hand_written_config_get_neutral_answers(streamed):
    """The response body is echoed in the mode protocol_config announces for it; the
    response headers carry the request id."""
    s = stream(duplex=not streamed)  # protocol_config overrides the assumption
    message = headers_msg(mode=DUPLEX)
    if streamed:
        message.protocol_config.response_body_mode = DUPLEX
    s.feed(message)
    s.feed(body_msg(body_of(), True))
    s.routed(routed())
    (headers,) = s.feed(pb.ProcessingRequest(response_headers=pb.HttpHeaders())).replies
    assert set_headers(headers.response_headers.response) == {"x-epp-request-id": "rid-1"}
    for eos in (False, True):
        chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"tokens", end_of_stream=eos))
        (reply,) = s.feed(chunk).replies
        assert reply.HasField("response_body")
        if streamed:
            echoed = reply.response_body.response.body_mutation.streamed_response
            assert (echoed.body, echoed.end_of_stream) == (b"tokens", eos)
        else:
            assert not reply.response_body.HasField("response")  # continue unchanged
    (trailers,) = s.feed(pb.ProcessingRequest(response_trailers=pb.HttpTrailers())).replies
    assert trailers.HasField("response_trailers")


def test_a_request_without_an_id_gets_a_generated_one():
    s = ExtProcStream(max_body_bytes=1024, chunk_bytes=64, new_request_id=lambda: "gen-1")
    assert s.request_id is None  # nothing to log before the headers
    call = s.feed(bare_headers_msg([(":path", "/v1/models")], eos=True)).route
    assert call.request_id == "gen-1" == s.request_id
    default = ExtProcStream(max_body_bytes=1024, chunk_bytes=64)
    call = default.feed(bare_headers_msg([(":path", "/v1/models")], eos=True)).route
    assert uuid.UUID(call.request_id).version == 4


def test_a_request_without_a_path_is_routed_as_the_root():
    s = stream()
    call = s.feed(bare_headers_msg([("x-request-id", "rid-1")], eos=True)).route
    assert call.path == "/" and call.body == b"" and call.headers == {"x-request-id": "rid-1"}


@pytest.mark.parametrize("mode", [DUPLEX, BUFFERED])
def test_a_body_less_request_is_routed_on_headers_and_never_rewritten(mode):
    """A replacement body (a model table's target) has nothing to replace on a request
    without a body: one headers reply, no content-length, no body."""
    s = stream()
    step = s.feed(headers_msg(path="/v1/models", eos=True, mode=mode))
    assert step.replies == [] and step.route.body == b""
    replacement = b'{"model": "other"}'
    done = s.routed(FakeRouted("tok-1", "rid-1", _Decision([_Endpoint(ADDRESSES[0])]), replacement))
    (reply,) = done.replies
    assert done.finish and reply.HasField("request_headers")
    assert set_headers(reply.request_headers.response) == {
        "x-gateway-destination-endpoint": ADDRESSES[0],
        "x-epp-route-token": "tok-1",
    }


def test_an_empty_duplex_body_is_re_emitted_as_one_empty_last_chunk():
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    assert s.feed(body_msg(b"", True)).route.body == b""
    replies = s.routed(routed()).replies
    assert replies[0].HasField("request_headers") and len(replies) == 2
    chunk = replies[1].request_body.response.body_mutation.streamed_response
    assert (chunk.body, chunk.end_of_stream) == (b"", True)


def test_a_rejection_is_the_steps_answer_and_carries_the_request_id():
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    s.feed(body_msg(body_of(), True))
    rejection = RequestRejected(503, "no pods", reason="rejected-no-endpoints")
    done = s.rejected(rejection)
    assert done.answer is rejection and s.phase is Phase.DONE
    (reply,) = done.replies
    assert set_headers(reply.immediate_response)["x-epp-request-id"] == "rid-1"


def test_the_unsupported_mode_answer_names_the_setting_and_keeps_the_request_id():
    s = ExtProcStream(max_body_bytes=1024, chunk_bytes=64, new_request_id=lambda: "gen-1")
    step = s.feed(headers_msg(mode=ProcessingMode.BodySendMode.NONE))
    (reply,) = step.replies
    immediate = reply.immediate_response
    assert json.loads(immediate.body)["error"]["message"] == (
        "the gateway sends the request body to the endpoint picker in mode NONE; the "
        "endpoint picker supports only FULL_DUPLEX_STREAMED and BUFFERED "
        "(ext_proc processing_mode.request_body_mode)"
    )
    assert set_headers(immediate)["x-epp-request-id"] == "rid-1" == s.request_id
    assert step.problem == "NONE"
    assert (step.answer.status, step.answer.reason) == (500, "unsupported-body-mode")
    unknown = ExtProcStream(max_body_bytes=1024, chunk_bytes=64, new_request_id=lambda: "gen-1")
    step = unknown.feed(bare_headers_msg([(":path", "/")], mode=57))
    assert step.problem == "unknown (57)" and unknown.request_id == "gen-1"
    assert set_headers(step.replies[0].immediate_response)["x-epp-request-id"] == "gen-1"


def test_protocol_violations_say_what_arrived_out_of_phase():
    """The server logs the violation (stream_failed) with this text."""
    with pytest.raises(ProtocolViolation, match=r"^routing result in phase start$"):
        stream().routed(routed())
    with pytest.raises(ProtocolViolation, match=r"^routing result in phase start$"):
        stream().rejected(RequestRejected(503, "x", reason="r"))
    with pytest.raises(ProtocolViolation, match=r"^request_body in phase start$"):
        stream().feed(body_msg(b"{}", True))
    with pytest.raises(ProtocolViolation, match=r"^unexpected ext_proc message None$"):
        stream().feed(pb.ProcessingRequest())
    s = stream()
    s.feed(headers_msg(mode=DUPLEX))
    with pytest.raises(ProtocolViolation, match=r"^request_headers twice$"):
        s.feed(headers_msg(mode=DUPLEX))
