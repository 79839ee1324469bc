"""Builders for the ext_proc protobuf replies, and readers for what Envoy sends."""

from __future__ import annotations

import math
from collections.abc import Iterable

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
# Set on the routed request for the report of its end (the access log logs it, the
# observer filter reads it): it names the decision to complete.
ROUTE_TOKEN_HEADER = "x-epp-route-token"
REJECT_REASON_HEADER = "x-request-dropped-reason"
REQUEST_ID_RESPONSE_HEADER = "x-epp-request-id"

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def header_values(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's header map as a dict (lower-case names; Envoy 1.40 fills raw_value)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _set(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
    )


def subset_hint(request: pb.ProcessingRequest) -> frozenset[str] | None:
    """The proxy's allowed endpoints, if it sent any: a list of ip:port, or a comma string."""
    if not request.HasField("metadata_context"):
        return None
    hint = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    value = hint.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items: Iterable[str] = (v.string_value for v in value.list_value.values)
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        return frozenset()
    return frozenset(item.strip() for item in items if item.strip())


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    if not request.HasField("metadata_context"):
        return None
    lb = request.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if lb is None or SERVED_KEY not in lb.fields:
        return None
    return lb.fields[SERVED_KEY].string_value or None


def destination_metadata(destination: str) -> Struct:
    metadata = Struct()
    _fill_destination(metadata, destination)
    return metadata


# The routing replies are built by filling the message in place (field paths and
# `add()`), never from nested constructors: a constructor copies each nested message
# into its parent (a body chunk once per level), about 3x the CPU for the same bytes.
def _fill_destination(metadata: Struct, destination: str) -> None:
    lb = metadata.fields[DESTINATION_NAMESPACE].struct_value
    lb.fields[DESTINATION_HEADER].string_value = destination


def _add_set(mutation: pb.HeaderMutation, name: str, value: str) -> None:
    option = mutation.set_headers.add()
    option.header.key = name
    option.header.raw_value = value.encode()
    option.append_action = _OVERWRITE


def _fill_routing(
    common: pb.CommonResponse, destination: str, token: str | None, body_length: int | None
) -> None:
    """The destination header (and token); `body_length` when the EPP replaces the body,
    so that content-length matches what the pod receives."""
    mutation = common.header_mutation
    _add_set(mutation, DESTINATION_HEADER, destination)
    if token:
        _add_set(mutation, ROUTE_TOKEN_HEADER, token)
    if body_length is not None:
        _add_set(mutation, "content-length", str(body_length))
    common.clear_route_cache = True


def route_on_headers(
    destination: str, token: str | None = None, body_length: int | None = None
) -> pb.ProcessingResponse:
    """Full-duplex mode: the held headers go on with the destination; the body follows
    as streamed chunks (the client's, or a replacement of `body_length` bytes)."""
    reply = pb.ProcessingResponse()
    _fill_routing(reply.request_headers.response, destination, token, body_length)
    _fill_destination(reply.dynamic_metadata, destination)
    return reply


def route_on_body(
    destination: str, token: str | None = None, body: bytes | None = None
) -> pb.ProcessingResponse:
    """Buffered mode: the destination, and the body replaced when `body` is given."""
    reply = pb.ProcessingResponse()
    common = reply.request_body.response
    _fill_routing(common, destination, token, None if body is None else len(body))
    if body is not None:
        common.body_mutation.body = body
    _fill_destination(reply.dynamic_metadata, destination)
    return reply


def continue_request_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def _fill_streamed(body: pb.BodyResponse, chunk: bytes, end_of_stream: bool) -> None:
    streamed = body.response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream


def streamed_request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse()
    _fill_streamed(reply.request_body, chunk, end_of_stream)
    return reply


def request_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def response_headers(request_id: str | None) -> pb.ProcessingResponse:
    if not request_id:
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    mutation = pb.HeaderMutation(set_headers=[_set(REQUEST_ID_RESPONSE_HEADER, request_id)])
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
    )


def streamed_response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse()
    _fill_streamed(reply.response_body, chunk, end_of_stream)
    return reply


def continue_response_body() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_body=pb.BodyResponse())


def response_trailers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def retry_after_value(seconds: float) -> str:
    """HTTP retry-after is whole seconds; never 0, which would invite an instant retry."""
    return str(max(1, math.ceil(seconds)))


def immediate(
    status: int,
    body: bytes,
    reason: str,
    request_id: str | None,
    retry_after_s: float | None = None,
) -> pb.ProcessingResponse:
    headers = [_set("content-type", "application/json"), _set(REJECT_REASON_HEADER, reason)]
    if request_id:
        headers.append(_set(REQUEST_ID_RESPONSE_HEADER, request_id))
    if retry_after_s is not None:
        headers.append(_set("retry-after", retry_after_value(retry_after_s)))
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=body,
            details=reason,
        )
    )


# The observer filter's response_attributes (epp/envoy_config/filters.py), as Envoy 1.40 names them in
# ProcessingRequest.attributes["envoy.filters.http.ext_proc"]: one key per expression.
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"
TOKEN_ATTRIBUTE = f"request.headers['{ROUTE_TOKEN_HEADER}']"


def attribute(request: pb.ProcessingRequest, name: str) -> str | None:
    """One attribute Envoy evaluated for this message, as a string; None when absent."""
    attributes = request.attributes.get(ATTRIBUTES_NAMESPACE)
    if attributes is None or name not in attributes.fields:
        return None
    value = attributes.fields[name]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value or None
    if kind == "number_value":
        return str(int(value.number_value))
    return None


def extend_message_timeout(seconds: float) -> pb.ProcessingResponse:
    """Re-arm Envoy's message timer while the EPP is still working on the request (needs
    `max_message_timeout` >= seconds in the filter config; otherwise Envoy ignores it)."""
    whole = int(seconds)
    return pb.ProcessingResponse(
        override_message_timeout=Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )
