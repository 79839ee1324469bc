"""The set of known endpoints and every change to their state, in one place.

Every change enters here: discovery (`sync`), pages (`scraped`, `scrape_failed`, called
by the scraper only), reservations and their ends (`dispatched`, `completed`,
`record_status`: the router's accounting only; `peer_dispatched`: replicas/inbox.py only)
and the clock (`refresh_health`). The store writes the fields it owns and leaves the
ledger of dispatches to datalayer/ledger.py and the health fields to datalayer/health.py;
Endpoint's docstring has the table, tests/test_ownership.py enforces it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from epp.config import DataLayerConfig, EndpointConfig, EppConfig
from epp.datalayer import ledger
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.health import (
    apply_floor,
    assess,
    failure_seen,
    is_stale,
    page_fetched,
    response_seen,
)
from epp.datalayer.metrics_parser import PodMetrics

EndpointListener = Callable[[str, Endpoint], None]

log = structlog.get_logger("epp.datalayer")
# A model's panic is logged at most once in this many seconds (it may flap with health).
PANIC_LOG_EVERY_S = 10.0


@dataclass(slots=True)
class FloorStats:
    """What the floor under exclusion did (exported as epp_health_panic*_total)."""

    panics: int = 0  # times a model entered panic
    panic_requests: int = 0  # requests dispatched to a model in panic


# KV usage at which a pod's waiting requests are blamed on its KV cache, not its slots.
KV_FULL = 0.9


class EndpointStore:
    def __init__(
        self,
        config: DataLayerConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        health_threshold: float = 0.3,
        running_slots: int | None = None,
        peer_ttl_s: float = 5.0,
        dispatch_transit_s: float = ledger.DISPATCH_TRANSIT_S,
        max_error_exclusion_share: float = 0.5,
        healthy_panic_share: float = 0.0,
        health_panic: bool = True,
    ):
        self._config = config
        self._clock = clock
        self._threshold = health_threshold
        self._max_error_share = max_error_exclusion_share
        self._panic_share = healthy_panic_share
        self._panic_enabled = health_panic
        # The latest fetch of any pod's page: failures and staleness of a pod count only
        # against evidence that the EPP could reach pods meanwhile (datalayer/health.py).
        self._reached_at = float("-inf")
        self._max_unconfirmed = math.ceil(1.0 / config.failure_health_step) + 1
        # name -> the model whose floor last counted the pod; models in panic.
        self._grouped: dict[str, str | None] = {}
        self._panicking: set[str | None] = set()
        self._panic_logged_at: dict[str | None, float] = {}
        self.floor_stats = FloorStats()
        self._slots = running_slots
        self._peer_ttl = peer_ttl_s
        self._transit = dispatch_transit_s
        self._by_name: dict[str, Endpoint] = {}
        self._by_address: dict[str, Endpoint] = {}
        self._listeners: list[EndpointListener] = []
        self._staleness_counts = True

    @classmethod
    def for_config(
        cls,
        config: EppConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        dispatch_transit_s: float = ledger.DISPATCH_TRANSIT_S,
    ) -> EndpointStore:
        """The store as the EPP's configuration asks: health hysteresis and pod slots.
        `dispatch_transit_s`: how long a dispatch takes to show on the pod's page
        (ledger.DISPATCH_TRANSIT_S; 0 where requests reach the pod at once, as in the
        virtual-time benchmark)."""
        return cls(
            config.datalayer,
            clock,
            health_threshold=config.scheduling.health_threshold,
            running_slots=config.scheduling.running_slots,
            peer_ttl_s=config.replicas.load_ttl_s,
            dispatch_transit_s=dispatch_transit_s,
            max_error_exclusion_share=config.scheduling.max_error_exclusion_share,
            healthy_panic_share=config.scheduling.healthy_panic_share,
            health_panic=config.scheduling.health_panic,
        )

    # -- membership -------------------------------------------------------------
    def on_change(self, listener: EndpointListener) -> None:
        """listener(event, endpoint) with event in added / removed / updated / reset /
        released (in-flight work of the pod went down: room for queued requests)."""
        self._listeners.append(listener)

    def _emit(self, event: str, endpoint: Endpoint) -> None:
        for listener in self._listeners:
            listener(event, endpoint)

    def sync(self, configs: Iterable[EndpointConfig]) -> None:
        """Make the set equal to `configs` (discovery), keeping state of pods that stay."""
        wanted = {c.name: c for c in configs}
        for name in [n for n in self._by_name if n not in wanted]:
            endpoint = self._by_name.pop(name)
            self._by_address.pop(endpoint.address, None)
            self._regroup(endpoint)
            self._emit("removed", endpoint)
        for name, config in wanted.items():
            current = self._by_name.get(name)
            if current is not None and current.address == config.address:
                current.labels = dict(config.labels)
                current.metrics_url = config.resolved_metrics_url()
                current.configured_model = config.model
                current.refresh()
                self._set_health(current, self._clock())  # its model may have changed
                continue
            if current is not None:
                self._by_address.pop(current.address, None)
                del self._by_name[name]
                self._regroup(current)
                self._emit("removed", current)
            now = self._clock()
            endpoint = Endpoint(
                name=name,
                address=config.address,
                metrics_url=config.resolved_metrics_url(),
                labels=dict(config.labels),
                configured_model=config.model,
                configured_slots=self._slots,
            )
            self._by_name[name] = endpoint
            self._set_health(endpoint, now)
            self._by_address[config.address] = endpoint
            self._emit("added", endpoint)

    def all(self) -> list[Endpoint]:
        return list(self._by_name.values())

    def get(self, name: str) -> Endpoint | None:
        return self._by_name.get(name)

    def by_address(self, address: str) -> Endpoint | None:
        return self._by_address.get(address)

    def __len__(self) -> int:
        return len(self._by_name)

    def now(self) -> float:
        """The store's clock (monotonic, or virtual in benchmarks and tests): callers that
        keep times on endpoints use it so that those times compare with the store's."""
        return self._clock()

    @property
    def staleness_counts(self) -> bool:
        """False while no pod has fresh metrics (see health.py): nobody is excluded for it."""
        return self._staleness_counts

    def _set_health(self, endpoint: Endpoint, now: float) -> None:
        changed = assess(endpoint, now, self._config, self._reached_at, self._threshold)
        grouped = self._grouped
        if changed or endpoint.name not in grouped or grouped[endpoint.name] != endpoint.model:
            self._regroup(endpoint)

    def _regroup(self, endpoint: Endpoint) -> None:
        """Re-apply the floor of the pod's model (and of the model it had before); the pod
        may have left the store."""
        had = endpoint.name in self._grouped
        before = self._grouped.pop(endpoint.name, None)
        present = self._by_name.get(endpoint.name) is endpoint
        if present:
            self._grouped[endpoint.name] = endpoint.model
            self._apply_floor(endpoint.model)
        if had and (not present or before != endpoint.model):
            self._apply_floor(before)

    def _apply_floor(self, model: str | None) -> None:
        pods = [e for e in self._by_name.values() if e.model == model]
        panic = apply_floor(pods, self._max_error_share, self._panic_share, self._panic_enabled)
        if panic == (model in self._panicking):
            return
        now = self._clock()
        if panic:
            self._panicking.add(model)
            self.floor_stats.panics += 1
        else:
            self._panicking.discard(model)
        if panic and now - self._panic_logged_at.get(model, float("-inf")) >= PANIC_LOG_EVERY_S:
            self._panic_logged_at[model] = now
            log.warning(
                "health_panic",
                model=model,
                pods=len(pods),
                down=sum(1 for e in pods if e.down),
                unhealthy=sum(1 for e in pods if e.unhealthy),
                detail="too few routable pods: routing to all pods of the model",
            )
        elif not panic and pods:
            log.info("health_panic_over", model=model, pods=len(pods))

    # -- data-layer updates --------------------------------------------------------
    def scraped(
        self,
        endpoint: Endpoint,
        metrics: PodMetrics,
        dispatched_at_start: int | None = None,
        fetch_began_at: float | None = None,
    ) -> None:
        """A page fetched; `dispatched_at_start` is `dispatched_total` and `fetch_began_at`
        the store's clock when the fetch began (default: now). The pod may have rendered
        the page as soon as the fetch began, so requests sent during the fetch, or less
        than `dispatch_transit_s` before it began, may not be on it yet: they stay
        counted (ledger.page_seen)."""
        previous = endpoint.metrics
        now = self._clock()
        endpoint.metrics = metrics
        endpoint.metrics_at = now
        self._reached_at = now
        endpoint.consecutive_failures = 0
        page_fetched(endpoint)
        endpoint.last_error = None
        if dispatched_at_start is None:
            dispatched_at_start = endpoint.dispatched_total
        fetched_at = now if fetch_began_at is None else min(fetch_began_at, now)
        ledger.page_seen(endpoint, dispatched_at_start, fetched_at, self._transit)
        self._learn(endpoint, previous, metrics, now)
        released = ledger.reconcile(endpoint, int(metrics.running + metrics.waiting), now)
        endpoint.refresh()
        self._set_health(endpoint, now)
        # The engine restarted, so its cache is gone: its counters went backwards, or the
        # server's start time changed (even if the new process's counters have already
        # passed the old ones between two pages).
        if previous is not None and restarted(previous, metrics):
            self._emit("reset", endpoint)
        self._emit("updated", endpoint)
        if released:
            self._emit("released", endpoint)

    def _learn(
        self, endpoint: Endpoint, previous: PodMetrics | None, metrics: PodMetrics, now: float
    ) -> None:
        # Requests wait when the pod cannot run more: with KV room to spare, the running
        # count is its slots (max_num_seqs). A pod out of KV queues at any running count;
        # its KV usage already says it is full, and learning slots from it would make
        # every later dispatch look like waiting.
        model = endpoint.configured_model or metrics.model
        if metrics.waiting > 0 and metrics.running >= 1 and metrics.kv_usage < KV_FULL:
            running = int(metrics.running)
            if endpoint.learned_slots is None or running > endpoint.learned_slots:
                endpoint.learned_slots = running
                self._share_slots(endpoint, model)
        elif endpoint.learned_slots is None and endpoint.pool_slots is None:
            endpoint.pool_slots = self._pool_slots(model)
        for adapter in metrics.running_adapters | metrics.waiting_adapters:
            endpoint.adapters_seen[adapter] = now
        memory = self._config.adapter_memory_s
        for adapter, seen in list(endpoint.adapters_seen.items()):
            if now - seen > memory:
                del endpoint.adapters_seen[adapter]
        # Frozen gauges: work shown, nothing generated, nothing of ours in flight. A page
        # without vLLM's generation counter (another model server) never looks frozen.
        if (
            previous is None
            or metrics.generation_tokens is None
            or metrics.generation_tokens != previous.generation_tokens
            or endpoint.progress_at is None
        ):
            endpoint.progress_at = now
        busy_looking = metrics.running > 0 or metrics.waiting > 0 or metrics.kv_usage > 0
        endpoint.gauges_frozen = (
            busy_looking
            and endpoint.in_flight == 0
            and not endpoint.peer
            and now - endpoint.progress_at > self._config.frozen_gauges_after_s
        )

    def _pool_slots(self, model: str | None) -> int | None:
        learned = [
            e.learned_slots
            for e in self._by_name.values()
            if e.learned_slots is not None and e.model == model
        ]
        return max(learned) if learned else None

    def _share_slots(self, source: Endpoint, model: str | None) -> None:
        """A pod learned its slots: its peers that have not learned theirs use them."""
        for endpoint in self._by_name.values():
            if (
                endpoint is not source
                and endpoint.learned_slots is None
                and endpoint.model == model
                and (endpoint.pool_slots or 0) < (source.learned_slots or 0)
            ):
                endpoint.pool_slots = source.learned_slots
                endpoint.refresh()

    def scrape_failed(self, endpoint: Endpoint, error: str) -> None:
        now = self._clock()
        endpoint.consecutive_failures += 1
        failure_seen(endpoint, now, self._max_unconfirmed)
        endpoint.last_error = error
        self._set_health(endpoint, now)
        self._emit("updated", endpoint)

    def refresh_health(self) -> None:
        """Re-derive health from the clock (staleness grows, errors decay, in-flight
        entries expire even when nothing happens)."""
        now = self._clock()
        endpoints = self._by_name.values()
        scraped = [e for e in endpoints if e.metrics_at is not None]
        self._staleness_counts = not scraped or any(
            not is_stale(e, now, self._config) for e in scraped
        )
        ttl = self._config.in_flight_ttl_s
        for endpoint in endpoints:
            expired = ledger.expire(endpoint, now, ttl, self._peer_ttl)
            if expired:
                endpoint.refresh()
            self._set_health(endpoint, now)
            if expired:
                self._emit("released", endpoint)

    # -- request lifecycle ---------------------------------------------------------
    def dispatched(self, endpoint: Endpoint, tokens: int = 0) -> int:
        """A request was sent to the pod; returns its dispatch number for `completed`.
        The pod's load figures include it at once, for the very next decision."""
        seq = ledger.reserve(endpoint, tokens, self._clock())
        if endpoint.panic:
            self.floor_stats.panic_requests += 1
        endpoint.refresh()
        return seq

    def peer_dispatched(self, endpoint: Endpoint, tokens: int = 0) -> None:
        """A peer replica sent a request to the pod (epp/replicas). Its load figures include
        it from its arrival here until a page fetched after that shows it, or for at most
        `peer_ttl_s`: the EPP never hears of its end."""
        ledger.reserve_for_peer(endpoint, tokens, self._clock())
        endpoint.refresh()

    def completed(
        self, endpoint: Endpoint, status: int | None, dispatch: int | None
    ) -> float | None:
        """The request numbered `dispatch` ended with `status` (None: no response seen).
        Returns its time since dispatch, or None if it was no longer open (released by a
        page that showed it over, expired, or never dispatched)."""
        entry = ledger.release(endpoint, dispatch) if dispatch is not None else None
        took = None
        if entry is not None:
            endpoint.refresh()
            took = max(0.0, self._clock() - entry.at)
        self.record_status(endpoint, status)
        if entry is not None:
            self._emit("released", endpoint)
        return took

    def record_status(self, endpoint: Endpoint, status: int | None) -> None:
        if status is None:
            return
        now = self._clock()
        response_seen(endpoint, status, now, self._config)
        self._set_health(endpoint, now)


def restarted(previous: PodMetrics, metrics: PodMetrics) -> bool:
    """Whether two consecutive pages of a pod come from different server processes: its
    counters went back, or it started later than any start time seen before. The page
    keeps that latest start time (`metrics.start_time` is updated), so that a page without
    the series, or one from an older process answering on the same address (several API
    server processes behind one port), is not a restart, nor is the page after it."""
    before, now = previous.start_time, metrics.start_time
    if before is not None and (now is None or now < before):
        metrics.start_time = before
    if metrics.prefix_queries < previous.prefix_queries:
        return True
    return before is not None and now is not None and now > before
