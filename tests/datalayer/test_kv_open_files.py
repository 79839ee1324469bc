"""Followed pods need file descriptors (4 each, README "Precise mode"): `epp serve` raises
its soft open-files limit to the hard one at start, says so once, and never fails when
the kernel refuses. The limits are the real process limits of a child process started
with a low soft limit (the common 1,024 is lowered further to 256 here)."""

from __future__ import annotations

import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from epp.serving import limits

LOW = 256


def low_soft_limit() -> None:
    """In the child, before exec: a soft limit of LOW under the unchanged hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))


def soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-files line in /proc/<pid>/limits")


def hard_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard <= LOW:
        pytest.fail(f"the hard open-files limit here is {hard}: nothing to raise to")
    return hard


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = hard_limit()
    code = (
        "import resource; from epp.serving.limits import raise_open_files_limit;"
        "print(raise_open_files_limit()); print(resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=low_soft_limit,
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    returned, now = done.stdout.splitlines()[-2:]
    assert returned == f"({LOW}, {hard})"
    assert now == f"({hard}, {hard})"
    assert "open_files_limit" in done.stdout + done.stderr


def test_a_refused_raise_keeps_the_old_limit_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The kernel refusing (a hard limit of "unlimited" above fs.nr_open) cannot be set up
    here without changing the machine: setrlimit is made to refuse as it would."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (LOW, resource.RLIM_INFINITY))

    def refuse(*_: object) -> None:
        raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    with capture_logs() as logs:
        assert limits.raise_open_files_limit() == (LOW, LOW)
    assert logs == [
        {
            "event": "open_files_limit",
            "log_level": "info",
            "old": LOW,
            "new": LOW,
            "hard": "unlimited",
            "refused": "not allowed to raise maximum limit",
        }
    ]
    monkeypatch.undo()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)


@pytest.mark.e2e  # starts `epp serve` as a process
def test_epp_serve_raises_its_soft_limit_at_start(tmp_path: Path) -> None:
    hard = hard_limit()
    config = tmp_path / "epp.yaml"
    config.write_text(
        "endpoints: [{name: a, address: '127.0.0.1:1'}]\n"
        "server: {grpc_port: 0, grpc_health_port: 0, metrics_port: 0}\n"
        "kv_events: {mode: approximate}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp", "serve", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=low_soft_limit,
    )  # fmt: skip
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    out = proc.stdout

    def read() -> None:  # a reader thread: waiting on it times out, a readline would not
        for line in out:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        said = None
        while said is None:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("epp serve said nothing of its limit in 60 s") from None
            if '"open_files_limit"' in line:
                said = json.loads(line)
        assert (said["old"], said["new"], said["hard"]) == (LOW, hard, hard)
        assert soft_limit_of(proc.pid) == hard
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
