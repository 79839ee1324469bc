"""gRPC health on its own plaintext port (server.grpc_health_port), as the upstream EPP
serves it on 9003: a real EppService with one simulated pod, asked over real gRPC.

`inference-extension`, `""`, `readiness` and the ext_proc service are SERVING once the
endpoints are read and scraped once (tests/test_app_discovery.py: also a pool with no
ready pod) and NOT_SERVING while draining; `liveness` is SERVING while the process runs. The same answers stay on the ext_proc port (9002), and a
port in use is one clear error."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import epp_channel_credentials

from epp.app import EppService
from epp.config import EppConfig, ServerConfig
from epp.extproc.server import HealthState, build_health_server
from vllm_sim.server import SimPodConfig, start_pod

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_NAMES = (
    "inference-extension",
    "",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
)


async def status(channel: grpc.aio.Channel, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=3
    )
    return reply.status


async def until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def service() -> AsyncIterator[EppService]:
    pod = await start_pod(SimPodConfig(pod_name="sim-0", model="m"), "127.0.0.1", 0)
    config = EppConfig.model_validate(
        {
            "endpoints": [{"name": "sim-0", "address": f"127.0.0.1:{pod.port}"}],
            "server": {
                "grpc_host": "127.0.0.1",
                "grpc_port": 0,
                "grpc_health_port": 0,
                "metrics_port": 0,
                "metrics_host": "127.0.0.1",
                "drain_timeout_s": 30.0,
                "drain_quiet_s": 30.0,
            },
        }
    )
    svc = EppService(config)
    await svc.start()
    yield svc
    await svc.stop(grace_s=0.1)
    await pod.close()


async def test_health_port_answers_the_upstream_names_and_follows_draining(service):
    assert service.grpc_health_port not in (0, service.grpc_port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_health_port}") as channel:
        assert await status(channel, "liveness") == SERVING

        async def all_ready() -> bool:
            return all([await status(channel, name) == SERVING for name in READY_NAMES])

        await until(all_ready, "every ready name SERVING on the health port")
        assert service.ready
        # The same names on the ext_proc port (TLS by default).
        tls = epp_channel_credentials("127.0.0.1", service.grpc_port)
        async with grpc.aio.secure_channel(f"127.0.0.1:{service.grpc_port}", tls) as ext_proc:
            for name in (*READY_NAMES, "liveness"):
                assert await status(ext_proc, name) == SERVING, name

        draining = asyncio.ensure_future(service.drain())
        try:

            async def none_ready() -> bool:
                return all([await status(channel, name) == NOT_SERVING for name in READY_NAMES])

            await until(none_ready, "every ready name NOT_SERVING while draining")
            assert await status(channel, "liveness") == SERVING  # no restart mid-drain
        finally:
            draining.cancel()


async def test_a_taken_health_port_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServerConfig(grpc_host="127.0.0.1", grpc_health_port=port)
        with pytest.raises(OSError, match=rf"127.0.0.1:{port} for gRPC health.*in use"):
            build_health_server(HealthState(), config)
