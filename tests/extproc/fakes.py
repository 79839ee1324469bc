"""Builders for ext_proc messages and a scripted router (the Router interface, no scheduling)."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from epp.request import IncomingRequest, RequestRejected

DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
BUFFERED = ProcessingMode.BodySendMode.BUFFERED
ADDRESSES = ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]


def header_map(values) -> HeaderMap:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values])


def headers_msg(path="/v1/completions", eos=False, mode=None, extra=(), subset=None):
    values = [(":path", path), (":method", "POST"), ("x-request-id", "rid-1"), *extra]
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(values), end_of_stream=eos)
    )
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        msg.protocol_config.response_body_mode = ProcessingMode.BodySendMode.NONE
    if subset is not None:
        hint = Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.CopyFrom(Metadata(filter_metadata={"envoy.lb.subset_hint": hint}))
    return msg


def body_msg(data: bytes, eos: bool):
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def trailers_msg():
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers())


def body_of(prompt: str = "hello " * 200) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 3}).encode()


def response_headers_msg(status="200", eos=False, attributes=None, observability=False):
    msg = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=header_map([(":status", status)]), end_of_stream=eos
        ),
        observability_mode=observability,
    )
    if attributes:
        attrs = Struct()
        attrs.update(attributes)
        msg.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    return msg


def set_headers(common) -> dict[str, str]:
    """The headers a CommonResponse (header_mutation) or ImmediateResponse (headers) sets."""
    mutation = (
        common.headers if isinstance(common, pb.ImmediateResponse) else common.header_mutation
    )
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


def destination(reply: pb.ProcessingResponse) -> str:
    common = (
        reply.request_headers.response
        if reply.HasField("request_headers")
        else reply.request_body.response
    )
    for option in common.header_mutation.set_headers:
        assert option.append_action == option.OVERWRITE_IF_EXISTS_OR_ADD
    assert common.clear_route_cache
    value = set_headers(common)["x-gateway-destination-endpoint"]
    meta = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == value  # never differ
    return value


@dataclass
class _Endpoint:
    address: str


@dataclass
class _Decision:
    endpoints: list[_Endpoint]


@dataclass
class FakeRouted:
    token: str
    request_id: str
    decision: _Decision
    body: bytes | None = None  # a replacement body (a model table's target model)


@dataclass
class FakeRouter:
    """Answers with `addresses` (or raises `reject`, or `error` as a bug would); records
    calls and completions."""

    addresses: list[str] = field(default_factory=lambda: ADDRESSES[:1])
    reject: RequestRejected | None = None
    error: Exception | None = None
    gate: asyncio.Event | None = None  # route waits on it (an admission queue)
    calls: list[dict] = field(default_factory=list)
    completed: list[tuple[str, int | None, str | None]] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=itertools.count)

    async def route(self, request: IncomingRequest) -> FakeRouted:
        self.calls.append(
            {
                "path": request.path,
                "body": request.body,
                "request_id": request.request_id,
                "subset": request.subset,
                "headers": request.headers,
            }
        )
        if self.gate is not None:
            await self.gate.wait()
        if self.reject is not None:
            raise self.reject
        if self.error is not None:
            raise self.error
        token = f"token-{next(self._ids)}"
        return FakeRouted(
            token, request.request_id, _Decision([_Endpoint(a) for a in self.addresses])
        )

    def complete(
        self,
        token: str,
        status: int | None,
        served_address: str | None = None,
        first_byte_at: float | None = None,
        response_bytes: int | None = None,
    ) -> None:
        self.completed.append((token, status, served_address))
