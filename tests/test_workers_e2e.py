"""`epp serve --workers 2` as operators run it: real processes, simulated pods (vllm_sim),
a real Envoy (`epp envoy-config --epp-port`) dialing the one ext_proc port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from epp_bench.picker.overhead import ZERO_TIME_PODS
from epp_bench.picker.workers import WorkersStack, worker_pids
from epp_harness.sse import POD_HEADER
from epp_harness.stack import free_ports

pytestmark = pytest.mark.e2e

ZERO_TIME = tuple(ZERO_TIME_PODS.split())
# Envoy opens one ext_proc connection per worker thread and the kernel hands each to one
# worker (SO_REUSEPORT): 16 threads leave both workers without a connection 2**-15 of runs.
ENVOY_THREADS = 16


async def _post(url: str, prompt: str) -> str | None:
    """One completion on a new connection (so a new Envoy thread, maybe another worker)."""
    body = {"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        await response.read()
        assert response.status == 200, response.status
        return response.headers.get(POD_HEADER)


def _prompt(key: int) -> str:
    return " ".join(f"conversation{key} word{i}" for i in range(400))


@pytest.fixture
def stack(tmp_path: Path):
    with WorkersStack(
        tmp_path, 4, 2, sim_args=ZERO_TIME, envoy_threads=ENVOY_THREADS, log_level="info"
    ) as s:
        yield s


def test_both_workers_decide_behind_one_envoy_listener(stack: WorkersStack):
    async def load() -> None:
        await asyncio.gather(*(_post(stack.envoy_url, _prompt(i)) for i in range(64)))

    before = stack.decisions()  # the stack's readiness check through Envoy decided too
    asyncio.run(load())
    decided = [a - b for a, b in zip(stack.decisions(), before, strict=True)]
    assert sum(decided) == 64
    assert all(d > 0 for d in decided), decided
    # Both write to one stream: each routed line says which worker decided it.
    routed = [
        line
        for line in map(json.loads, (stack.work / "epp.log").read_text().splitlines())
        if line.get("event") == "request_routed"
    ]
    assert len(routed) >= 64 and {line["worker"] for line in routed} == {0, 1}


def test_a_turn_decided_by_one_worker_finds_the_prefix_the_other_recorded(stack: WorkersStack):
    """A prompt routed by one worker, then the same prompt routed by the other: the second
    decision matched the whole prefix (its cache-match ratio) and chose the same pod."""
    for key in range(40):
        before = stack.decisions()
        first_pod = asyncio.run(_post(stack.envoy_url, _prompt(1000 + key)))
        after_first = stack.decisions()
        time.sleep(0.2)  # the decision crosses the loopback link
        ratio_before = stack.worker_metric("epp_cache_match_ratio_sum")
        second_pod = asyncio.run(_post(stack.envoy_url, _prompt(1000 + key)))
        after_second = stack.decisions()
        first = [a - b for a, b in zip(after_first, before, strict=True)].index(1)
        second = [a - b for a, b in zip(after_second, after_first, strict=True)].index(1)
        if first == second:
            continue  # the same worker decided both: try another conversation
        ratio = stack.worker_metric("epp_cache_match_ratio_sum")[second] - ratio_before[second]
        assert ratio > 0.9, (first, second, ratio)
        assert second_pod == first_pod
        return
    pytest.fail("40 pairs of requests were all decided by one worker")


def test_a_killed_worker_is_restarted(stack: WorkersStack):
    assert stack.epp is not None
    old = worker_pids(stack.epp.popen.pid)
    assert len(old) == 2
    os.kill(old[1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = worker_pids(stack.epp.popen.pid)
        if len(now) == 2 and old[1] not in now:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no worker restarted: {worker_pids(stack.epp.popen.pid)}")
    assert old[0] in now
    # Both serve again: each worker's page answers ready.
    from epp_bench.picker.replicas import _get, _wait

    for port in stack.metrics_ports:
        _wait(lambda p=port: _get(f"http://127.0.0.1:{p}/ready")[0] == 200, f"worker {port}")
    assert stack.epp.popen.poll() is None  # the supervisor itself lives on


def test_sigterm_drains_every_worker_and_ends_the_supervisor(stack: WorkersStack):
    assert stack.epp is not None
    supervisor = stack.epp.popen
    workers = worker_pids(supervisor.pid)
    assert len(workers) == 2
    supervisor.send_signal(signal.SIGTERM)  # the supervisor alone: workers have own groups
    assert supervisor.wait(30) == 0  # it waited for both workers, none was killed
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _serve(tmp_path: Path, grpc_port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    endpoints = tmp_path / "endpoints.yaml"
    if not endpoints.exists():
        endpoints.write_text(json.dumps({"endpoints": []}))
    health, metrics = free_ports(2)
    argv = [
        sys.executable, "-m", "epp", "serve", "--endpoints", str(endpoints),
        "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(health), "--metrics-host", "127.0.0.1",
        "--metrics-port", str(metrics), "--plaintext", *extra,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_a_second_epp_on_the_workers_port_fails_loudly(stack: WorkersStack, tmp_path: Path):
    """One process (workers 1) keeps SO_REUSEPORT off, and workers check the port without
    it: neither joins the port two workers share."""
    single = _serve(tmp_path, stack.grpc_port)
    assert single.returncode == 1
    assert f"127.0.0.1:{stack.grpc_port} for ext_proc" in single.stderr
    assert "Traceback" not in single.stderr  # one line, as for any port in use
    workers = _serve(tmp_path, stack.grpc_port, "--workers", "2")
    assert workers.returncode == 1
    assert f"127.0.0.1:{stack.grpc_port} for ext_proc" in workers.stderr
    assert "in use" in workers.stderr


def test_a_worker_that_cannot_start_stops_epp_serve(tmp_path: Path):
    """A worker's own start failure (here a certificate file that does not exist) ends
    `epp serve` with exit code 1, as one process does, instead of restarting forever."""
    config = tmp_path / "epp.yaml"
    config.write_text(
        json.dumps(
            {"server": {"tls": {"cert_file": "/nonexistent/c", "key_file": "/nonexistent/k"}}}
        )
    )
    grpc_port = free_ports(1)[0]
    done = _serve_tls(tmp_path, grpc_port, config)
    assert done.returncode == 1
    assert "worker_failed_at_start" in done.stderr
    assert "/nonexistent/c" in done.stderr


def _serve_tls(tmp_path: Path, grpc_port: int, config: Path) -> subprocess.CompletedProcess[str]:
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(json.dumps({"endpoints": []}))
    argv = [
        sys.executable, "-m", "epp", "serve", "--config", str(config),
        "--endpoints", str(endpoints), "--grpc-host", "127.0.0.1",
        "--grpc-port", str(grpc_port), "--grpc-health-port", "0", "--metrics-port", "0",
        "--workers", "2",
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
