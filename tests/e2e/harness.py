"""Real processes for the failure-mode tests: simulated pods, `epp serve` (stoppable,
killable, restartable on the same ports) and Envoy on a config the test chooses.

LocalStack (epp_harness.stack) always renders its own Envoy config and owns the EPP's
lifetime; these tests need hand-written configs and an EPP that dies and comes back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from epp_harness.stack import HOST, envoy_binary, free_ports

MODEL = "sim-llama-8b"
FAST_PODS = ["--prefill-per-token-ms", "0.01", "--decode-per-token-ms", "0.2"]
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(
    url: str, body: dict | bytes | None = None, headers: dict | None = None, timeout=30.0
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body); status 0 when the connection failed or timed out."""
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    request.add_header("content-type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()
    except (urllib.error.URLError, OSError):
        return 0, {}, b""


def chat_body(topic: str, stream: bool = False, max_tokens: int = 4) -> dict:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": f"You are an expert on {topic}. " * 40},
            {"role": "user", "content": f"tell me about {topic}"},
        ],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # the whole environment (default: ours)

    def start(self) -> Proc:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(self.env or os.environ, PYTHONUNBUFFERED="1"),
            )
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.popen is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> int | None:
        assert self.popen is not None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.popen is None:
            return
        self.signal(signal.SIGTERM)
        if self.wait(5) is None:
            self.signal(signal.SIGKILL)
            self.popen.wait()


@dataclass
class Rig:
    """Pods, an EPP and an Envoy; each started on demand, all stopped by `close`."""

    work: Path
    procs: list[Proc] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)  # ip:port
    epp_grpc_port: int = 0
    epp_metrics_port: int = 0
    envoy_url: str = ""
    epp: Proc | None = None

    def start_pods(self, count: int, args_for: Callable[[int], list[str]] | None = None):
        ports = free_ports(count)
        for i, port in enumerate(ports):
            extra = args_for(i) if args_for else []
            argv = [
                sys.executable, "-m", "vllm_sim", "--host", HOST, "--port", str(port),
                "--name", f"pod-{i}", "--model", MODEL, *FAST_PODS, *extra,
            ]  # fmt: skip
            self.procs.append(Proc(f"pod-{i}", argv, self.work / f"pod-{i}.log").start())
            self.pods.append(f"{HOST}:{port}")
        for address in self.pods:
            wait_for(lambda a=address: http(f"http://{a}/health", timeout=1)[0] == 200)

    def start_epp(
        self,
        config: dict | None = None,
        labels_for: Callable[[int], dict] | None = None,
        args: Sequence[str] = (),
    ) -> Proc:
        """`epp serve` on fixed ports (the same ones again after a restart); `labels_for(i)`:
        pod i's endpoint labels; `args`: more command-line flags (e.g. --plaintext). The
        gRPC port serves the default transport, TLS with a self-signed certificate."""
        if not self.epp_grpc_port:
            self.epp_grpc_port, self.epp_metrics_port = free_ports(2)
        endpoints = [
            {"name": f"pod-{i}", "address": a, "metrics_url": f"http://{a}/metrics"}
            | ({"labels": labels_for(i)} if labels_for else {})
            for i, a in enumerate(self.pods)
        ]
        (self.work / "endpoints.yaml").write_text(yaml.safe_dump({"endpoints": endpoints}))
        (self.work / "epp.yaml").write_text(yaml.safe_dump(config or {}))
        argv = [
            sys.executable, "-m", "epp", "serve",
            "--config", str(self.work / "epp.yaml"),
            "--endpoints", str(self.work / "endpoints.yaml"),
            "--grpc-host", HOST, "--grpc-port", str(self.epp_grpc_port),
            "--metrics-host", HOST, "--metrics-port", str(self.epp_metrics_port),
            "--grpc-health-port", "0",  # any free port: tests run side by side
            *args,
        ]  # fmt: skip
        self.epp = Proc("epp", argv, self.work / "epp.log").start()
        self.procs.append(self.epp)
        wait_for(lambda: self.epp_ready() == 200, what="EPP ready")
        return self.epp

    def epp_ready(self) -> int:
        return http(f"http://{HOST}:{self.epp_metrics_port}/ready", timeout=1)[0]

    def epp_metric(self, name: str) -> float:
        _, _, page = http(f"http://{HOST}:{self.epp_metrics_port}/metrics", timeout=5)
        for line in page.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def epp_routed(self) -> float:
        """Decisions the EPP has made (every model), from its Prometheus page."""
        _, _, page = http(f"http://{HOST}:{self.epp_metrics_port}/metrics", timeout=5)
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in page.decode().splitlines()
            if line.startswith("epp_routing_decisions_total{") and 'result="routed"' in line
        )

    def epp_endpoints(self) -> list[dict]:
        url = f"http://{HOST}:{self.epp_metrics_port}/debug/endpoints"
        return json.loads(http(url, timeout=5)[2])

    def reserve_epp_ports(self) -> None:
        self.epp_grpc_port, self.epp_metrics_port = free_ports(2)

    def start_envoy(self, config_yaml: str, listen_port: int) -> None:
        path = self.work / "envoy.yaml"
        path.write_text(config_yaml)
        argv = [
            envoy_binary(), "-c", str(path), "--disable-hot-restart",
            "--concurrency", "1", "--log-level", "warning",
        ]  # fmt: skip
        self.procs.append(Proc("envoy", argv, self.work / "envoy.log").start())
        self.envoy_url = f"http://{HOST}:{listen_port}"
        wait_for(lambda: http(f"{self.envoy_url}/v1/models", timeout=1)[0] != 0, what="Envoy")

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@contextlib.contextmanager
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def in_threads(count: int, work: Callable[[int], object]) -> list[object]:
    """Run `work(i)` for i in range(count) at once; their results, in order."""
    results: list[object] = [None] * count

    def run(i: int) -> None:
        results[i] = work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
