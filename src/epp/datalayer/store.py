"""The set of known endpoints and every change to their state, in one place."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from epp.config import DataLayerConfig, EndpointConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.health import compute_health
from epp.datalayer.metrics_parser import PodMetrics


class EndpointStore:
    def __init__(self, config: DataLayerConfig, clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._clock = clock
        self._by_name: dict[str, Endpoint] = {}
        self._by_address: dict[str, Endpoint] = {}
        self._listeners: list[Callable[[str, Endpoint], None]] = []

    # -- membership -------------------------------------------------------------
    def on_change(self, listener: Callable[[str, Endpoint], None]) -> None:
        """listener(event, endpoint) with event in added / removed / updated / reset."""
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
            self._emit("removed", endpoint)
        for name, config in wanted.items():
            current = self._by_name.get(name)
            if current is not None and current.address == config.address:
                current.labels = dict(config.labels)
                current.metrics_url = config.resolved_metrics_url()
                current.configured_model = config.model
                current.refresh()
                continue
            if current is not None:
                self._by_address.pop(current.address, None)
                self._emit("removed", current)
            endpoint = Endpoint(
                name=name,
                address=config.address,
                metrics_url=config.resolved_metrics_url(),
                labels=dict(config.labels),
                configured_model=config.model,
            )
            endpoint.health = compute_health(endpoint, self._clock(), self._config)
            self._by_name[name] = endpoint
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

    # -- data-layer updates --------------------------------------------------------
    def scraped(
        self, endpoint: Endpoint, metrics: PodMetrics, dispatched_at_start: int | None = None
    ) -> None:
        """A page fetched; `dispatched_at_start` is `dispatched_total` when the fetch began:
        requests sent during the fetch may not be on the page yet, so they stay counted."""
        previous = endpoint.metrics
        now = self._clock()
        endpoint.metrics = metrics
        endpoint.metrics_at = now
        endpoint.consecutive_failures = 0
        endpoint.last_error = None
        if dispatched_at_start is None:
            dispatched_at_start = endpoint.dispatched_total
        # Sent before the fetch began: on this page (running or waiting) or already done.
        endpoint.unseen_dispatches = {
            seq for seq in endpoint.unseen_dispatches if seq > dispatched_at_start
        }
        endpoint.refresh()
        endpoint.health = compute_health(endpoint, now, self._config)
        # Counters going backwards mean the engine restarted: its cache is gone.
        if previous is not None and metrics.prefix_queries < previous.prefix_queries:
            self._emit("reset", endpoint)
        self._emit("updated", endpoint)

    def scrape_failed(self, endpoint: Endpoint, error: str) -> None:
        endpoint.consecutive_failures += 1
        endpoint.last_error = error
        endpoint.health = compute_health(endpoint, self._clock(), self._config)
        self._emit("updated", endpoint)

    def refresh_health(self) -> None:
        """Re-derive health from the clock (staleness grows even when nothing happens)."""
        now = self._clock()
        for endpoint in self._by_name.values():
            endpoint.health = compute_health(endpoint, now, self._config)

    # -- request lifecycle ---------------------------------------------------------
    def dispatched(self, endpoint: Endpoint) -> int:
        """A request was sent to the pod; returns its dispatch number for `completed`."""
        endpoint.in_flight += 1
        endpoint.dispatched_total += 1
        endpoint.unseen_dispatches.add(endpoint.dispatched_total)
        endpoint.queue_depth += 1
        return endpoint.dispatched_total

    def prefill_dispatched(self, endpoint: Endpoint, seconds: float, now: float) -> None:
        """A prefill of `seconds` was queued on the pod at `now`: it starts when the pod's
        earlier prefills are over (first come, first served), or at once if they are."""
        lane_end = endpoint.prefill_lane_end
        endpoint.prefill_lane_end = (now if now > lane_end else lane_end) + seconds

    def completed(
        self, endpoint: Endpoint, status: int | None, dispatch: int | None = None
    ) -> None:
        endpoint.in_flight = max(0, endpoint.in_flight - 1)
        if dispatch is not None and dispatch in endpoint.unseen_dispatches:
            endpoint.unseen_dispatches.discard(dispatch)
            endpoint.queue_depth -= 1
        if status is not None:
            failed = 1.0 if status >= 500 else 0.0
            alpha = self._config.error_rate_alpha
            endpoint.error_rate += alpha * (failed - endpoint.error_rate)
            endpoint.health = compute_health(endpoint, self._clock(), self._config)
