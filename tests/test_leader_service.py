"""Two `epp serve` services (EppService, real gRPC health servers, real HTTP to the API)
with `discovery.leader_election` against the Kubernetes API stand-in (tests/kube_standin.py:
no API server runs here, so its Leases are a fake): one replica is Ready, as the upstream
charts expect when they pass --ha-enable-leader-election and probe `readiness`.

- exactly one serves `readiness`, "" and the ext_proc name; both serve `liveness`; both
  answer `inference-extension` SERVICE_UNKNOWN, as upstream's health.go does then;
- the leader drains (SIGTERM): it gives the Lease up and the standby is Ready within
  about one retry period (2 s, controller-runtime's default timings);
- the leader's renewals are refused: it turns NotReady once its renew deadline passes and
  the standby takes over after the lease expired (shortened timings: real threads, real
  time; tests/test_leader.py runs the default timings on an injected clock);
- a standby still routes a request that reaches it, as upstream's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kube_standin import KubeStandIn, pod, pool, running
from kubernetes import client as k8s

from epp.app import EppService
from epp.config import EppConfig, ServerConfig
from epp.datalayer.kubernetes_resources import INFERENCE_POOL, LEASE, POD
from epp.extproc.server import EXT_PROC_SERVICE
from epp.leader import LeaseTimings, lease_name
from epp.request import IncomingRequest
from epp_harness.stack import free_ports
from vllm_sim.server import SimPodConfig, start_pod

NS = "inference"
MODEL = "sim-llama-8b"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
LEADER_NAMES = ("readiness", "", EXT_PROC_SERVICE)


@pytest.fixture
async def standin() -> AsyncIterator[KubeStandIn]:
    with running() as s:
        (port,) = free_ports(1)
        sim = await start_pod(SimPodConfig(pod_name="sim-0", model=MODEL), "127.0.0.1", port)
        vllm = {"app": "vllm"}
        s.apply(INFERENCE_POOL, pool("pool", vllm, [port]), NS)
        s.apply(POD, pod("sim-0", vllm, "127.0.0.1"), NS)
        yield s
        await sim.close()


def service(standin: KubeStandIn, timings: LeaseTimings | None = None, **discovery) -> EppService:
    server: dict = {}
    if "debug_port" in ServerConfig.model_fields:  # two services in one process: any port
        server["debug_port"] = 0
    config = EppConfig.model_validate(
        {
            "discovery": {
                "pool_name": "pool",
                "pool_namespace": NS,
                "leader_election": True,
                **discovery,
            },
            "server": {
                "grpc_port": 0,
                "grpc_health_port": 0,
                "metrics_port": 0,
                "grpc_host": "127.0.0.1",
                "secure_serving": False,
                "drain_timeout_s": 0.5,
                "drain_quiet_s": 0.1,
                **server,
            },
        }
    )
    client = k8s.ApiClient(k8s.Configuration(host=standin.url))
    return EppService(config, kube_client=client, lease_timings=timings)


async def status(svc: EppService, name: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=name), timeout=3
        )
    return reply.status


async def ready(svc: EppService) -> bool:
    return await status(svc, "readiness") == SERVING


async def until(check: Callable[[], object], what: str, within_s: float = 10.0) -> float:
    """Seconds until the (async) check holds."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not await check():  # type: ignore[misc]
        if loop.time() - started > within_s:
            raise AssertionError(f"timed out after {within_s}s waiting for: {what}")
        await asyncio.sleep(0.02)
    return loop.time() - started


async def one_leader(a: EppService, b: EppService) -> tuple[EppService, EppService]:
    async def either() -> bool:
        return await ready(a) or await ready(b)

    await until(either, "one replica Ready")
    return (a, b) if await ready(a) else (b, a)


@pytest.fixture
async def pair(standin: KubeStandIn) -> AsyncIterator[tuple[EppService, EppService]]:
    a, b = service(standin), service(standin)
    await a.start()
    await b.start()
    yield a, b
    for svc in (a, b):
        await svc.stop(grace_s=0.1)


