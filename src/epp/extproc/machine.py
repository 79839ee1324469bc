"""One ext_proc stream (one HTTP request) as a state machine with no I/O.

`feed(ProcessingRequest) -> [ProcessingResponse]`: the server sends whatever comes back,
in order. The machine follows the body mode Envoy announces (`protocol_config`):

- FULL_DUPLEX_STREAMED: Envoy streams the body without waiting for the headers reply. The
  reply to request_headers is held until the body is complete; then come the headers
  reply (with the destination) and the body, re-emitted as streamed chunks.
- BUFFERED: Envoy waits for the headers reply before sending the body, so holding it
  would deadlock. Headers are answered at once; the destination rides on the body reply.
- No body (headers with end_of_stream): route on headers alone.

The response path is only watched: its end releases the request's in-flight slot.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from typing import Protocol

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.extproc import messages
from epp.request import RequestRejected
from epp.routing import RoutedRequest

_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_BUFFERED = ProcessingMode.BodySendMode.BUFFERED
_NONE = ProcessingMode.BodySendMode.NONE


class RoutingService(Protocol):
    def route(
        self, *, path: str, body: bytes, request_id: str, subset: frozenset[str] | None
    ) -> RoutedRequest: ...

    def complete(
        self, routed: RoutedRequest, status: int | None, served_address: str | None = None
    ) -> None: ...


class Phase(enum.Enum):
    START = "start"
    BODY = "body"  # receiving the request body
    ROUTED = "routed"  # destination sent; the request goes upstream
    RESPONSE = "response"
    DONE = "done"  # answered by us (immediate response) or response complete


class ProtocolViolation(Exception):
    """Envoy sent something this phase cannot accept (a bug or an unsupported config)."""


class ExtProcStream:
    def __init__(
        self,
        router: RoutingService,
        *,
        max_body_bytes: int,
        chunk_bytes: int,
        assumed_duplex: bool = True,
        new_request_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._router = router
        self._max_body = max_body_bytes
        self._chunk = chunk_bytes
        self._duplex = assumed_duplex
        self._new_id = new_request_id
        self._response_streamed = assumed_duplex
        self.phase = Phase.START
        self.request_id: str | None = None
        self.routed: RoutedRequest | None = None
        self._path = "/"
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self._status: int | None = None
        self._served: str | None = None

    # -- public ---------------------------------------------------------------------
    def feed(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if self.phase is Phase.START and message.HasField("protocol_config"):
            config = message.protocol_config
            self._duplex = config.request_body_mode == _DUPLEX
            self._response_streamed = config.response_body_mode == _DUPLEX
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:
            raise ProtocolViolation(f"unexpected ext_proc message {kind!r}")
        return handler(message)

    def close(self) -> None:
        """The stream ended (response done, client gone, Envoy reset): release the slot."""
        if self.routed is not None:
            self._router.complete(self.routed, self._status, self._served)
        self.phase = Phase.DONE

    # -- request path -----------------------------------------------------------------
    def _on_request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.phase is not Phase.START:
            raise ProtocolViolation("request_headers twice")
        headers = messages.header_values(message.request_headers)
        self._path = headers.get(":path", "/")
        self.request_id = headers.get("x-request-id") or self._new_id()
        self._subset = messages.subset_hint(message)
        if message.request_headers.end_of_stream:
            return [self._route(on_body=False)]
        self.phase = Phase.BODY
        if self._duplex:
            return []  # held until the body is complete
        return [messages.continue_request_headers()]

    def _on_request_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.phase is not Phase.BODY:
            raise ProtocolViolation(f"request_body in phase {self.phase.value}")
        chunk = message.request_body
        if len(self._body) + len(chunk.body) > self._max_body:
            return [
                self._reject(
                    RequestRejected(
                        413,
                        f"the request body exceeds the EPP's limit of {self._max_body} bytes",
                        reason="rejected-body-too-large",
                    )
                )
            ]
        self._body += chunk.body
        if not chunk.end_of_stream:
            return []
        if not self._duplex:
            return [self._route(on_body=True)]
        return self._release_duplex(trailers=False)

    def _on_request_trailers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.phase is Phase.BODY and self._duplex:
            return self._release_duplex(trailers=True)
        return [messages.request_trailers()]

    def _release_duplex(self, *, trailers: bool) -> list[pb.ProcessingResponse]:
        first = self._route(on_body=False)
        if first.HasField("immediate_response"):
            return [first]
        body = bytes(self._body)
        self._body = bytearray()
        replies = [first]
        size = self._chunk
        pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            replies.append(messages.streamed_request_body(piece, last and not trailers))
        if trailers:
            replies.append(messages.request_trailers())
        return replies

    def _route(self, *, on_body: bool) -> pb.ProcessingResponse:
        assert self.request_id is not None
        try:
            routed = self._router.route(
                path=self._path,
                body=bytes(self._body),
                request_id=self.request_id,
                subset=self._subset,
            )
        except RequestRejected as rejected:
            return self._reject(rejected)
        self.routed = routed
        self.phase = Phase.ROUTED
        destination = ",".join(e.address for e in routed.decision.endpoints)
        if on_body:
            return messages.route_on_body(destination)
        return messages.route_on_headers(destination)

    def _reject(self, rejected: RequestRejected) -> pb.ProcessingResponse:
        self.phase = Phase.DONE
        return messages.immediate(
            rejected.status, rejected.body(), rejected.reason, self.request_id
        )

    # -- response path --------------------------------------------------------------
    def _on_response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        headers = messages.header_values(message.response_headers)
        status = headers.get(":status", "")
        self._status = int(status) if status.isdigit() else None
        self._served = messages.served_endpoint(message) or self._served
        self.phase = Phase.RESPONSE
        reply = messages.response_headers(self.request_id)
        if message.response_headers.end_of_stream:
            self.close()
        return [reply]

    def _on_response_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        chunk = message.response_body
        if self._response_streamed:
            reply = messages.streamed_response_body(chunk.body, chunk.end_of_stream)
        else:
            reply = messages.continue_response_body()
        if chunk.end_of_stream:
            self.close()
        return [reply]

    def _on_response_trailers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.close()
        return [messages.response_trailers()]
