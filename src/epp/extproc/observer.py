"""One observer ext_proc stream: the second, fail-open filter that reports response ends.

The routing stream ends as soon as the destination is sent (machine.py), so the EPP learns
how a request ended from a separate filter placed after the routing one, in observability
mode (Envoy never waits for it) with `failure_mode_allow` (its loss never fails a
request). It sees the request headers (carrying `x-epp-route-token`, set by the routing
reply), then the response headers with the status and, as an attribute, the upstream
address that served (a fallback when Envoy retried).

Measured on Envoy 1.40: with response body NONE and no upstream trailers, no trailers
message ever comes, so the end of the stream (Envoy closes its side when the request is
done, response finished, client gone or reset) is the response end. A response_trailers
message or a headers-only response ends it earlier. Sans-I/O like machine.py: `feed`
and `end` return the completion to report, at most once per stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.extproc import messages

# Message kind -> the empty answer that lets it through unchanged.
_NEUTRAL = {
    "request_headers": pb.HeadersResponse,
    "response_headers": pb.HeadersResponse,
    "request_body": pb.BodyResponse,
    "response_body": pb.BodyResponse,
    "request_trailers": pb.TrailersResponse,
    "response_trailers": pb.TrailersResponse,
}


@dataclass(frozen=True, slots=True)
class Completion:
    token: str
    status: int | None  # None: the stream ended without response headers
    served_address: str | None
    # time.perf_counter() at the response headers, and their content-length (metrics).
    first_byte_at: float | None = None
    response_bytes: int | None = None


class ObserverStream:
    def __init__(self) -> None:
        self.token: str | None = None
        self._status: int | None = None
        self._served: str | None = None
        self._first_byte_at: float | None = None
        self._response_bytes: int | None = None
        self._reported = False

    def feed(self, message: pb.ProcessingRequest) -> Completion | None:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            headers = messages.header_values(message.request_headers)
            self.token = headers.get(messages.ROUTE_TOKEN_HEADER) or self.token
        elif kind == "response_headers":
            self.token = self.token or messages.attribute(message, messages.TOKEN_ATTRIBUTE)
            self._first_byte_at = time.perf_counter()
            headers = messages.header_values(message.response_headers)
            status = headers.get(":status", "")
            self._status = int(status) if status.isdigit() else None
            length = headers.get("content-length", "")
            self._response_bytes = int(length) if length.isdigit() else None
            self._served = (
                messages.attribute(message, messages.UPSTREAM_ADDRESS_ATTRIBUTE)
                or messages.served_endpoint(message)
                or self._served
            )
            if message.response_headers.end_of_stream:
                return self.end()
        elif kind == "response_trailers" or (
            kind == "response_body" and message.response_body.end_of_stream
        ):
            return self.end()
        return None

    @staticmethod
    def reply(message: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        """In observability mode Envoy expects no answer; otherwise a neutral one (an empty
        answer of the message's own kind: continue unchanged)."""
        if message.observability_mode:
            return None
        kind = message.WhichOneof("request")
        answer = _NEUTRAL.get(kind) if kind is not None else None
        return None if answer is None else pb.ProcessingResponse(**{kind: answer()})

    def end(self) -> Completion | None:
        """The response ended (or the stream did): the completion, once, if routed by us."""
        if self._reported or self.token is None:
            return None
        self._reported = True
        return Completion(
            self.token, self._status, self._served, self._first_byte_at, self._response_bytes
        )
