"""Static file discovery: the endpoints file, watched and reloaded.

The file (`endpoints: [{name, address, metrics_url, model, labels}]`, read by
`config.load_endpoints_file`) is polled every `interval_s` (1 s): a change of its
modification time, size, inode or device triggers a reload once the file has stayed
unchanged for one poll, so an editor's half-written file is not read as a shorter list
(a removed endpoint loses its prefix-index entries at once). Stat follows symlinks, so a
Kubernetes ConfigMap volume (updated by swapping its `..data` symlink) is seen too. A
reload that fails (bad YAML, an invalid or duplicate endpoint, the file gone) is logged
and the last good list stays in force; the next change is tried again.

The endpoints configured inline (`static`) are always included, before the file's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from epp.config import EndpointConfig, load_endpoints_file
from epp.datalayer.discovery.state import DiscoveryState

log = structlog.get_logger("epp.discovery")

_Signature = tuple[int, int, int, int]


def _signature(path: Path) -> _Signature | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev


class EndpointsFileWatcher:
    def __init__(
        self,
        path: Path,
        on_endpoints: Callable[[list[EndpointConfig]], None],
        *,
        static: Sequence[EndpointConfig] = (),
        interval_s: float = 1.0,
        loader: Callable[[Path], list[EndpointConfig]] = load_endpoints_file,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._on_endpoints = on_endpoints
        self._static = list(static)
        self._interval_s = interval_s
        self._loader = loader
        self._clock = clock
        self._signature: _Signature | None = None  # of the file last loaded (or tried)
        self._changed: tuple[_Signature | None] | None = None  # seen changed at the last poll
        self._task: asyncio.Task[None] | None = None
        self.endpoints: list[EndpointConfig] = []
        self.reloads = 0
        self.errors = 0
        self.last_error: str | None = None
        self._last_sync_unix: float | None = None

    def load(self) -> list[EndpointConfig]:
        """Read the file now and return static + file endpoints; raises if it is bad."""
        endpoints = [*self._static, *self._loader(self.path)]
        for what in ("name", "address"):
            values = [getattr(e, what) for e in endpoints]
            duplicates = sorted({v for v in values if values.count(v) > 1})
            if duplicates:
                raise ValueError(f"{self.path}: duplicate endpoint {what}s: {duplicates}")
        return endpoints

    async def start(self) -> None:
        """Load the file once (a bad file fails start-up), deliver it, then poll."""
        self._signature = _signature(self.path)
        self._deliver(self.load())
        log.info("discovery_started", mode="file", path=str(self.path), interval_s=self._interval_s)
        self._task = asyncio.create_task(self._poll_loop(), name="endpoints-file-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def poll(self) -> bool:
        """One check: reload if the file changed and has not changed since the last
        check. True if a new list was delivered."""
        signature = _signature(self.path)
        if signature == self._signature:
            self._changed = None
            return False
        if self._changed != (signature,):
            self._changed = (signature,)  # changed: wait one poll for the writer to finish
            return False
        self._signature, self._changed = signature, None
        try:
            if signature is None:
                raise FileNotFoundError(f"{self.path}: the endpoints file is gone")
            endpoints = self.load()
        except Exception as exc:
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:500]
            log.error(
                "discovery_file_invalid",
                path=str(self.path),
                error=self.last_error,
                keeping=len(self.endpoints),
            )
            return False
        self.last_error = None
        self.reloads += 1
        if endpoints == self.endpoints:
            return False
        self._deliver(endpoints)
        return True

    def state(self) -> DiscoveryState:
        return DiscoveryState(
            mode="file",
            last_sync_ok=self.last_error is None,
            last_sync_unix=self._last_sync_unix,
            endpoints=len(self.endpoints),
            relists=0,
            watch_restarts=0,
            errors=self.errors,
            reloads=self.reloads,
            problems=(self.last_error,) if self.last_error else (),
        )

    def _deliver(self, endpoints: list[EndpointConfig]) -> None:
        self.endpoints = endpoints
        self._last_sync_unix = self._clock()
        log.info("discovery_endpoints", count=len(endpoints), path=str(self.path))
        try:
            self._on_endpoints(list(endpoints))
        except Exception:
            log.exception("discovery_on_endpoints_failed")

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                self.poll()
            except Exception:  # never let the watcher die
                log.exception("discovery_file_poll_failed")
