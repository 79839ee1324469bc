"""The endpoints file, watched: edits are picked up once the file is steady, bad edits are
logged and the last good list is kept, static endpoints stay. `poll()` is called by hand
(the 1 s loop only calls it)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from epp.config import EndpointConfig
from epp.datalayer.discovery.file import EndpointsFileWatcher


def write(path: Path, *pods: tuple[str, str], tick: int = 0) -> None:
    lines = ["endpoints:"] + [f"  - {{name: {n}, address: '{a}'}}" for n, a in pods]
    path.write_text("\n".join(lines) + "\n")
    # Filesystems with coarse timestamps: make each write's mtime distinct.
    stamp = 1_700_000_000_000_000_000 + tick * 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


def names(endpoints: list[EndpointConfig]) -> list[str]:
    return [e.name for e in endpoints]


def settle(watcher: EndpointsFileWatcher) -> bool:
    """Two polls: the first sees the change, the second (file unchanged since) loads it."""
    first = watcher.poll()
    return watcher.poll() or first


async def test_reload_on_change_and_keep_last_good_on_bad_edit(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    write(path, ("a", "10.0.0.1:8000"), tick=1)
    got: list[list[str]] = []
    static = [EndpointConfig(name="fixed", address="10.0.0.9:8000")]
    watcher = EndpointsFileWatcher(path, lambda e: got.append(names(e)), static=static)
    await watcher.start()
    try:
        assert got == [["fixed", "a"]]

        assert watcher.poll() is False  # unchanged

        write(path, ("a", "10.0.0.1:8000"), ("b", "10.0.0.2:8000"), tick=2)
        assert watcher.poll() is False  # changed: wait one poll for the writer to finish
        assert watcher.poll() is True
        assert got[-1] == ["fixed", "a", "b"]

        path.write_text("endpoints: [ {name: broken")  # bad YAML
        os.utime(path, ns=(1_700_000_003_000_000_000,) * 2)
        assert settle(watcher) is False
        assert watcher.state().last_sync_ok is False and watcher.errors == 1
        assert watcher.endpoints and names(watcher.endpoints) == ["fixed", "a", "b"]

        write(path, ("a", "not-an-address"), tick=4)  # invalid endpoint
        assert settle(watcher) is False
        write(path, ("fixed", "10.0.0.3:8000"), tick=5)  # duplicate of a static name
        assert settle(watcher) is False
        write(path, ("c", "10.0.0.9:8000"), tick=6)  # duplicate of a static address
        assert settle(watcher) is False
        path.unlink()  # gone
        assert settle(watcher) is False
        assert got[-1] == ["fixed", "a", "b"] and watcher.errors == 5

        write(path, ("c", "10.0.0.3:8000"), tick=7)  # fixed again
        assert settle(watcher) is True
        assert got[-1] == ["fixed", "c"]
        state = watcher.state()
        assert state.mode == "file" and state.last_sync_ok and state.endpoints == 2
    finally:
        await watcher.stop()


async def test_an_unchanged_list_is_not_delivered_again(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    write(path, ("a", "10.0.0.1:8000"), tick=1)
    got: list[list[str]] = []
    watcher = EndpointsFileWatcher(path, lambda e: got.append(names(e)))
    await watcher.start()
    write(path, ("a", "10.0.0.1:8000"), tick=2)  # touched, same content
    assert settle(watcher) is False
    assert got == [["a"]]
    await watcher.stop()


async def test_a_symlink_swap_is_seen(tmp_path: Path) -> None:
    """How a Kubernetes ConfigMap volume updates: a new file, then a symlink swap."""
    (tmp_path / "v1").write_text("endpoints: [{name: a, address: '10.0.0.1:8000'}]\n")
    (tmp_path / "v2").write_text("endpoints: [{name: b, address: '10.0.0.2:8000'}]\n")
    link = tmp_path / "endpoints.yaml"
    link.symlink_to(tmp_path / "v1")
    got: list[list[str]] = []
    watcher = EndpointsFileWatcher(link, lambda e: got.append(names(e)))
    await watcher.start()
    tmp = tmp_path / "next"
    tmp.symlink_to(tmp_path / "v2")
    tmp.replace(link)
    assert settle(watcher) is True
    assert got == [["a"], ["b"]]
    await watcher.stop()


async def test_a_bad_file_at_start_fails_start(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints: 3\n")
    watcher = EndpointsFileWatcher(path, lambda e: None)
    with pytest.raises(ValueError):
        await watcher.start()


async def test_the_poll_loop_reloads(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    write(path, ("a", "10.0.0.1:8000"), tick=1)
    changed = asyncio.Event()
    got: list[list[str]] = []

    def on_endpoints(endpoints: list[EndpointConfig]) -> None:
        got.append(names(endpoints))
        if len(got) == 2:
            changed.set()

    watcher = EndpointsFileWatcher(path, on_endpoints, interval_s=0.01)
    await watcher.start()
    write(path, ("b", "10.0.0.2:8000"), tick=2)
    await asyncio.wait_for(changed.wait(), 5)
    assert got == [["a"], ["b"]]
    await watcher.stop()
