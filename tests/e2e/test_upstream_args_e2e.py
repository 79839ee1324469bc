"""`epp serve` started with exactly the args of the upstream manifests: GIE's conformance
base manifest (v1.6.0) and the llm-d router's chart (v0.10.0, rendered by
tools/helm_render), read from tests/fixtures/upstream (tests/upstream_args.py).

Each EPP watches its InferencePool on the Kubernetes API stand-in (tests/kube_standin.py:
no real API server runs here; KUBECONFIG points at it) with one simulated vLLM pod, then:
gRPC health answers SERVING for `inference-extension` (and the other probe names) on 9003,
plaintext, and ext_proc on 9002 is TLS (the self-signed certificate) and routes to the pod.
The args fix the ports (9002, 9003, 9090): if another process holds one the test fails
and says which. What stays unproven here: a real kubelet's probes and a real API server.
The one change to the chart's args: `--config-file /config/default-plugins.yaml` points
at a local copy of that file (the chart's ConfigMap, rendered). The llm-d router's chart
with several replicas passes --ha-enable-leader-election: the EPP takes the Lease on the
stand-in, is Ready (`readiness`) as its holder, answers `inference-extension`
SERVICE_UNKNOWN as upstream's does then, and releases the Lease when stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml
from deploy.conftest import helm_render_binary, render_chart  # noqa: F401
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc.fakes import DUPLEX, body_msg, destination, headers_msg
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import served_certificate
from kube_standin import KubeStandIn, pod, pool, running
from upstream_args import (
    LLM_D_OPERATOR_VALUES,
    LLM_D_VALUES,
    conformance_objects,
    epp_containers,
    llm_d_chart,
    plugins_files,
)

from epp.datalayer.kubernetes_resources import INFERENCE_POOL, LEASE, POD
from epp.kernels import KERNELS
from vllm_sim.server import SimPodConfig, start_pod

pytestmark = pytest.mark.e2e

PORTS = {9002: "ext_proc", 9003: "gRPC health", 9090: "metrics"}
MODEL = "sim-llama-8b"
SERVING = health_pb2.HealthCheckResponse.SERVING
WAIT_S = 30.0


def require_free_ports() -> None:
    busy = []
    for port, what in PORTS.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the EPP's servers
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                busy.append(f"{port} ({what})")
    if busy:
        pytest.fail(
            f"port {', '.join(busy)} in use on this machine: the upstream args fix 9002, "
            "9003 and 9090, so this test needs them free (stop what holds them and rerun)"
        )


def conformance_args(pool_name: str) -> tuple[list[str], str]:
    """The conformance manifest's EPP args for `pool_name`, and the pool's namespace."""
    for container in epp_containers(conformance_objects()):
        args = container["args"]
        if args[args.index("--pool-name") + 1] == pool_name:
            return args, args[args.index("--pool-namespace") + 1]
    raise AssertionError(f"no EPP for {pool_name} in the conformance manifest")


async def health(port: int, service: str) -> int | None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.aio.AioRpcError:
            return None
        return reply.status


async def route_over_tls(port: int) -> str:
    """One ext_proc stream over TLS, trusting the certificate the EPP serves."""
    pem, alpn = await asyncio.to_thread(served_certificate, "127.0.0.1", port)
    assert alpn == "h2"
    credentials = grpc.ssl_channel_credentials(root_certificates=pem)
    body = json.dumps({"model": MODEL, "prompt": "hello " * 50, "max_tokens": 2}).encode()

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        yield headers_msg(mode=DUPLEX)
        yield body_msg(body, True)

    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(requests(), timeout=10)
        replies = [reply async for reply in call]
    return destination(replies[0])


async def plaintext_refused(port: int) -> bool:
    """A plaintext client cannot talk to the TLS port."""
    return await health(port, "liveness") is None


class Epp:
    def __init__(self, args: list[str], kubeconfig: Path, log: Path) -> None:
        self.args, self.kubeconfig, self.log = args, kubeconfig, log
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Epp:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env.pop("EPP_LOG_LEVEL", None)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epp", "serve", *self.args,
            stdout=asyncio.subprocess.DEVNULL, stderr=self.log.open("wb"), env=env,
        )  # fmt: skip
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    def lines(self) -> list[dict]:
        out = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line that is not ours
                out.append(json.loads(line))
        return out

    async def until_serving(self, service: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while await health(9003, service) != SERVING:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise AssertionError(f"epp serve exited {self.proc.returncode}:\n{self.tail()}")
            if loop.time() > deadline:
                raise AssertionError(f"{service!r} not SERVING on 9003:\n{self.tail()}")
            await asyncio.sleep(0.1)

    def tail(self) -> str:
        return "\n".join(self.log.read_text().splitlines()[-20:])


def kubeconfig_for(standin: KubeStandIn, path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "standin", "cluster": {"server": standin.url}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "standin", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return path


@pytest.fixture
def standin():
    with running() as s:
        yield s


@pytest.fixture
async def sim_pod():
    running_pod = await start_pod(SimPodConfig(pod_name="sim-0", model=MODEL), "127.0.0.1", 0)
    yield running_pod
    await running_pod.close()


def serve_pool(standin: KubeStandIn, name: str, namespace: str, port: int) -> None:
    labels = {"app": "sim"}
    standin.apply(INFERENCE_POOL, pool(name, labels, [port]), namespace)
    standin.apply(POD, pod("sim-0", labels, "127.0.0.1"), namespace)


async def test_conformance_manifest_args(standin, sim_pod, tmp_path):
    require_free_ports()
    args, namespace = conformance_args("primary-inference-pool")
    assert args == [
        "--pool-name", "primary-inference-pool",
        "--pool-namespace", "inference-conformance-app-backend",
        "--zap-encoder", "json", "--grpc-port", "9002", "--grpc-health-port", "9003",
    ]  # fmt: skip
    serve_pool(standin, "primary-inference-pool", namespace, sim_pod.port)
    kubeconfig = kubeconfig_for(standin, tmp_path / "kubeconfig")
    async with Epp(args, kubeconfig, tmp_path / "epp.log") as epp:
        await epp.until_serving("inference-extension")
        for service in ("", "readiness", "liveness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await health(9003, service) == SERVING, service
        assert await route_over_tls(9002) == f"127.0.0.1:{sim_pod.port}"
        assert await plaintext_refused(9002)
        lines = epp.lines()
    started = next(line for line in lines if line.get("event") == "epp_started")
    assert started["grpc_health"].endswith(":9003") and started["grpc"].endswith(":9002")
    # The serving process says which kernels it runs: this test's own choice.
    assert started["kernels"] == KERNELS
    assert not [line for line in lines if line.get("event") == "upstream_flags_ignored"]


async def test_llm_d_router_chart_args(standin, sim_pod, tmp_path, render_chart):  # noqa: F811
    require_free_ports()
    values = tmp_path / "operator-values.yaml"
    values.write_text(yaml.safe_dump(LLM_D_OPERATOR_VALUES))
    rendered = render_chart(
        LLM_D_VALUES, values, chart=llm_d_chart(tmp_path), name="qwen", namespace="llm-d"
    )
    (container,) = epp_containers(rendered.objects)
    args = list(container["args"])
    for flag in ("--ha-enable-leader-election", "--tracing=false", "--metrics-endpoint-auth=false"):
        assert flag in args
    at = args.index("--config-file") + 1
    assert args[at] == "/config/default-plugins.yaml"
    plugins = tmp_path / "default-plugins.yaml"
    plugins.write_text(plugins_files(rendered.objects)["default-plugins.yaml"])
    args[at] = str(plugins)
    # Several replicas: the chart's probes ask for liveness and readiness on 9003.
    probes = {container[p]["grpc"]["service"] for p in ("livenessProbe", "readinessProbe")}
    assert probes == {"liveness", "readiness"}
    assert {container[p]["grpc"]["port"] for p in ("livenessProbe", "readinessProbe")} == {9003}

    serve_pool(standin, "qwen", "llm-d", sim_pod.port)
    kubeconfig = kubeconfig_for(standin, tmp_path / "kubeconfig")
    lease = "epp-llm-d-qwen.llm-d.ai"  # upstream's name: epp-<namespace>-<pool>.llm-d.ai
    async with Epp(args, kubeconfig, tmp_path / "epp.log") as epp:
        await epp.until_serving("readiness")  # as the holder of the Lease
        assert await health(9003, "liveness") == SERVING
        # Under leader election upstream's health.go has no branch for it.
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        assert await health(9003, "inference-extension") == unknown
        holder = standin.get(LEASE, lease, "llm-d")["spec"]["holderIdentity"]
        assert holder.startswith(f"{os.environ.get('POD_NAME') or socket.gethostname()}_")
        assert await route_over_tls(9002) == f"127.0.0.1:{sim_pod.port}"
        lines = epp.lines()
    assert standin.get(LEASE, lease, "llm-d")["spec"]["holderIdentity"] == ""  # released
    (ignored,) = [line for line in lines if line.get("event") == "upstream_flags_ignored"]
    assert ignored["level"] == "warning"
    assert ignored["flags"] == ["--tracing", "--metrics-endpoint-auth"]
    (mapped,) = [line for line in lines if line.get("event") == "upstream_flags_mapped"]
    assert "--ha-enable-leader-election" in mapped["flags"]
    (unapplied,) = [line for line in lines if line.get("event") == "upstream_config_not_applied"]
    assert "llm-d.ai/v1alpha1 EndpointPickerConfig" in unapplied["config"]
    assert any(line.get("level") == "debug" for line in lines)  # --v=4 from the flags map
