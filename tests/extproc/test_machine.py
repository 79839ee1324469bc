"""The ext_proc stream machine fed with plain message lists (no gRPC, no Envoy)."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct
from helpers import router_with

from epp.extproc.machine import ExtProcStream, ProtocolViolation

DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
BUFFERED = ProcessingMode.BodySendMode.BUFFERED
PODS = [
    {"name": "a", "address": "127.0.0.1:8001"},
    {"name": "b", "address": "127.0.0.1:8002"},
    {"name": "c", "address": "127.0.0.1:8003"},
]


def headers_msg(path="/v1/completions", eos=False, mode=None, extra=(), subset=None):
    values = [(":path", path), (":method", "POST"), ("x-request-id", "rid-1"), *extra]
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=HeaderMap(
                headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values]
            ),
            end_of_stream=eos,
        )
    )
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        msg.protocol_config.response_body_mode = (
            mode if mode == DUPLEX else ProcessingMode.BodySendMode.STREAMED
        )
    if subset is not None:
        hint = Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.CopyFrom(Metadata(filter_metadata={"envoy.lb.subset_hint": hint}))
    return msg


def body_msg(data: bytes, eos: bool):
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def body_of(prompt: str = "hello " * 200) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3}).encode()


def destination(reply: pb.ProcessingResponse) -> str:
    common = (
        reply.request_headers.response
        if reply.HasField("request_headers")
        else reply.request_body.response
    )
    (option,) = common.header_mutation.set_headers
    assert option.header.key == "x-gateway-destination-endpoint"
    assert option.append_action == option.OVERWRITE_IF_EXISTS_OR_ADD
    assert common.clear_route_cache
    value = option.header.raw_value.decode()
    meta = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == value  # never differ
    return value


def stream(router, duplex=True, **kw) -> ExtProcStream:
    return ExtProcStream(
        router,
        max_body_bytes=kw.get("max_body", 1 << 20),
        chunk_bytes=kw.get("chunk", 1024),
        assumed_duplex=duplex,
    )


def test_duplex_holds_headers_until_body_complete_then_streams_body_back():
    router, store, *_ = router_with(PODS)
    s = stream(router, chunk=1024)
    body = body_of("x" * 5000)
    assert s.feed(headers_msg(mode=DUPLEX)) == []
    assert s.feed(body_msg(body[:3000], False)) == []
    replies = s.feed(body_msg(body[3000:], True))
    assert replies[0].HasField("request_headers")
    dest = destination(replies[0]).split(",")
    assert len(dest) == 3 and set(dest) == {p["address"] for p in PODS}
    chunks = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(c.body for c in chunks) == body
    assert all(len(c.body) <= 1024 for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(e.in_flight for e in store.all()) == 1


def test_duplex_body_ending_with_trailers():
    router, *_ = router_with(PODS)
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX))
    assert s.feed(body_msg(body_of(), False)) == []
    replies = s.feed(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert replies[0].HasField("request_headers") and replies[-1].HasField("request_trailers")
    assert not any(
        r.request_body.response.body_mutation.streamed_response.end_of_stream for r in replies[1:-1]
    )


def test_buffered_answers_headers_at_once_and_routes_on_body():
    router, *_ = router_with(PODS)
    s = stream(router, duplex=True)  # protocol_config overrides the assumption
    (first,) = s.feed(headers_msg(mode=BUFFERED))
    assert first.HasField("request_headers") and not first.request_headers.response.HasField(
        "header_mutation"
    )
    (reply,) = s.feed(body_msg(body_of(), True))
    assert reply.HasField("request_body")
    assert destination(reply)


def test_headers_only_request_routes_on_headers():
    router, *_ = router_with(PODS)
    (reply,) = stream(router).feed(headers_msg(path="/v1/models", eos=True, mode=DUPLEX))
    assert destination(reply)


def test_forged_destination_header_is_overwritten():
    router, *_ = router_with(PODS)
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX, extra=[("x-gateway-destination-endpoint", "6.6.6.6:666")]))
    replies = s.feed(body_msg(body_of(), True))
    assert "6.6.6.6" not in destination(replies[0])


def test_same_prompt_sticks_to_one_pod():
    router, *_ = router_with(PODS)
    chosen = set()
    for _ in range(5):
        s = stream(router)
        s.feed(headers_msg(mode=DUPLEX))
        chosen.add(
            destination(s.feed(body_msg(body_of("shared system prompt " * 50), True))[0]).split(
                ","
            )[0]
        )
        s.close()
    assert len(chosen) == 1


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b"{oops", 400, "invalid-json"),
        (json.dumps({"prompt": "x"}).encode(), 400, "invalid-request"),
        (json.dumps({"model": "m"}).encode(), 400, "invalid-request"),
    ],
)
def test_bad_bodies_get_immediate_openai_errors(body, status, reason):
    router, store, *_ = router_with(PODS)
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX))
    (reply,) = s.feed(body_msg(body, True))
    immediate = reply.immediate_response
    assert immediate.status.code == status
    error = json.loads(immediate.body)["error"]
    assert error["code"] == status and error["message"]
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert headers["x-request-dropped-reason"] == reason
    assert headers["content-type"] == "application/json"
    assert sum(e.in_flight for e in store.all()) == 0


def test_no_endpoints_is_503():
    router, *_ = router_with([])
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX))
    (reply,) = s.feed(body_msg(body_of(), True))
    assert reply.immediate_response.status.code == 503


def test_body_over_limit_is_413_without_buffering_more():
    router, *_ = router_with(PODS)
    s = stream(router, max_body=2048)
    s.feed(headers_msg(mode=DUPLEX))
    (reply,) = s.feed(body_msg(b"x" * 4096, False))
    assert reply.immediate_response.status.code == 413


@pytest.mark.parametrize("subset", [["127.0.0.1:8002"], "127.0.0.1:8002, 127.0.0.1:9999"])
def test_subset_hint_as_list_or_comma_string(subset):
    router, *_ = router_with(PODS)
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX, subset=subset))
    assert destination(s.feed(body_msg(body_of(), True))[0]) == "127.0.0.1:8002"


def test_empty_subset_is_503():
    router, *_ = router_with(PODS)
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX, subset=[]))
    assert s.feed(body_msg(body_of(), True))[0].immediate_response.status.code == 503


def test_response_path_echoes_stream_and_releases_in_flight_once():
    router, _store, *_ = router_with(PODS)
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX))
    s.feed(body_msg(body_of(), True))
    pod = s.routed.endpoint
    assert pod.in_flight == 1
    resp_headers = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"200")])
        )
    )
    (reply,) = s.feed(resp_headers)
    (option,) = reply.response_headers.response.header_mutation.set_headers
    assert (option.header.key, option.header.raw_value) == ("x-epp-request-id", b"rid-1")
    (echo,) = s.feed(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n")))
    assert echo.response_body.response.body_mutation.streamed_response.body == b"data: 1\n\n"
    assert pod.in_flight == 1
    s.feed(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    assert pod.in_flight == 0
    s.close()  # the gRPC stream ending afterwards must not release twice
    assert pod.in_flight == 0


def test_abandoned_stream_releases_in_flight():
    router, *_ = router_with(PODS)
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX))
    s.feed(body_msg(body_of(), True))
    pod = s.routed.endpoint
    s.close()
    assert pod.in_flight == 0


def test_out_of_order_messages_are_protocol_violations():
    router, *_ = router_with(PODS)
    with pytest.raises(ProtocolViolation):
        stream(router).feed(body_msg(b"{}", True))
    s = stream(router)
    s.feed(headers_msg(mode=DUPLEX))
    with pytest.raises(ProtocolViolation):
        s.feed(headers_msg(mode=DUPLEX))


def test_random_message_sequences_never_crash_or_leak_in_flight():
    import random

    rng = random.Random(11)
    router, store, *_ = router_with(PODS)
    bodies = [
        body_of(),
        b"{bad",
        b"",
        json.dumps({"model": "m", "messages": [{"role": "u", "content": "x"}]}).encode(),
    ]
    makers = [
        lambda: headers_msg(mode=rng.choice([DUPLEX, BUFFERED, None]), eos=rng.random() < 0.2),
        lambda: body_msg(rng.choice(bodies), rng.random() < 0.7),
        lambda: pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
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
        s = stream(router, duplex=rng.random() < 0.5)
        for _ in range(rng.randrange(1, 7)):
            try:
                replies = s.feed(rng.choice(makers)())
            except ProtocolViolation:
                break
            assert all(isinstance(r, pb.ProcessingResponse) for r in replies)
        s.close()
        assert all(e.in_flight >= 0 for e in store.all())
    assert sum(e.in_flight for e in store.all()) == 0
