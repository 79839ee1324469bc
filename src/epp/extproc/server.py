"""The grpc.aio ExternalProcessor service: a thin loop around ExtProcStream, plus the
standard gRPC health service. Any failure inside one stream ends that stream with a 500
ImmediateResponse (or a cancelled stream) and is counted; it never touches another."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp.config import ServerConfig
from epp.extproc import messages
from epp.extproc.machine import ExtProcStream, Phase, RoutingService
from epp.observability.metrics import EppMetrics

log = structlog.get_logger("epp.extproc")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
INTERNAL_ERROR_BODY = (
    b'{"error": {"message": "internal error in the endpoint picker", '
    b'"type": "InternalServerError", "param": null, "code": 500}}'
)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, router: RoutingService, config: ServerConfig, metrics: EppMetrics):
        self._router = router
        self._config = config
        self._metrics = metrics

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = ExtProcStream(
            self._router,
            max_body_bytes=self._config.max_body_bytes,
            chunk_bytes=self._config.stream_chunk_bytes,
            assumed_duplex=self._config.assumed_body_mode == "FULL_DUPLEX_STREAMED",
        )
        try:
            async for message in request_iterator:
                try:
                    replies = stream.feed(message)
                except Exception:
                    self._metrics.streams_failed.inc()
                    log.exception(
                        "stream_failed", request_id=stream.request_id, phase=stream.phase.value
                    )
                    if stream.phase in (Phase.START, Phase.BODY):
                        yield messages.immediate(
                            500, INTERNAL_ERROR_BODY, "internal-error", stream.request_id
                        )
                    return
                for reply in replies:
                    yield reply
                if replies and replies[-1].HasField("immediate_response"):
                    return  # answered by us: Envoy sends nothing more on this stream
        finally:
            stream.close()


class HealthState:
    """liveness: the process serves; readiness and the ext_proc service: endpoints known."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set(self, *, live: bool, ready: bool) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set("liveness", serving if live else not_serving)
        await self.servicer.set("", serving if live else not_serving)
        for service in ("readiness", EXT_PROC_SERVICE):
            await self.servicer.set(service, serving if ready else not_serving)


def build_grpc_server(
    processor: ExternalProcessor, health_state: HealthState, config: ServerConfig
) -> tuple[grpc.aio.Server, int]:
    limit = config.max_grpc_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    port = server.add_insecure_port(f"{config.grpc_host}:{config.grpc_port}")
    if port == 0:
        raise OSError(f"cannot listen on {config.grpc_host}:{config.grpc_port}")
    return server, port
