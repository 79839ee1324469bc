"""The one place where the EPP's parts are connected, in the order the data flows.

Nothing subscribes itself. The endpoint store has one listener, `endpoint_events`, which
hands each event to its readers in this order:

    store --added/removed------------------> 1. scraper (one scrape loop per pod)
    store --removed/reset/updated----------> 2. prefix index (forget a pod, clear its
                                                cache unless precise mode owns it, size
                                                it from its page)
    store --added/updated/reset/removed----> 3. precise mode (one KV-event subscriber per
                                                pod that publishes: kv_events_wiring)
    store --removed/released/updated/added-> 4. router (forget a pod's requests and
                                                scorer state; waiting requests get room)

Why this order: a reset of a pod that precise mode follows is precise mode's to decide
(its subscriber may already have rebuilt the entries from the new process), so the index
leaves it (2 asks `owns_entries`) and precise mode, after it, decides (3). The router
comes last: when it releases waiting requests, the index and precise mode already
reflect the event.

The router's decisions go, through its hooks (epp.routing.types.DecisionHooks), to the
scraper (a dispatch to a pod, this router's or a peer's, wakes its idle scrape loop), to
precise mode (a decision on a precise pod opens a stale-routing claim before its blocks
are recorded; the claim is checked after the response ended) and, with
`replicas.peers`, to the peer replicas (epp/replicas: ReplicaSync connects its hooks).
"""

from __future__ import annotations

import structlog

from epp.config import EppConfig, PrefixConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointListener, EndpointStore
from epp.prefix.index import PrefixIndex
from epp.routing import Router

log = structlog.get_logger("epp.app")


def connect(
    store: EndpointStore,
    index: PrefixIndex,
    router: Router,
    config: EppConfig,
    precise: PreciseMode | None = None,
    *,
    scraper: MetricsScraper | None = None,
) -> None:
    """Connect the store's events to their readers and the router's decisions to precise
    mode (module docstring). Whatever builds a Router calls it once: the service, the
    virtual-time and overhead benchmarks, the tests' `router_with`."""
    store.on_change(endpoint_events(index, router, config.prefix, precise, scraper))
    if scraper is not None:
        # A request to a pod ends its idle interval: this router's or a peer's.
        wake = scraper.wake
        router.hooks.shared.append(lambda dispatched, _uncached: wake(dispatched.endpoint.name))
        router.hooks.peer_dispatched.append(wake)
    if precise is not None:
        if scraper is not None:
            # A pod whose events stopped needs its pages at the fast interval again.
            precise.precise.detached.append(scraper.wake)
        router.hooks.before_record.append(precise.precise.dispatched)
        router.hooks.completed.append(precise.precise.completed)


def endpoint_events(
    index: PrefixIndex,
    router: Router,
    prefix: PrefixConfig,
    precise: PreciseMode | None = None,
    scraper: MetricsScraper | None = None,
) -> EndpointListener:
    """The store's one listener: each event to its readers, in the module's order."""
    to_index = index_listener(index, prefix, precise)

    def on_change(event: str, endpoint: Endpoint) -> None:
        if scraper is not None:
            scraper.on_endpoint_change(event, endpoint)
        to_index(event, endpoint)
        if precise is not None:
            precise.on_change(event, endpoint)
        router.on_endpoint_change(event, endpoint)

    return on_change


def index_listener(
    index: PrefixIndex, config: PrefixConfig, precise: PreciseMode | None = None
) -> EndpointListener:
    """What the endpoint store's events change in the prefix index: a removed pod is
    forgotten, a restarted engine (reset) has an empty cache, and with
    `use_reported_capacity` a pod's capacity is the KV size its page reports (in our
    blocks), bounded by `capacity_per_pod`. A reset of a pod that `precise` follows
    precisely is left to it (`endpoint_events` calls it after this)."""

    def on_change(event: str, endpoint: Endpoint) -> None:
        if event == "removed":
            index.remove_pod(endpoint.name)
        elif event == "reset":
            if precise is not None and precise.owns_entries(endpoint.name):
                return  # PreciseMode.on_change decides (and logs) for this pod
            index.clear_pod(endpoint.name)
            log.info("pod_cache_reset", pod=endpoint.name)
        elif event == "updated" and config.use_reported_capacity:
            _size_from_page(index, config, endpoint)

    return on_change


def _size_from_page(index: PrefixIndex, config: PrefixConfig, endpoint: Endpoint) -> None:
    metrics = endpoint.metrics
    if metrics is None or not metrics.num_gpu_blocks or not metrics.block_size:
        return
    if index.is_precise(endpoint.name):
        # A precise pod's entries are the engine's blocks: count in those.
        index.set_capacity(endpoint.name, metrics.num_gpu_blocks)
    else:
        # The pod's blocks may differ in size from ours: convert to our blocks.
        index.set_capacity(
            endpoint.name, metrics.num_gpu_blocks * metrics.block_size // config.block_size
        )
