"""`epp serve`'s discovery wiring: an InferencePool watched on a stand-in API server
(tests/kube_standin.py: no real API server can run here), real simulated pods on
loopback addresses, and the EPP's own router. Routing follows every step of the pool:
add, ready, not ready, delete, a relist after 410, and an edit of the pool's selector.
An InferenceModelRewrite (llm-d.ai, admitted through its upstream CRD) renames the model
of a request a real Envoy forwards to a simulated pod that serves only the target name.
Also: the endpoints file, watched and reloaded, and `epp serve`'s flags."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from kube_standin import KubeStandIn, admitted, pod, pool, running, upstream_objects
from kubernetes import client as k8s

from epp import envoy_config
from epp.app import EppService, build_parser, config_from_args
from epp.config import EppConfig
from epp.datalayer.discovery.file import EndpointsFileWatcher
from epp.datalayer.kubernetes_resources import (
    INFERENCE_MODEL,
    INFERENCE_POOL,
    LLMD_INFERENCE_MODEL_REWRITE,
    POD,
)
from epp.request import IncomingRequest, RequestRejected
from epp_harness.stack import envoy_binary, free_ports
from vllm_sim.server import SimPodConfig, start_pod

NS = "inference"
MODEL = "sim-llama-8b"
IPS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
WAIT_S = 10.0


def free_port_on_all(ips: tuple[str, ...]) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = s.getsockname()[1]
        try:
            for ip in ips[1:]:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every loopback address")


async def until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def pods() -> AsyncIterator[int]:
    port = free_port_on_all(IPS)
    running_pods = [
        await start_pod(SimPodConfig(pod_name=f"sim-{i}", model=MODEL), ip, port)
        for i, ip in enumerate(IPS)
    ]
    yield port
    for p in running_pods:
        await p.close()


@pytest.fixture
def standin():
    with running() as s:
        yield s


@pytest.fixture
async def service(standin: KubeStandIn) -> AsyncIterator[EppService]:
    config = EppConfig.model_validate(
        {
            "discovery": {"pool_name": "pool", "pool_namespace": NS},
            "server": {
                "grpc_port": 0,
                "grpc_health_port": 0,
                "metrics_port": 0,
                "grpc_host": "127.0.0.1",
            },
        }
    )
    svc = EppService(config, kube_client=k8s.ApiClient(k8s.Configuration(host=standin.url)))
    await svc.start()
    yield svc
    await svc.stop(grace_s=0.1)


def pods_routed_to(svc: EppService, n: int = 9) -> set[str]:
    """Where n distinct requests go (left open, so in-flight counts spread them)."""
    chosen = set()
    for i in range(n):
        body = json.dumps({"model": MODEL, "prompt": f"request {i} " * 20}).encode()
        routed = svc.router.route_now(
            IncomingRequest(path="/v1/completions", body=body, request_id=f"q{i}")
        )
        chosen.add(routed.endpoint.name)
        svc.router.complete(routed.token, 200)
    return chosen


def names(svc: EppService) -> set[str]:
    return {e.name for e in svc.store.all()}


async def test_routing_follows_the_pool_through_every_step(
    standin: KubeStandIn, pods: int, service: EppService
) -> None:
    vllm = {"app": "vllm"}
    standin.apply(INFERENCE_POOL, pool("pool", vllm, [pods]), NS)
    assert not service.ready  # no endpoint yet

    standin.apply(POD, pod("a", vllm, IPS[0]), NS)
    await until(lambda: names(service) == {"a"} and service.ready, "pod a, scraped")
    assert pods_routed_to(service) == {"a"}
    assert service.store.get("a").address == f"{IPS[0]}:{pods}"

    standin.apply(POD, pod("b", vllm, IPS[1], ready=False), NS)  # not ready: not routed
    standin.apply(POD, pod("c", vllm, IPS[2]), NS)
    await until(lambda: names(service) == {"a", "c"}, "pod c")
    await until(lambda: service.store.get("c").metrics is not None, "pod c scraped")
    assert pods_routed_to(service) == {"a", "c"}

    standin.apply(POD, pod("b", vllm, IPS[1]), NS)  # ready now
    await until(lambda: names(service) == {"a", "b", "c"}, "pod b ready")
    await until(lambda: service.store.get("b").metrics is not None, "pod b scraped")
    assert pods_routed_to(service, 12) == {"a", "b", "c"}

    standin.apply(POD, pod("a", vllm, IPS[0], ready=False), NS)  # a goes not ready
    await until(lambda: names(service) == {"b", "c"}, "pod a not ready")
    assert pods_routed_to(service) == {"b", "c"}

    standin.delete(POD, "c", NS)
    standin.expire()  # 410 Gone: discovery relists
    standin.apply(POD, pod("a", vllm, IPS[0]), NS)  # ready again, seen after the relist
    await until(lambda: names(service) == {"a", "b"}, "delete c, relist, a back")
    await until(lambda: service.store.get("a").metrics is not None, "pod a scraped again")
    assert pods_routed_to(service) == {"a", "b"}
    assert service.discovery is not None and service.discovery.state().relists >= 1

    # The pool's selector moves to pods labelled tier=gold: only b carries it.
    standin.apply(POD, pod("b", {**vllm, "tier": "gold"}, IPS[1]), NS)
    standin.apply(INFERENCE_POOL, pool("pool", {"tier": "gold"}, [pods]), NS)
    await until(lambda: names(service) == {"b"}, "selector edit")
    assert pods_routed_to(service) == {"b"}
    assert service.index.blocks("a") == 0  # a's prefix entries went with it

    standin.delete(POD, "b", NS)
    await until(lambda: names(service) == set(), "every pod gone")
    with pytest.raises(RequestRejected) as refused:
        pods_routed_to(service, 1)
    assert refused.value.status == 503


async def test_an_inference_models_target_is_what_the_pod_is_asked_for(
    standin: KubeStandIn, pods: int, service: EppService
) -> None:
    vllm = {"app": "vllm"}
    standin.apply(INFERENCE_POOL, pool("pool", vllm, [pods]), NS)
    standin.apply(POD, pod("a", vllm, IPS[0]), NS)
    standin.apply(
        INFERENCE_MODEL,
        {
            "metadata": {"name": "chat"},
            "spec": {
                "modelName": "chat",
                "criticality": "Sheddable",
                "targetModels": [{"name": MODEL, "weight": 100}],
                "poolRef": {"name": "pool"},
            },
        },
        NS,
    )
    await until(lambda: service.ready, "ready")
    await until(lambda: "chat" in service.router.preparation.models.models, "the model table")
    body = json.dumps({"model": "chat", "prompt": "hello"}).encode()
    prepared = service.router.prepare(
        IncomingRequest(path="/v1/completions", body=body, request_id="m")
    )
    assert prepared.priority == -1
    assert prepared.body is not None and json.loads(prepared.body)["model"] == MODEL


def post(url: str, body: dict, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    request.add_header("content-type", "application/json")
    for key, value in headers.items():
        request.add_header(key, value)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.mark.e2e  # starts a real Envoy
async def test_a_model_rewrite_renames_the_model_envoy_forwards(
    standin: KubeStandIn, pods: int, service: EppService, tmp_path: Path
) -> None:
    """The llm-d router's own test rewrite (`model-to-be-rewritten` -> `rewritten-model`),
    retargeted at our pool and the simulated pods' model: the pods serve only MODEL and
    answer 404 for any other name, so a 200 through Envoy means the body's model was
    rewritten before Envoy forwarded it."""
    vllm = {"app": "vllm"}
    standin.apply(INFERENCE_POOL, admitted(pool("pool", vllm, [pods])), NS)
    standin.apply(POD, pod("a", vllm, IPS[0]), NS)
    (rewrite,) = upstream_objects(
        "llm-d-router-v0.10.0/testdata/inferencepool-with-model-hermetic.yaml",
        "InferenceModelRewrite",
    )
    rewrite["metadata"] = {"name": rewrite["metadata"]["name"]}
    rewrite["spec"]["poolRef"]["name"] = "pool"
    rewrite["spec"]["rules"][0]["targets"] = [{"modelRewrite": MODEL}]
    standin.apply(LLMD_INFERENCE_MODEL_REWRITE, admitted(rewrite), NS)
    await until(lambda: service.ready, "ready")
    await until(
        lambda: "model-to-be-rewritten" in service.router.preparation.models.rewrites, "the rewrite"
    )

    listen, admin = free_ports(2)
    config = envoy_config.render(
        mode="epp",
        listen_port=listen,
        admin_port=admin,
        epp_port=service.grpc_port,
        pod_cluster="original_dst",
    )
    (tmp_path / "envoy.yaml").write_text(config)
    log = (tmp_path / "envoy.log").open("wb")
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--disable-hot-restart",
         "--concurrency", "1", "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{listen}/v1/completions"

        def ask(model: str) -> tuple[int, dict]:
            return post(url, {"model": model, "prompt": "hello", "max_tokens": 2}, {})

        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        status, answer = 0, {}
        while loop.time() < deadline:
            try:
                status, answer = await asyncio.to_thread(ask, "model-to-be-rewritten")
                break
            except OSError:  # Envoy not listening yet
                await asyncio.sleep(0.1)
        assert status == 200, (status, answer, (tmp_path / "envoy.log").read_text()[-2000:])
        assert answer["model"] == MODEL  # the pod saw the target's name
        # A name no rule covers stays as it is: no pod serves it.
        status, answer = await asyncio.to_thread(ask, "not-rewritten")
        assert status == 404, answer
    finally:
        envoy.terminate()
        envoy.wait(10)
        log.close()


async def test_the_endpoints_file_is_watched(tmp_path: Path) -> None:
    file = tmp_path / "pods.yaml"
    file.write_text("endpoints:\n  - {name: x, address: '127.0.0.1:9'}\n")
    config = EppConfig.model_validate(
        {
            "endpoints_file": str(file),
            "discovery": {"file_poll_s": 0.02},
            "server": {
                "grpc_port": 0,
                "grpc_health_port": 0,
                "metrics_port": 0,
                "grpc_host": "127.0.0.1",
            },
        }
    )
    svc = EppService(config)
    await svc.start()
    try:
        assert names(svc) == {"x"}
        file.write_text(
            "endpoints:\n  - {name: y, address: '127.0.0.1:10'}\n"
            "  - {name: z, address: '127.0.0.1:11'}\n"
        )
        await until(lambda: names(svc) == {"y", "z"}, "the file reloaded")
        watcher = svc.discovery
        assert isinstance(watcher, EndpointsFileWatcher)
        errors_before = watcher.errors
        file.write_text("endpoints: [not a mapping")  # a bad edit keeps the last good list
        # First the positive signal that the bad edit was read (and rejected), then the
        # check that nothing changed: a watcher that never read it cannot pass.
        await until(lambda: watcher.errors > errors_before, "the bad edit read and rejected")
        assert watcher.last_error is not None
        assert names(svc) == {"y", "z"}
    finally:
        await svc.stop(grace_s=0.1)


def test_serve_flags_choose_the_source_of_endpoints(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--pool-name", "p", "--pool-namespace", "ns"])
    config = config_from_args(args)
    assert (config.discovery.pool_name, config.discovery.pool_namespace) == ("p", "ns")
    file = tmp_path / "pods.yaml"
    file.write_text("endpoints:\n  - {name: x, address: '127.0.0.1:9'}\n")
    config = config_from_args(build_parser().parse_args(["--endpoints", str(file)]))
    assert config.endpoints_file == file and config.discovery.pool_name is None
    file.write_text("endpoints: 3\n")
    with pytest.raises(ValueError, match=r"pods\.yaml"):
        config_from_args(build_parser().parse_args(["--endpoints", str(file)]))
    with pytest.raises(ValueError, match="exclusive"):
        config_from_args(build_parser().parse_args(["--endpoints", str(file), "--pool-name", "p"]))


async def test_standalone_discovery_from_the_config(standin: KubeStandIn, pods: int) -> None:
    """discovery.endpoint_selector + target_ports: the pods of a label selector, with no
    InferencePool (upstream's --endpoint-selector / --endpoint-target-ports)."""
    config = EppConfig.model_validate(
        {
            "discovery": {
                "endpoint_selector": "app=vllm",
                "target_ports": [pods],
                "pool_namespace": NS,
            },
            "server": {
                "grpc_port": 0,
                "metrics_port": 0,
                "grpc_health_port": 0,
                "grpc_host": "127.0.0.1",
            },
        }
    )
    svc = EppService(config, kube_client=k8s.ApiClient(k8s.Configuration(host=standin.url)))
    await svc.start()
    try:
        standin.apply(POD, pod("a", {"app": "vllm"}, IPS[0]), NS)
        standin.apply(POD, pod("z", {"app": "other"}, IPS[1]), NS)
        await until(lambda: names(svc) == {"a"} and svc.ready, "pod a, scraped")
        assert pods_routed_to(svc) == {"a"}
    finally:
        await svc.stop(grace_s=0.1)


@pytest.mark.parametrize(
    ("discovery", "error"),
    [
        ({"target_ports": [8000]}, "needs discovery.endpoint_selector"),
        ({"endpoint_selector": "app=x"}, "target ports"),
        ({"endpoint_selector": "app in (x)", "target_ports": [8000]}, "key=value"),
        ({"endpoint_selector": "app=x", "target_ports": [8000], "pool_name": "p"}, "exclusive"),
    ],
)
def test_standalone_config_errors(discovery: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EppConfig.model_validate({"discovery": discovery})


async def test_grpc_health_serves_once_the_pool_is_read_even_without_pods(
    standin: KubeStandIn, pods: int, service: EppService
) -> None:
    """The upstream EPP answers every health name but `liveness` SERVING once its pool
    synced, pods or not, and the upstream charts probe liveness with
    `inference-extension`, readiness with it or `readiness`; GKE asks for "". Tied to
    "pods known", an EPP whose model servers are still loading would be restarted by the
    kubelet, or kept out of its Service so that no request could queue."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    names_ = ("inference-extension", "readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor")

    async def status(name: str) -> int:
        address = f"127.0.0.1:{service.grpc_health_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=name), timeout=3
            )
        return reply.status

    async def until_serving(name: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while (got := await status(name)) != serving:
            if loop.time() > deadline:
                raise AssertionError(f"{name!r}: {got}, wanted SERVING")
            await asyncio.sleep(0.02)

    for name in names_:  # no pool object read yet: not serving
        assert await status(name) != serving, name
    vllm = {"app": "vllm"}
    standin.apply(INFERENCE_POOL, pool("pool", vllm, [pods]), NS)
    standin.apply(POD, pod("loading", vllm, IPS[0], ready=False), NS)  # a model still loading
    for name in names_:
        await until_serving(name)
    assert service.serving and not service.ready  # HTTP /ready still wants a pod
    assert await status("liveness") == serving

    standin.apply(POD, pod("loading", vllm, IPS[0]), NS)  # loaded
    await until(lambda: service.ready, "the pod known and scraped")
    for name in names_:
        assert await status(name) == serving, name
