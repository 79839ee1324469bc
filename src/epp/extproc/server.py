"""The grpc.aio ExternalProcessor service, plus the standard gRPC health service.

Two kinds of streams arrive on the same service:

- routing streams (the first ext_proc filter): a thin loop around ExtProcStream that
  awaits the router when the machine asks for it, sends the destination and ends the
  stream with OK, so the request no longer depends on this process;
- observer streams (the second, fail-open filter in observability mode): they carry the
  route token and the response status, and end with the response: `router.complete`.

The same server takes Envoy's gRPC access log (access_log.py), the other source of
response ends: `epp envoy-config` configures it instead of the observer filter, since it
costs one message per finished request on a long-lived stream (several under load) where
the observer costs a stream.

The observer filter announces itself with gRPC metadata `x-epp-stream: observer` (set in
the generated config); without it, a first message in observability mode or on the
response path also marks an observer. Any failure inside one stream ends that stream
with a 500 ImmediateResponse (or a cancelled stream) and is counted; it never touches
another.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc
import structlog
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp.config import ServerConfig
from epp.extproc import messages
from epp.extproc.access_log import AccessLogReceiver
from epp.extproc.machine import ExtProcStream, Phase, RoutingService, Step
from epp.extproc.observer import Completion, ObserverStream
from epp.observability.metrics import EppMetrics
from epp.request import RequestRejected
from epp.tls import GrpcTransport, grpc_transport

log = structlog.get_logger("epp.extproc")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ROLE_METADATA = "x-epp-stream"
OBSERVER_ROLE = "observer"
INTERNAL_ERROR_BODY = (
    b'{"error": {"message": "internal error in the endpoint picker", '
    b'"type": "InternalServerError", "param": null, "code": 500}}'
)
# What a request_body message holds besides the body (protobuf framing, end_of_stream),
# with room to spare; request_headers messages are far smaller than the least body limit.
BODY_MESSAGE_HEADROOM = 64 * 1024
_RESPONSE_PATH = frozenset({"response_headers", "response_body", "response_trailers"})


async def _read_each(context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingRequest]:
    """The stream's messages, none of them referenced here once handed on."""
    slot: list[pb.ProcessingRequest] = []
    while True:
        message = await context.read()
        if message is grpc.aio.EOF:
            return
        slot.append(message)
        del message
        yield slot.pop()


