"""Kubernetes discovery: an InferencePool's Ready pods -> endpoints; InferenceModel,
InferenceObjective and InferenceModelRewrite -> the model table.

One watch thread per resource read (the pool of `pool_group`, its pods, and the optional
model CRDs: InferenceModel, and InferenceObjective and InferenceModelRewrite in both
`llm-d.ai` and `inference.networking.x-k8s.io`), each a `Reflector` (list, then watch).
Of a kind served in both groups only the `llm-d.ai` objects count, as in the reference
EPP (llm-d router v0.10.0 `server/controller_config.go`: "prefer the new group and
IGNORE legacy resources"); that is decided on every change, so installing or removing
either CRD later is followed. Their results move onto the asyncio loop with
`call_soon_threadsafe` (bursts coalesce into one call), where the pure functions of
`pool.py` and `models.py` turn them into

- `on_endpoints(list[EndpointConfig])`: the pool's endpoints, called with the whole new
  list whenever it changes (first when the pool and its pods are listed), so a pod that
  is deleted, stops being Ready, starts terminating or loses its IP leaves at once;
- `on_models(ModelTable)`: when a model CRD's objects for this pool change (first once
  every one is listed or known absent).

Both run on the loop thread. The sync `kubernetes` client blocks, hence the threads:
JSON decoding of a large pod list then yields the GIL every few milliseconds instead of
holding the routing loop for the whole parse.

A pool edit applies at once: a new selector aborts the pod watch and relists with it
(pods that stop matching drop out even ahead of the relist), new targetPorts recompute the
endpoints. A pool that is deleted empties the endpoint list; an edit that makes the pool
invalid is logged and the last valid spec kept.

Read only: get/list/watch of exactly the resources in `WATCHED_RESOURCES`, namespaced,
plus API discovery (`GET /apis/<group>/<version>`, which needs no RBAC); the client and
its calls: `kube_client.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from kubernetes import client as k8s

from epp.config import EndpointConfig
from epp.datalayer.discovery.kube_client import (
    SERVICEACCOUNT_NAMESPACE,
    crd_installed,
    default_namespace,
    list_call,
    make_api_client,
)
from epp.datalayer.discovery.models import ModelTable, build_model_table
from epp.datalayer.discovery.pool import (
    InvalidPool,
    MetricsLocation,
    PoolSpec,
    endpoints_for_pool,
    parse_alpha_pool,
    parse_pool,
)
from epp.datalayer.discovery.reflector import (
    Reflector,
    Snapshot,
    WatchSettings,
)
from epp.datalayer.discovery.state import DiscoveryState
from epp.datalayer.kubernetes_resources import (
    INFERENCE_MODEL,
    INFERENCE_POOL_V1ALPHA2,
    MODEL_RESOURCES,
    OBJECTIVES,
    POD,
    POOL_GROUP,
    REWRITES,
    WatchedResource,
    pool_resource,
)

log = structlog.get_logger("epp.discovery")

__all__ = [
    "SERVICEACCOUNT_NAMESPACE",
    "KubernetesDiscovery",
    "crd_installed",
    "default_namespace",
    "make_api_client",
    "served",
]


@dataclass(slots=True)
class _View:
    """What the loop thread knows, from the reflectors' latest snapshots."""

    pool_synced: bool = False
    pool: PoolSpec | None = None
    pool_problem: str | None = None
    pods: Snapshot | None = None
    models: dict[str, Snapshot] = field(default_factory=dict)  # WatchedResource.key ->


def served(snapshots: Mapping[str, Snapshot], kinds: tuple[WatchedResource, ...]) -> Snapshot:
    """Of one kind's CRDs in order of preference, the first one served (its objects);
    none served: an empty absent snapshot."""
    for resource in kinds:
        snapshot = snapshots.get(resource.key)
        if snapshot is not None and snapshot.present:
            return snapshot
    return Snapshot({}, None, present=False)