async def test_exactly_one_replica_is_ready_and_a_drained_leader_hands_over(
    standin: KubeStandIn, pair: tuple[EppService, EppService]
):
    leader, standby = await one_leader(*pair)
    await asyncio.sleep(1.0)  # a few health refreshes and a lease renewal later: still one
    for name in LEADER_NAMES:
        assert await status(leader, name) == SERVING, name
        assert await status(standby, name) == NOT_SERVING, name
    for svc in pair:
        assert await status(svc, "liveness") == SERVING
        assert await status(svc, "inference-extension") == UNKNOWN  # upstream's default branch
    assert leader.leader is not None and standby.leader is not None
    lease = standin.get(LEASE, lease_name(NS, "pool"), NS)
    assert lease["spec"]["holderIdentity"] == leader.leader.identity
    assert leader.ready and not standby.ready  # HTTP /ready follows too

    # SIGTERM on the leader: drain() releases the Lease; the standby leads within ~2 s.
    draining = asyncio.ensure_future(leader.drain())
    took = await until(lambda: ready(standby), "the standby Ready", within_s=8.0)
    await draining
    assert not await ready(leader)
    assert await status(leader, "liveness") == SERVING  # draining is no reason to restart
    print(f"handover after a graceful stop: {took:.2f} s")
    # One retry period (2 s, +10% jitter) and a health refresh (0.25 s); the guard leaves
    # room for a stalled machine and still tells a released Lease from one left to
    # expire (15 s).
    assert took < 6.0


async def test_a_leader_whose_renewals_fail_steps_down_and_the_standby_takes_over(
    standin: KubeStandIn,
):
    timings = LeaseTimings(lease_duration_s=2.0, renew_deadline_s=1.0, retry_period_s=0.2)
    a, b = service(standin, timings), service(standin, timings)
    await a.start()
    await b.start()
    try:
        leader, standby = await one_leader(a, b)
        assert leader.leader is not None
        loop = asyncio.get_running_loop()
        cut = loop.time()
        standin.refuse_lease_writes(leader.leader.identity)
        both = False

        async def leader_down() -> bool:
            nonlocal both
            up = await ready(leader)
            both = both or (up and await ready(standby))
            return not up

        dropped = await until(leader_down, "the cut-off leader NotReady", within_s=5.0)
        taken = await until(lambda: ready(standby), "the standby Ready", within_s=5.0)
        taken += dropped
        assert not both, "two replicas Ready at once"
        print(f"cut-off leader NotReady after {dropped:.2f} s, standby Ready after {taken:.2f} s")
        # Not leader once the renew deadline (1 s since its last renewal) passed, and the
        # health refresh (0.25 s) shows it; the standby waits for the 2 s lease to expire.
        assert dropped <= timings.renew_deadline_s + 0.5
        assert timings.lease_duration_s - timings.retry_period_s <= taken <= 4.0
        assert loop.time() - cut >= taken
    finally:
        for svc in (a, b):
            await svc.stop(grace_s=0.1)


async def test_a_standby_still_routes_what_reaches_it(pair: tuple[EppService, EppService]):
    """Upstream's ext_proc server runs outside leader election, on a datastore kept
    populated on every replica: a gateway that ignores health still gets an answer."""
    _, standby = await one_leader(*pair)
    assert not await ready(standby)

    async def known() -> bool:
        return len(standby.store) == 1 and standby.scraper.first_round.is_set()

    await until(known, "the standby's pod known and scraped")
    body = json.dumps({"model": MODEL, "prompt": "hello " * 20}).encode()
    routed = standby.router.route_now(
        IncomingRequest(path="/v1/completions", body=body, request_id="r1")
    )
    assert routed.endpoint.name == "sim-0"
    standby.router.complete(routed.token, 200)


def test_leader_election_without_kubernetes_discovery_is_a_config_error():
    with pytest.raises(ValueError, match="leader_election needs Kubernetes discovery"):
        EppConfig.model_validate(
            {
                "discovery": {"leader_election": True},
                "endpoints": [{"name": "a", "address": "127.0.0.1:1"}],
            }
        )
