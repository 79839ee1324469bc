"""One routing ext_proc stream (one HTTP request) as a state machine with no I/O.

`feed(ProcessingRequest) -> Step`. A step carries the replies to send, in order, and may
ask for a routing decision (`step.route`): the server then awaits `router.route(step.route)` and
hands the outcome back with `routed(...)` or `rejected(...)`, which return the next step.
Routing may wait (admission queue), so it cannot happen inside the synchronous `feed`.

The machine follows the body mode Envoy announces (`protocol_config`):

- FULL_DUPLEX_STREAMED: Envoy streams the body without waiting for the headers reply. The
  reply to request_headers is held until the body is complete; then come the headers
  reply (with the destination) and the body, re-emitted as streamed chunks.
- BUFFERED: Envoy waits for the headers reply before sending the body, so holding it
  would deadlock. Headers are answered at once; the destination rides on the body reply.
- No body (headers with end_of_stream): route on headers alone.
- Any other mode (NONE, STREAMED, BUFFERED_PARTIAL, unknown): a 500 that names the
  setting, never a silent pass-through (the request would reach no chosen pod) or a hang.

Once the destination (and every re-emitted body chunk) is out, the step says `finish`:
the server ends the gRPC stream with OK, which Envoy treats as "processing complete" and
the request goes on without the EPP. An EPP crash then costs only requests not yet
routed. The response end is reported by Envoy's access log (access_log.py) or a second,
observing filter (observer.py).
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.extproc import messages
from epp.request import IncomingRequest, RequestRejected

_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_BUFFERED = ProcessingMode.BodySendMode.BUFFERED
SUPPORTED_BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
UNSUPPORTED_BODY_MODE = "unsupported-body-mode"


class _Endpoint(Protocol):
    @property
    def address(self) -> str: ...


class _Decision(Protocol):
    @property
    def endpoints(self) -> Sequence[_Endpoint]: ...


class Routed(Protocol):
    """What `RoutingService.route` returns (epp.routing.RoutedRequest)."""

    @property
    def token(self) -> str: ...

    @property
    def request_id(self) -> str: ...

    @property
    def decision(self) -> _Decision: ...

    @property
    def body(self) -> bytes | None:
        """The body to forward instead of the client's (None: the client's)."""


class RoutingService(Protocol):
    async def route(self, request: IncomingRequest) -> Routed: ...

    def complete(
        self,
        token: str,
        status: int | None,
        served_address: str | None = None,
        first_byte_at: float | None = None,
        response_bytes: int | None = None,
    ) -> None:
        """Idempotent; unknown tokens are ignored; status None: ended without a response."""


@dataclass(slots=True)
class Step:
    replies: list[pb.ProcessingResponse] = field(default_factory=list)
    route: IncomingRequest | None = None  # await router.route(it), then routed()/rejected()
    finish: bool = False  # after the replies, end the gRPC stream with OK
    problem: str | None = None  # a gateway misconfiguration the server logs at ERROR
    answer: RequestRejected | None = None  # the EPP answered itself: counted and logged


class Phase(enum.Enum):
    START = "start"
    BODY = "body"  # receiving the request body
    ROUTING = "routing"  # waiting for the router's answer
    ROUTED = "routed"  # destination sent: the stream is finished
    DONE = "done"  # answered by us (immediate response)


class ProtocolViolation(Exception):
    """Envoy sent something this phase cannot accept (a bug or an unsupported config)."""


def _mode_name(mode: int) -> str:
    try:
        return ProcessingMode.BodySendMode.Name(mode)
    except ValueError:
        return f"unknown ({mode})"


class ExtProcStream:
    def __init__(
        self,
        *,
        max_body_bytes: int,
        chunk_bytes: int,
        assumed_duplex: bool = True,
        new_request_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self._max_body = max_body_bytes
        self._chunk = chunk_bytes
        self._duplex = assumed_duplex
        self._new_id = new_request_id
        self.phase = Phase.START
        self.request_id: str | None = None
        self.token: str | None = None  # set once routed
        self._path = "/"
        self._headers: dict[str, str] = {}
        self._subset: frozenset[str] | None = None
        # The body is held once: its chunks while it arrives, then one bytes object that
        # the router reads (and admission counts) and that is re-emitted from. `_size`
        # counts what is held against max_body_bytes.
        self._chunks: list[bytes] = []
        self._size = 0
        self._body = b""
        self._route_on_body = False
        self._headers_only = False
        self._trailers = False
        self._response_streamed = assumed_duplex

    # -- public ---------------------------------------------------------------------
    def feed(self, message: pb.ProcessingRequest) -> Step:
        kind = message.WhichOneof("request")
        if self.phase is Phase.START and message.HasField("protocol_config"):
            mode = message.protocol_config.request_body_mode
            if mode not in (_DUPLEX, _BUFFERED) and kind == "request_headers":
                return self._unsupported(message, mode)
            self._duplex = mode == _DUPLEX
            self._response_streamed = message.protocol_config.response_body_mode == _DUPLEX
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:
            raise ProtocolViolation(f"unexpected ext_proc message {kind!r}")
        return handler(message)

    def routed(self, result: Routed) -> Step:
        """The router chose: send the destination (and the held body), then finish."""
        if self.phase is not Phase.ROUTING:
            raise ProtocolViolation(f"routing result in phase {self.phase.value}")
        self.phase = Phase.ROUTED
        self.token = result.token
        destination = ",".join(e.address for e in result.decision.endpoints)
        body = result.body
        if self._route_on_body:
            reply = messages.route_on_body(destination, result.token, body)
            return Step([reply], finish=True)
        if body is not None and not (self._duplex and not self._headers_only):
            body = None  # nothing held to replace (a body-less request is never rewritten)
        length = None if body is None else len(body)
        replies = [messages.route_on_headers(destination, result.token, length)]
        if self._duplex and not self._headers_only:
            if body is not None:
                self._body = body
            replies += self._held_body()
        return Step(replies, finish=True)

    def rejected(self, rejected: RequestRejected) -> Step:
        if self.phase is not Phase.ROUTING:
            raise ProtocolViolation(f"routing result in phase {self.phase.value}")
        return Step([self._reject(rejected)], finish=True, answer=rejected)

    # -- request path -----------------------------------------------------------------
    def _on_request_headers(self, message: pb.ProcessingRequest) -> Step:
        if self.phase is not Phase.START:
            raise ProtocolViolation("request_headers twice")
        self._headers = messages.header_values(message.request_headers)
        self._path = self._headers.get(":path", "/")
        self.request_id = self._headers.get("x-request-id") or self._new_id()
        self._subset = messages.subset_hint(message)
        self._headers_only = message.request_headers.end_of_stream
        if self._headers_only:
            return self._ask_route(on_body=False)
        declared = self._headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body:
            # Refused before any of it arrives (in BUFFERED mode Envoy sends nothing more).
            return self._too_large()
        self.phase = Phase.BODY
        if self._duplex:
            return Step()  # held until the body is complete
        return Step([messages.continue_request_headers()])

    def _on_request_body(self, message: pb.ProcessingRequest) -> Step:
        if self.phase is not Phase.BODY:
            raise ProtocolViolation(f"request_body in phase {self.phase.value}")
        chunk = message.request_body
        data = chunk.body  # a copy out of the message: read once
        self._size += len(data)
        if self._size > self._max_body:
            self._chunks = []
            return self._too_large()
        if data:
            self._chunks.append(data)
        if self._duplex and not chunk.end_of_stream:
            return Step()
        # BUFFERED: this one message is the whole body. Without end_of_stream, the client's
        # trailers follow, which Envoy sends (trailer mode SEND) only after this is answered.
        return self._ask_route(on_body=not self._duplex)

    def _on_request_trailers(self, message: pb.ProcessingRequest) -> Step:
        if self.phase is Phase.BODY and self._duplex:
            self._trailers = True
            return self._ask_route(on_body=False)
        if self.phase is Phase.BODY:
            # BUFFERED, and no body message came: the body was empty. The headers went on
            # without a destination, so nothing can route this request now.
            empty = RequestRejected(
                400,
                "the request has no body (only trailers); expected a JSON object",
                reason="invalid-request",
            )
            return Step([self._reject(empty)], finish=True, answer=empty)
        return Step([messages.request_trailers()], finish=self.phase is Phase.ROUTED)

    def _ask_route(self, *, on_body: bool) -> Step:
        assert self.request_id is not None
        self.phase = Phase.ROUTING
        self._route_on_body = on_body
        chunks, self._chunks = self._chunks, []
        self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        call = IncomingRequest(
            path=self._path,
            body=self._body,  # the same object: held once while routing waits
            request_id=self.request_id,
            subset=self._subset,
            headers=self._headers,
        )
        return Step(route=call)

    def _held_body(self) -> list[pb.ProcessingResponse]:
        body, self._body = self._body, b""
        size = self._chunk
        starts = range(0, len(body), size) or range(1)
        last = starts[-1]
        # One piece at a time: each slice is freed once its message holds it.
        replies = [
            messages.streamed_request_body(body[i : i + size], i == last and not self._trailers)
            for i in starts
        ]
        if self._trailers:
            replies.append(messages.request_trailers())
        return replies

    def _too_large(self) -> Step:
        too_large = RequestRejected(
            413,
            f"the request body exceeds the EPP's limit of {self._max_body} bytes",
            reason="rejected-body-too-large",
        )
        return Step([self._reject(too_large)], finish=True, answer=too_large)

    def _reject(self, rejected: RequestRejected) -> pb.ProcessingResponse:
        self.phase = Phase.DONE
        return messages.immediate(
            rejected.status,
            rejected.body(),
            rejected.reason,
            self.request_id,
            retry_after_s=rejected.retry_after_s,
        )

    def _unsupported(self, message: pb.ProcessingRequest, mode: int) -> Step:
        headers = messages.header_values(message.request_headers)
        self.request_id = headers.get("x-request-id") or self._new_id()
        name = _mode_name(mode)
        text = (
            f"the gateway sends the request body to the endpoint picker in mode {name}; "
            f"the endpoint picker supports only {' and '.join(SUPPORTED_BODY_MODES)} "
            "(ext_proc processing_mode.request_body_mode)"
        )
        problem = RequestRejected(500, text, reason=UNSUPPORTED_BODY_MODE)
        return Step([self._reject(problem)], finish=True, problem=name, answer=problem)

    # -- response path --------------------------------------------------------------
    # The routing filter's response modes are SKIP and the stream ends once routed, so
    # none of these arrive with the generated configs. A hand-written config that still
    # sends them gets a neutral answer (and the observer filter does the bookkeeping).
    def _on_response_headers(self, message: pb.ProcessingRequest) -> Step:
        return Step([messages.response_headers(self.request_id)])

    def _on_response_body(self, message: pb.ProcessingRequest) -> Step:
        chunk = message.response_body
        if self._response_streamed:
            return Step([messages.streamed_response_body(chunk.body, chunk.end_of_stream)])
        return Step([messages.continue_response_body()])

    def _on_response_trailers(self, message: pb.ProcessingRequest) -> Step:
        return Step([messages.response_trailers()])
