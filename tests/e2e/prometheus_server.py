"""A real Prometheus server (Debian's `prometheus`) for the e2e tests that query it: started
on a free loopback port with the given configuration, stopped with its process group."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from epp_harness.stack import HOST, free_port

PROMETHEUS = shutil.which("prometheus")


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


@contextmanager
def running_prometheus(config: dict[str, Any], work: Path) -> Iterator[str]:
    """Yields the server's base URL once it is ready; its log is `work/prometheus.log`."""
    assert PROMETHEUS is not None, "no prometheus binary (Debian's prometheus package)"
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address={HOST}:{port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # The client that asks it goes straight to loopback; so must its scrapes.
        env={k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")},
    )
    base = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 60
        while not (proc.poll() is None and _ready(base)):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"Prometheus not ready (log: {work / 'prometheus.log'})")
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
