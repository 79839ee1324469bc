"""Child processes in their own process groups, always stopped; small HTTP helpers.

Every child is started with `start_new_session=True` (its own group) and registered;
`Children.stop_all()` (also run on Ctrl-C / SIGTERM through `run.py`'s finally blocks)
sends SIGTERM to each group, then SIGKILL after a grace period, newest first.
Only the groups this module started are ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http(
    method: str, url: str, body: dict | None = None, timeout: float = 10.0
) -> tuple[int | None, dict[str, str], str]:
    """(status, headers, text); status None when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with _DIRECT.open(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None, {}, ""


def _die_with_parent():
    """preexec hook: the child gets SIGKILL if this harness dies without cleaning up.

    Linux only, and only from the main thread (the kernel ties it to the forking thread).
    """
    import sys
    import threading

    if (
        not sys.platform.startswith("linux")
        or threading.current_thread() is not threading.main_thread()
    ):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return hook


class Child:
    def __init__(self, name: str, popen: subprocess.Popen, log: Path) -> None:
        self.name, self.popen, self.log = name, popen, log

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Children:
    def __init__(self) -> None:
        self._children: list[Child] = []

    def spawn(
        self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> Child:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env if env is not None else dict(os.environ),
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        child = Child(name, popen, log)
        self._children.append(child)
        return child

    def stop(self, child: Child, grace_s: float = 10.0) -> None:
        if child.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=grace_s)
        # vLLM's engine core and workers can outlive the leader: sweep the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=5)
        if child in self._children:
            self._children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(list(self._children)):
            self.stop(child)


def wait_http(child: Child, url: str, timeout_s: float, accept=lambda s: s == 200) -> float:
    """Poll url until accept(status); raise if the child exits or time runs out."""
    start = time.monotonic()
    while True:
        if not child.alive():
            raise RuntimeError(
                f"{child.name} exited ({child.popen.returncode}) before {url} answered; "
                f"log {child.log}:\n{child.tail()}"
            )
        status, _, _ = http("GET", url, timeout=2.0)
        if accept(status):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{child.name}: {url} not ready after {timeout_s:.0f} s")
        time.sleep(0.2 if timeout_s < 60 else 1.0)


_TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """All CPUs' busy time from /proc/stat (user nice system irq softirq steal)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def cpu_snapshot(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each named process group, by this process, and by all.

    `groups`: name -> process group id. The difference of two snapshots gives, over a
    window, what each of our groups used, what this harness used, and "other": the rest of
    the machine (other users' jobs share these 2 cores and make timings noisy).
    """
    by_pgid = {pgid: name for name, pgid in groups.items()}
    out = {name: 0.0 for name in groups}
    out["harness"] = 0.0
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the comm: state ppid pgrp ... utime(14th field overall) stime(15th).
        pgrp, utime, stime = int(fields[2]), int(fields[11]), int(fields[12])
        name = by_pgid.get(pgrp)
        if int(entry) == me:
            name = "harness"
        if name is not None:
            out[name] += (utime + stime) / _TICK
    out["all"] = _busy_seconds()
    return out


def cpu_window(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Cores used on average over the window, per group, harness, other and all."""
    if wall_s <= 0:
        return {}
    used = {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) for k in after}
    ours = sum(v for k, v in used.items() if k != "all")
    used["other"] = max(0.0, used["all"] - ours)
    return {k: round(v / wall_s, 2) for k, v in used.items()}
