"""LocalStack with real processes: simulated pods behind a real Envoy, on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from epp_harness.stack import LocalStack, StackError, free_ports

pytestmark = pytest.mark.e2e

CHAT = {
    "model": "sim-llama-8b",
    "messages": [{"role": "user", "content": "hello there"}],
    "max_tokens": 4,
}


def _post_chat(base_url: str) -> tuple[int, str | None]:
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(CHAT).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            json.loads(response.read())
            return response.status, response.headers.get("x-sim-pod")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("x-sim-pod")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _group_members(pgids: set[int]) -> list[int]:
    """Pids of every process whose process group is one of `pgids` (Linux /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) in pgids:
            members.append(int(entry.name))
    return members


def test_free_ports_are_distinct() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 < port < 65536 for port in ports)


def test_round_robin_stack_serves_kills_and_stops_cleanly() -> None:
    stack = LocalStack(pods=2, mode="round_robin")
    with stack:
        pids = stack.pids
        assert set(pids) == {"pod-0", "pod-1", "envoy"}
        assert all(_alive(pid) for pid in pids.values())
        assert [p.name for p in stack.pods] == ["pod-0", "pod-1"]
        assert stack.epp_metrics_url is None
        assert all(path.exists() for path in stack.log_paths.values())
        work_dir = stack.work_dir
        assert work_dir is not None and work_dir.exists()

        served = [_post_chat(stack.envoy_url) for _ in range(2)]
        assert [status for status, _ in served] == [200, 200]
        # One Envoy worker: round robin alternates between the two pods.
        assert {pod for _, pod in served} == {"pod-0", "pod-1"}

        stack.kill_pod("pod-0")
        assert not _alive(pids["pod-0"])
        assert "pod-0" not in stack.pids
        assert _post_chat(stack.pod("pod-1").base_url) == (200, "pod-1")
        with pytest.raises(KeyError):
            stack.kill_pod("pod-9")

    assert not any(_alive(pid) for pid in pids.values())
    assert _group_members(set(pids.values())) == []
    assert not work_dir.exists()
    stack.stop()  # idempotent


@pytest.mark.parametrize("plaintext", [False, True], ids=["default-tls", "plaintext"])
def test_epp_stack_routes_through_the_picker(tmp_path: Path, plaintext: bool) -> None:
    """The demo's stack runs the EPP's default transport (TLS, self-signed) unless told
    to run plaintext; Envoy dials it the same way either way."""
    stack_dir = tmp_path / "stack"
    with LocalStack(pods=2, mode="epp", work_dir=stack_dir, epp_plaintext=plaintext) as stack:
        assert set(stack.pids) == {"pod-0", "pod-1", "epp", "envoy"}
        endpoints = (tmp_path / "stack" / "endpoints.yaml").read_text()
        assert all(pod.address in endpoints for pod in stack.pods)
        status, pod = _post_chat(stack.envoy_url)
        assert status == 200
        assert pod in {"pod-0", "pod-1"}
        assert stack.epp_metrics_url is not None
        with urllib.request.urlopen(stack.epp_metrics_url, timeout=5) as response:
            assert response.status == 200
        # Envoy took the lifted circuit breakers (its default is 1,024 per cluster).
        with urllib.request.urlopen(f"{stack.envoy_admin_url}/clusters", timeout=5) as response:
            clusters = response.read().decode()
        for cluster in ("epp", "pods"):
            for limit in ("max_connections", "max_pending_requests", "max_requests"):
                assert f"{cluster}::default_priority::{limit}::4294967295" in clusters
        pids = stack.pids
    assert not any(_alive(pid) for pid in pids.values())
    # A work directory the caller chose is kept, logs included.
    log = (stack_dir / "epp.log").read_text().splitlines()
    [transport] = [json.loads(line) for line in log if '"grpc_transport"' in line]
    assert transport["mode"] == ("plaintext" if plaintext else "tls")
    envoy = (stack_dir / "envoy.yaml").read_text()
    assert ("envoy.transport_sockets.tls" in envoy) is not plaintext


def test_failed_start_raises_with_log_tail_and_stops_the_rest(tmp_path: Path) -> None:
    stack = LocalStack(
        pods=2, mode="round_robin", sim_args=["--no-such-flag"], work_dir=tmp_path / "stack"
    )
    with pytest.raises(StackError) as caught:
        stack.start()
    message = str(caught.value)
    assert "pod-0" in message
    assert "--no-such-flag" in message  # argparse's complaint, from the log tail
    assert stack.pids == {}
    assert (tmp_path / "stack" / "pod-0.log").exists()


def test_sigterm_during_a_run_stops_every_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids.json"
    script = textwrap.dedent(
        f"""
        import json, os, time
        from epp_harness.stack import LocalStack, sigterm_as_keyboard_interrupt
        with sigterm_as_keyboard_interrupt():
            with LocalStack(pods=1, mode="round_robin") as stack:
                with open({str(pid_file)!r} + ".tmp", "w") as f:
                    json.dump(stack.pids, f)
                os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
                time.sleep(60)
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists():
            assert driver.poll() is None, driver.stderr.read().decode() if driver.stderr else ""
            assert time.monotonic() < deadline, "stack did not start"
            time.sleep(0.05)
        pids = json.loads(pid_file.read_text())
        assert set(pids) == {"pod-0", "envoy"}
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=20)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert not any(_alive(pid) for pid in pids.values())
    assert _group_members(set(pids.values())) == []