class RoutingStreams:
    """How many routing streams are open, and since when none is: what a drain waits on.

    Observer streams are not counted: they last as long as a generation, and losing them
    costs only bookkeeping (their filter fails open), never a request.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.open = 0
        self._last_change = clock()

    def opened(self) -> None:
        self.open += 1
        self._last_change = self._clock()

    def closed(self) -> None:
        self.open -= 1
        self._last_change = self._clock()

    def quiet_for(self) -> float:
        """Seconds since the last routing stream opened or closed; 0 while one is open."""
        return 0.0 if self.open else self._clock() - self._last_change


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        router: RoutingService,
        config: ServerConfig,
        metrics: EppMetrics,
        streams: RoutingStreams | None = None,
        extension_s: float | None = None,
    ):
        self._router = router
        self._config = config
        self._metrics = metrics
        self.streams = streams or RoutingStreams()
        self._extension_s = extension_s if extension_s is not None else config.keepalive_extension_s
        self._reported_modes: set[str] = set()

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        # grpc's own request iterator keeps its last message referenced until the next
        # arrives: a BUFFERED body's message would be held beside the machine's copy while
        # routing waits. Reading with context.read() keeps none.
        iterator = _read_each(context) if hasattr(context, "read") else aiter(request_iterator)
        try:
            first = await anext(iterator)
        except StopAsyncIteration:
            return
        observer = metadata.get(ROLE_METADATA) == OBSERVER_ROLE or (
            first.observability_mode or first.WhichOneof("request") in _RESPONSE_PATH
        )
        handler = self._observe if observer else self._route
        # aclosing: a reset stream must run the handler's cleanup now, not at GC time.
        async with contextlib.aclosing(handler(first, iterator)) as replies:
            async for reply in replies:
                yield reply

    # -- routing streams ----------------------------------------------------------------
    async def _route(
        self, first: pb.ProcessingRequest, rest: AsyncIterator[pb.ProcessingRequest]
    ) -> AsyncGenerator[pb.ProcessingResponse, None]:
        stream = ExtProcStream(
            max_body_bytes=self._config.max_body_bytes,
            chunk_bytes=self._config.stream_chunk_bytes,
            assumed_duplex=self._config.assumed_body_mode == "FULL_DUPLEX_STREAMED",
        )
        # Whether a reply carrying the decision was handed to gRPC. From then on a reset
        # does not say Envoy lacks the destination: Envoy may have read it and reset the
        # stream before this generator resumed, and the request is then being served.
        # Releasing it would under-count a busy pod (and admit more than it can run), so
        # it stays counted until the observer reports its end, a page shows it over
        # (ledger.reconcile) or its TTL passes.
        handed_over = False
        finished = False
        self.streams.opened()
        try:
            message: pb.ProcessingRequest | None = first
            while message is not None:
                try:
                    # The machine is synchronous: only a routing decision (which may wait in
                    # admission) runs as a task.
                    step = stream.feed(message)
                    message = None  # its body copy is in the machine: not held twice
                    if step.problem is not None:
                        self._report_unsupported(step.problem)
                    if step.route is not None:
                        advancing = asyncio.ensure_future(self._decide(stream, step))
                        try:
                            # A request waiting in admission must not hit Envoy's message
                            # timer (message_timeout, BUFFERED mode: 5 s) when the pool
                            # answers within flow_control.ttl_s. Envoy honours one override
                            # per message, so one is sent, long enough for the whole wait.
                            await asyncio.wait({advancing}, timeout=self._config.keepalive_s)
                            if not advancing.done():
                                yield messages.extend_message_timeout(self._extension_s)
                                await advancing
                        finally:
                            if not advancing.done():
                                advancing.cancel()
                                with contextlib.suppress(BaseException):
                                    await advancing
                        step = advancing.result()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    failure = self._stream_failed(stream)
                    if failure is not None:
                        yield failure
                    return
                if step.answer is not None:  # every answer the EPP gives itself
                    self._count_answer(stream.request_id, step.answer)
                for reply in step.replies:
                    handed_over = handed_over or stream.token is not None
                    yield reply
                if step.finish:
                    # Ending with OK: Envoy marks processing complete and goes on alone.
                    finished = True
                    return
                message = await anext(rest, None)
        finally:
            self.streams.closed()
            if stream.token is not None and not finished and not handed_over:
                # Routed, but reset before the destination could reach Envoy.
                self.complete(Completion(stream.token, None, None))

    def _stream_failed(self, stream: ExtProcStream) -> pb.ProcessingResponse | None:
        """A bug met on a routing stream: counted and logged; a request not yet sent on
        gets a 500 (the reply to send), one already routed is left to Envoy."""
        self._metrics.streams_failed.inc()
        log.exception("stream_failed", request_id=stream.request_id, phase=stream.phase.value)
        if stream.phase not in (Phase.START, Phase.BODY, Phase.ROUTING):
            return None
        self._metrics.answers.answered(stream.request_id, 500, "internal-error", "internal error")
        self._metrics.upstream.answered(500)
        return messages.immediate(500, INTERNAL_ERROR_BODY, "internal-error", stream.request_id)

    def _count_answer(self, request_id: str | None, answer: RequestRejected) -> None:
        self._metrics.answers.answered(request_id, answer.status, answer.reason, answer.message)
        self._metrics.upstream.answered(answer.status, answer)

    async def _decide(self, stream: ExtProcStream, asked: Step) -> Step:
        """The router's answer to the machine's request for a decision: the next step."""
        assert asked.route is not None
        try:
            routed = await self._router.route(asked.route)
        except RequestRejected as rejected:
            return stream.rejected(rejected)
        try:
            return stream.routed(routed)
        except BaseException:
            if stream.token is None:  # else the stream's end releases it (_route)
                self.complete(Completion(routed.token, None, None))
            raise

    def _report_unsupported(self, mode: str) -> None:
        # Once per mode and process: a misconfigured gateway must not flood the log.
        if mode in self._reported_modes:
            return
        self._reported_modes.add(mode)
        log.error(
            "unsupported_body_mode",
            setting="processing_mode.request_body_mode",
            mode=mode,
            supported=["FULL_DUPLEX_STREAMED", "BUFFERED"],
            answer="500 unsupported-body-mode to every request",
        )

    # -- observer streams ---------------------------------------------------------------
    async def _observe(
        self, first: pb.ProcessingRequest, rest: AsyncIterator[pb.ProcessingRequest]
    ) -> AsyncGenerator[pb.ProcessingResponse, None]:
        observer = ObserverStream()
        try:
            message: pb.ProcessingRequest | None = first
            while message is not None:
                completion = observer.feed(message)
                reply = observer.reply(message)
                if completion is not None:
                    self.complete(completion)
                if reply is not None:
                    yield reply
                message = await anext(rest, None)
        finally:
            completion = observer.end()
            if completion is not None:
                self.complete(completion)

    def complete(self, completion: Completion) -> None:
        """A request's end, from an observer stream or the access log (access_log.py)."""
        try:
            self._router.complete(
                completion.token,
                completion.status,
                completion.served_address,
                completion.first_byte_at,
                completion.response_bytes,
            )
        except Exception:  # bookkeeping must never fail a stream
            log.exception("complete_failed", status=completion.status)


