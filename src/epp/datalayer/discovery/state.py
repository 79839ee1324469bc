"""Discovery's counters and state, for a metrics module to read (no Prometheus here), and
the capped exponential backoff with jitter its retries use."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ResourceStats:
    """One watched resource's list/watch history. Written by its watch thread; readers
    take a copy (`DiscoveryState`), a torn read of two ints is harmless."""

    resource: str  # WatchedResource.key: "pods", "inferencepools.inference.networking.k8s.io"
    present: bool | None = None  # optional CRDs: None until API discovery answered
    synced: bool = False  # listed at least once (or found absent)
    last_sync_ok: bool = False  # the latest list or watch request succeeded
    lists: int = 0
    relists: int = 0  # lists after the first: 410 Gone, errors, a selector change
    watch_restarts: int = 0  # watches opened again: server timeout, dropped connection
    gone: int = 0  # 410 Gone answers (history compacted): each forces a relist
    errors: int = 0
    events: int = 0
    objects: int = 0
    resource_version: str | None = None  # where the next watch starts; None: list first
    last_error: str | None = None

    def copy(self) -> ResourceStats:
        return ResourceStats(**{name: getattr(self, name) for name in self.__slots__})


@dataclass(frozen=True, slots=True)
class DiscoveryState:
    mode: str  # "kubernetes" or "file"
    last_sync_ok: bool  # every resource's latest list/watch (or file read) succeeded
    last_sync_unix: float | None  # wall time of the last endpoint list delivered
    endpoints: int
    relists: int
    watch_restarts: int
    errors: int
    resources: tuple[ResourceStats, ...] = ()
    pool_found: bool | None = None  # kubernetes: the pool object exists and is valid
    reloads: int = 0  # file: good reloads after the first load
    problems: tuple[str, ...] = field(default_factory=tuple)
    # kubernetes: the pool CRD read, and its last valid spec's appProtocol and
    # endpointPickerRef (name, kind, group, port, failure_mode).
    pool_api: str | None = None
    app_protocol: str | None = None
    endpoint_picker_ref: Mapping[str, Any] | None = None


@dataclass(slots=True)
class Backoff:
    """Delays for retries: initial_s x factor^n, capped at max_s, each drawn uniformly from
    its upper half [d/2, d] so that replicas restarting together spread out."""

    initial_s: float = 0.5
    max_s: float = 30.0
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    _attempt: int = 0

    def next(self) -> float:
        delay = min(self.max_s, self.initial_s * self.factor ** min(self._attempt, 64))
        self._attempt += 1
        return self.rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._attempt = 0
