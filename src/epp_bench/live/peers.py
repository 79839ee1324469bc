"""Peer routers (sglang-router, vllm-router) in front of fresh simulated pods.

`PeerStack` is a `LocalStack` whose front is a peer's router process instead of Envoy: it
reuses LocalStack's pod start-up, readiness polling, process-group bookkeeping and
ordered shutdown (also on failure and Ctrl-C), so a peer run starts from the same cold
pods as an Envoy run and leaves nothing behind.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from epp_bench.live.bench_dir import BenchDir
from epp_harness.stack import HOST, LocalStack, StackError, free_ports

PeerKind = Literal["sglang", "vllm_router"]

# Both peers try to reach Hugging Face for a tokenizer named after the model; a closed
# local port makes that fail at once instead of waiting on a network this box lacks.
_NO_HUB = "HF_ENDPOINT=http://127.0.0.1:9"


@dataclass(frozen=True, slots=True)
class PeerSpec:
    kind: PeerKind
    policy: str
    tool: str  # venv name under .bench/venvs


def peer_argv(
    spec: PeerSpec, bench: BenchDir, port: int, metrics_port: int, worker_urls: Sequence[str]
) -> list[str]:
    """The router's command line, wrapped in `env` to set the variables it needs.

    `env` execs the router, so the child's pid (and process group) is the router's own.
    """
    common = [
        "--host", HOST, "--port", str(port),
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
        "--policy", spec.policy,
        "--worker-urls", *worker_urls,
    ]  # fmt: skip
    if spec.kind == "sglang":
        launcher = [str(bench.bin(spec.tool, "python")), "-m", "sglang_router.launch_router"]
        return ["env", _NO_HUB, *launcher, *common, "--log-level", "warn"]
    launcher = [str(bench.bin(spec.tool, "vllm-router"))]
    return ["env", _NO_HUB, *launcher, *common, "--log-level", "warning"]


class PeerStack(LocalStack):
    """Pods plus one peer router on 127.0.0.1; `router_url` is where clients send requests.

    After `start()`: `router_url`, `router_metrics_url`, `pods`, `pids` (names "pod-<i>"
    and "router").
    """

    def __init__(
        self,
        spec: PeerSpec,
        bench: BenchDir,
        *,
        pods: int = 4,
        sim_args: Sequence[str] = (),
        work_dir: str | Path | None = None,
        startup_timeout_s: float = 30.0,
        kv_events: bool = False,
    ) -> None:
        # The mode is irrelevant: `start` below never starts the EPP nor Envoy.
        super().__init__(
            pods=pods,
            mode="round_robin",
            sim_args=sim_args,
            work_dir=work_dir,
            startup_timeout_s=startup_timeout_s,
            kv_events=kv_events,
        )
        self.spec = spec
        self.bench = bench
        self.router_url = ""
        self.router_metrics_url = ""

    def start(self) -> None:
        launcher = self.bench.venv(self.spec.tool)
        if not self.bench.installed(self.spec.tool):
            raise StackError(
                f"{self.spec.tool} is not installed under {launcher} "
                "(run: .venv/bin/python tools/bench/install_peers.py)"
            )
        if self._started:
            raise StackError("this stack was already started")
        self._started = True
        self.work_dir = self._prepare_work_dir()
        try:
            self._start_pods()
            self._start_router()
        except BaseException as exc:
            if not isinstance(exc, KeyboardInterrupt):
                self._own_work_dir = False
            self.stop()
            raise

    def _prepare_work_dir(self) -> Path:
        work_dir = self.work_dir or Path(tempfile.mkdtemp(prefix="epp-peer-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        return work_dir

    def _start_router(self) -> None:
        port, metrics_port = free_ports(2)
        argv = peer_argv(self.spec, self.bench, port, metrics_port, [p.base_url for p in self.pods])
        child = self._spawn("router", argv)
        url = f"http://{HOST}:{port}"
        # Through the router to a pod: proves the workers are registered and routable. A
        # GET leaves no trace in the router's prefix tree nor in the pods' caches.
        self._wait_until(child, f"{url}/v1/models", lambda s: s == 200, "routing to the pods")
        self.router_url = url
        self.router_metrics_url = f"http://{HOST}:{metrics_port}/metrics"