# The upstream EPP's health name: the upstream charts (one replica) and GIE's conformance
# manifests probe liveness AND readiness with it.
UPSTREAM_HEALTH_SERVICE = "inference-extension"
# Names that follow `serving` (EppService.serving): SERVING once discovery delivered its
# first endpoint list and its pods were scraped once, with or without pods, NOT_SERVING
# while draining. The upstream EPP answers every name so once its pool synced; a
# stricter rule (pods known) would fail the liveness probe of the upstream charts while
# the model servers load (the kubelet restarts the EPP), mark the EPP unhealthy for GKE's
# check of "" and take every replica out of its Service under the upstream charts'
# `readiness` probe, so that no request could queue for a scale-from-zero pool.
READY_SERVICES = ("readiness", "", UPSTREAM_HEALTH_SERVICE, EXT_PROC_SERVICE)


class HealthState:
    """`liveness`: the process serves. READY_SERVICES: see there. One servicer,
    registered on the ext_proc server and on the health-only server.

    With `leader_election`, `ready` is passed as serving-and-leading (EppService.leading)
    and `inference-extension` answers SERVICE_UNKNOWN, as the upstream EPP's health.go
    does then: its Check switches on `readiness`, "", `liveness` and the ext_proc name
    only, and every other name, `inference-extension` included, takes the default branch,
    a SERVICE_UNKNOWN response (not an error). The upstream charts probe `liveness` and
    `readiness` whenever they enable leader election, so nothing of theirs asks for it; a
    probe that did would fail on either EPP (the kubelet passes only SERVING)."""

    def __init__(self, leader_election: bool = False) -> None:
        self.servicer = health.aio.HealthServicer()
        self.leader_election = leader_election

    async def set(self, *, live: bool, ready: bool) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set("liveness", serving if live else not_serving)
        for service in READY_SERVICES:
            if self.leader_election and service == UPSTREAM_HEALTH_SERVICE:
                unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                await self.servicer.set(service, unknown)
                continue
            await self.servicer.set(service, serving if ready else not_serving)


def _reuseport(config: ServerConfig) -> int:
    """SO_REUSEPORT only for worker processes sharing the port (epp/serving/workers.py):
    one process keeps a port in use a loud failure, not a silent share with it."""
    return 1 if config.workers > 1 else 0


def build_health_server(
    health_state: HealthState, config: ServerConfig
) -> tuple[grpc.aio.Server, int]:
    """gRPC health alone, plaintext, on grpc_host:grpc_health_port (the upstream EPP's
    9003, where GKE and the upstream charts' probes ask): probes carry no certificate.
    Port 0 picks a free one; the bound port is returned."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", _reuseport(config))])
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    address = f"{config.grpc_host}:{config.grpc_health_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind": a port in use
        port = 0
    if port == 0:
        raise OSError(
            f"cannot listen on {address} for gRPC health (server.grpc_health_port, "
            "--grpc-health-port): is the port in use?"
        )
    return server, port


def build_grpc_server(
    processor: ExternalProcessor,
    health_state: HealthState,
    config: ServerConfig,
    transport: GrpcTransport | None = None,
) -> tuple[grpc.aio.Server, int]:
    """The ext_proc + health server on `config`'s address, with the TLS the config asks
    for (epp.tls.grpc_transport), or `transport` when given: a caller that needs the
    generated certificate (a test's client) builds the SelfSignedTls itself."""
    limit = config.max_grpc_message_bytes
    # A message larger than a body at the limit plus its framing is refused by gRPC
    # itself (the stream fails, the gateway answers its error status): a BUFFERED body
    # without Content-Length is one message, and is never buffered past the limit here.
    receive = min(limit, config.max_body_bytes + BODY_MESSAGE_HEADROOM)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", _reuseport(config)),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    # Response ends from Envoy's gRPC access log (the default `epp envoy-config`), beside
    # the observer streams (configurations that carry the observer filter).
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(
        AccessLogReceiver(processor.complete), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    address = f"{config.grpc_host}:{config.grpc_port}"
    # TLS by default (server.secure_serving): certificate files re-read when they change,
    # or a self-signed certificate generated now (epp/tls/). Health shares the port.
    tls = transport if transport is not None else grpc_transport(config)
    try:
        if tls is None:
            port = server.add_insecure_port(address)
            log.info("grpc_transport", mode="plaintext", detail="server.secure_serving: false")
        else:
            port = server.add_secure_port(address, tls.credentials())
            log.info("grpc_transport", **tls.describe())
    except RuntimeError:  # grpc's "Failed to bind" (plaintext): a port in use
        port = 0
    if port == 0:
        raise OSError(
            f"cannot listen on {config.grpc_host}:{config.grpc_port} for ext_proc "
            "(server.grpc_port, --grpc-port): is the port in use?"
        )
    return server, port