class KubernetesDiscovery:
    """Watch one InferencePool and its pods (and the model CRDs, when installed).

    `await start()` on the loop that should receive the callbacks; `await stop()` ends
    the threads (an open watch is cut at once). `synced` is set once the first endpoint
    list was delivered; `state()` is a snapshot of the counters for metrics.

    `standalone` (a `pool.standalone_pool` spec): no InferencePool, the pods of that
    label selector and ports (upstream's `--endpoint-selector`/`--endpoint-target-ports`);
    as upstream, no model CRD is read then.
    """

    def __init__(
        self,
        api_client: k8s.ApiClient,
        pool_name: str,
        namespace: str,
        on_endpoints: Callable[[list[EndpointConfig]], None],
        on_models: Callable[[ModelTable], None] | None = None,
        *,
        settings: WatchSettings | None = None,
        read_models: bool = True,
        pool_group: str = POOL_GROUP,
        standalone: PoolSpec | None = None,
        metrics: MetricsLocation | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pool_name = pool_name
        self.standalone = standalone
        self.metrics = metrics  # where each pod's metrics page is (None: pool.py's default)
        self.pool_group = pool_group
        self.pool_resource = pool_resource(pool_group)  # ValueError for an unknown group
        self._parse_pool = (
            parse_alpha_pool if self.pool_resource == INFERENCE_POOL_V1ALPHA2 else parse_pool
        )
        self.namespace = namespace
        self._on_endpoints = on_endpoints
        self._on_models = on_models
        self._clock = clock
        self.settings = settings or WatchSettings()
        self.synced = asyncio.Event()
        self.endpoints: list[EndpointConfig] = []
        self.models = ModelTable()
        self._delivered_endpoints = False
        self._delivered_models = False
        self._last_sync_unix: float | None = None
        self._view = _View()
        self._lock = threading.Lock()
        self._pending: dict[str, Snapshot] = {}
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._both_served_logged: set[str] = set()
        self._read_models = read_models and standalone is None
        self._pods, self._reflectors = self._make_reflectors(api_client, rng or random.Random())
        if standalone is not None:
            self._view.pool, self._view.pool_synced = standalone, True
            self._pods.set_label_selector(standalone.label_selector)

    def _make_reflectors(
        self, api_client: k8s.ApiClient, rng: random.Random
    ) -> tuple[Reflector, list[Reflector]]:
        """The pods' reflector, and every reflector: the pool (unless standalone), its
        pods, the model CRDs (each asked from API discovery first: optional)."""
        settings = self.settings

        def reflector(resource: WatchedResource, **kwargs: Any) -> Reflector:
            return Reflector(
                resource,
                list_call(api_client, resource, self.namespace),
                lambda snapshot: self._post(resource.key, snapshot),
                settings=settings,
                rng=random.Random(rng.random()),
                **kwargs,
            )

        pods = reflector(POD, needs_label_selector=True)
        reflectors = [pods]
        if self.standalone is None:
            pool_selector = f"metadata.name={self.pool_name}"
            reflectors.insert(0, reflector(self.pool_resource, field_selector=pool_selector))
        if self._read_models:
            for resource in MODEL_RESOURCES:

                def present(r: WatchedResource = resource) -> bool:
                    return crd_installed(api_client, r, settings.request_timeout_s)

                reflectors.append(reflector(resource, present=present))
        return pods, reflectors

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        log.info(
            "discovery_started",
            mode="kubernetes",
            pool=self.pool_name,
            pool_api=None if self.standalone else self.pool_resource.api_version,
            selector=self.standalone.label_selector if self.standalone else None,
            namespace=self.namespace,
            models=self._read_models,
        )
        for r in self._reflectors:
            r.start()

    async def stop(self, timeout_s: float = 5.0) -> None:
        for r in self._reflectors:
            r.stop()

        def join() -> bool:
            deadline = time.monotonic() + timeout_s
            return all(r.join(max(0.0, deadline - time.monotonic())) for r in self._reflectors)

        if not await asyncio.to_thread(join):
            log.warning("discovery_stop_timeout", timeout_s=timeout_s)

    @property
    def pool(self) -> PoolSpec | None:
        """The pool's last valid spec (selector, ports, appProtocol, endpointPickerRef)."""
        return self._view.pool

    def state(self) -> DiscoveryState:
        stats = tuple(r.stats.copy() for r in self._reflectors)
        pool = self._view.pool
        return DiscoveryState(
            mode="kubernetes",
            last_sync_ok=all(s.last_sync_ok for s in stats) and self._view.pool is not None,
            last_sync_unix=self._last_sync_unix,
            endpoints=len(self.endpoints),
            relists=sum(s.relists for s in stats),
            watch_restarts=sum(s.watch_restarts for s in stats),
            errors=sum(s.errors for s in stats),
            resources=stats,
            pool_found=pool is not None,
            problems=(self._view.pool_problem,) if self._view.pool_problem else (),
            pool_api=None if self.standalone else self.pool_resource.api_version,
            app_protocol=pool.app_protocol if pool is not None else None,
            endpoint_picker_ref=(
                pool.endpoint_picker_ref.as_dict()
                if pool is not None and pool.endpoint_picker_ref is not None
                else None
            ),
        )

    # --- from the watch threads ---------------------------------------------------------

    def _post(self, resource: str, snapshot: Snapshot) -> None:
        with self._lock:
            self._pending[resource] = snapshot
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            loop.call_soon_threadsafe(self._drain)

    # --- on the loop --------------------------------------------------------------------

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._scheduled = False
        view = self._view
        if (snapshot := pending.get(self.pool_resource.key)) is not None:
            self._apply_pool(snapshot)
        if (snapshot := pending.get(POD.key)) is not None:
            view.pods = snapshot
        for resource in MODEL_RESOURCES:
            if (snapshot := pending.get(resource.key)) is not None:
                view.models[resource.key] = snapshot
        self._update_endpoints()
        self._update_models()

    def _apply_pool(self, snapshot: Snapshot) -> None:
        view = self._view
        view.pool_synced = True
        obj = snapshot.objects.get(self.pool_name)
        old = view.pool
        if obj is None:
            if old is not None or view.pool_problem is None:
                log.warning(
                    "discovery_pool_not_found", pool=self.pool_name, namespace=self.namespace
                )
            view.pool, view.pool_problem = None, "InferencePool not found"
            self._pods.set_label_selector(None)
            return
        try:
            pool = self._parse_pool(obj)
        except InvalidPool as exc:
            if str(exc) != view.pool_problem:
                log.error("discovery_pool_invalid", error=str(exc), keeping=old is not None)
            view.pool_problem = str(exc)
            return  # keep the last valid spec, if any
        view.pool, view.pool_problem = pool, None
        if old != pool:
            log.info(
                "discovery_pool",
                pool=pool.name,
                selector=pool.label_selector,
                target_ports=list(pool.target_ports),
                app_protocol=pool.app_protocol,
                scheme=pool.scheme,
                endpoint_picker_ref=(
                    pool.endpoint_picker_ref.as_dict() if pool.endpoint_picker_ref else None
                ),
            )
        self._pods.set_label_selector(pool.label_selector)

    def _update_endpoints(self) -> None:
        view = self._view
        if not view.pool_synced:
            return
        if view.pool is None:
            endpoints: list[EndpointConfig] = []
        elif view.pods is None or (
            not self._delivered_endpoints and view.pods.label_selector != view.pool.label_selector
        ):
            return  # the first pod list is on its way
        else:
            endpoints = endpoints_for_pool(view.pool, view.pods.objects.values(), self.metrics)
        if self._delivered_endpoints and endpoints == self.endpoints:
            return
        self.endpoints = endpoints
        self._delivered_endpoints = True
        self._last_sync_unix = self._clock()
        log.info(
            "discovery_endpoints",
            count=len(endpoints),
            endpoints=[e.name for e in endpoints][:32],
        )
        try:
            self._on_endpoints(list(endpoints))
        except Exception:
            log.exception("discovery_on_endpoints_failed")
        self.synced.set()

    def _chosen(self, kinds: tuple[WatchedResource, ...]) -> Snapshot:
        snapshots = self._view.models
        if all(snapshots.get(r.key, Snapshot({}, None, False)).present for r in kinds):
            kind = kinds[0].kind
            if kind not in self._both_served_logged:
                self._both_served_logged.add(kind)
                log.warning(
                    "discovery_crd_in_two_groups",
                    kind=kind,
                    used=kinds[0].api_version,
                    ignored=[r.api_version for r in kinds[1:]],
                )
        return served(snapshots, kinds)

    def _update_models(self) -> None:
        view = self._view
        if not self._read_models or any(r.key not in view.models for r in MODEL_RESOURCES):
            return  # every model CRD listed or known absent first
        objectives, rewrites = self._chosen(OBJECTIVES), self._chosen(REWRITES)
        table = build_model_table(
            view.models[INFERENCE_MODEL.key].objects.values(),
            objectives.objects.values(),
            self.pool_name,
            rewrites=rewrites.objects.values(),
            pool_group=self.pool_group,
        )
        if self._delivered_models and table == self.models:
            return
        for problem in table.problems:
            if problem not in self.models.problems:
                log.warning("discovery_model_skipped", problem=problem)
        self.models = table
        self._delivered_models = True
        log.info(
            "discovery_models",
            models=sorted(table.models),
            objectives=sorted(table.objectives),
            rewrites=sorted(table.rewrites),
            generic_rewrite=table.generic_rewrite.source if table.generic_rewrite else None,
        )
        if self._on_models is not None:
            try:
                self._on_models(table)
            except Exception:
                log.exception("discovery_on_models_failed")
