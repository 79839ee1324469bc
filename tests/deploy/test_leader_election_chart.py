"""charts/epp with leaderElection.enabled: what `epp serve` makes of the rendered pod (its
real argument parsing and config loading), which health name the readiness probe asks,
and what the EPP's own health server answers for each probed name under leader election
(a leader, a standby). The Lease itself is exercised in tests/test_leader*.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.conftest import VALUES_STATIC, RenderError
from deploy.k8s_checks import epp_container
from deploy.test_chart_drop_in import effective_config
from epp.extproc.server import HealthState

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

ON = ["leaderElection.enabled=true"]


def probes(rendered) -> dict[str, str]:
    container = epp_container(rendered.objects)
    return {p: container[p]["grpc"]["service"] for p in ("livenessProbe", "readinessProbe")}


async def answers(names: set[str], leader: bool) -> dict[str, int]:
    state = HealthState(leader_election=True)
    await state.set(live=True, ready=leader)  # EppService passes serving-and-leading
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return {
                name: (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
                for name in names
            }
    finally:
        await server.stop(None)


@pytest.mark.parametrize("replicas", ["1", "3"])
def test_leader_election_is_passed_and_probed_by_readiness(render_chart, tmp_path: Path, replicas):
    rendered = render_chart(set=[*ON, f"replicaCount={replicas}"], namespace="inference")
    assert "--ha-enable-leader-election" in epp_container(rendered.objects)["args"]
    config = effective_config(rendered, tmp_path, "inference")
    assert config.discovery.leader_election is True
    assert config.discovery.pool_namespace == "inference"  # the Lease's namespace
    # `inference-extension` would answer SERVICE_UNKNOWN: the probe asks `readiness`.
    assert probes(rendered) == {"livenessProbe": "liveness", "readinessProbe": "readiness"}
    names = set(probes(rendered).values())
    leader = asyncio.run(answers(names, leader=True))
    standby = asyncio.run(answers(names, leader=False))
    assert leader == {"liveness": SERVING, "readiness": SERVING}
    assert standby == {"liveness": SERVING, "readiness": NOT_SERVING}  # up, not Ready


def test_leader_election_is_off_by_default(render_chart, tmp_path: Path):
    rendered = render_chart(namespace="inference")
    assert "--ha-enable-leader-election" not in epp_container(rendered.objects)["args"]
    assert effective_config(rendered, tmp_path, "inference").discovery.leader_election is False


def test_leader_election_with_static_discovery_does_not_render(render_chart):
    with pytest.raises(
        RenderError, match=r"leaderElection\.enabled needs discovery\.mode kubernetes"
    ):
        render_chart(VALUES_STATIC, set=ON)
