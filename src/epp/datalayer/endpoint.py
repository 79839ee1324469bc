"""One pod as the scheduler sees it: identity plus the freshest signals.

The data layer owns these objects and updates them in place (scrapes, dispatches,
completions); the scheduler reads them synchronously within one decision. All of it runs
on the event loop's thread, so a decision never sees a half-applied update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.datalayer.metrics_parser import PodMetrics


@dataclass(slots=True, eq=False)
class Endpoint:
    name: str
    address: str  # ip:port, as Envoy dials it
    metrics_url: str
    labels: dict[str, str] = field(default_factory=dict)
    configured_model: str | None = None

    # Scraped (vllm /metrics).
    metrics: PodMetrics | None = None
    metrics_at: float | None = None  # monotonic time of the last good scrape
    consecutive_failures: int = 0
    last_error: str | None = None

    # Counted by the EPP itself: metrics lag by up to a scrape interval, and a burst of
    # decisions inside that interval must see its own effect.
    in_flight: int = 0
    dispatched_total: int = 0
    dispatched_since_scrape: int = 0

    # Response path: moving average of 5xx answers.
    error_rate: float = 0.0

    # Derived by the health model after every change.
    health: float = 1.0

    @property
    def model(self) -> str | None:
        if self.configured_model:
            return self.configured_model
        return self.metrics.model if self.metrics else None

    @property
    def queue_depth(self) -> float:
        """Waiting requests: the last scrape plus what the EPP sent since it."""
        waiting = self.metrics.waiting if self.metrics else 0.0
        return waiting + self.dispatched_since_scrape

    @property
    def kv_usage(self) -> float:
        return self.metrics.kv_usage if self.metrics else 0.0

    def has_adapter(self, adapter: str) -> bool:
        m = self.metrics
        return m is not None and (adapter in m.running_adapters or adapter in m.waiting_adapters)
