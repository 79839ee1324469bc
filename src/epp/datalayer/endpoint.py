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
    dispatched_total: int = 0  # sequence number of the last dispatch
    # Dispatch numbers of requests still in flight that the last scraped page cannot show
    # (sent after that fetch began). A request that completed is no longer waiting, so it
    # leaves the set even if no scrape has happened since: fast requests must not pile up.
    unseen_dispatches: set[int] = field(default_factory=set)
    # When the prefills this EPP sent the pod should be over (store clock, seconds),
    # assuming the pod prefills first come, first served. Kept only while the `prefill`
    # scorer has a weight (routing.py); 0.0: nothing sent yet.
    prefill_lane_end: float = 0.0

    # Response path: moving average of 5xx answers.
    error_rate: float = 0.0

    # Derived by the health model after every change.
    health: float = 1.0

    # Derived from the fields above by `refresh()` whenever one of them changes. Plain
    # attributes rather than properties: the scheduler reads each of them once per pod per
    # decision, and with 64+ pods property calls were a third of the scheduling time.
    model: str | None = None
    queue_depth: float = 0.0  # last scraped waiting + what the EPP sent since that scrape
    kv_usage: float = 0.0  # clamped to [0, 1]
    adapters: frozenset[str] = frozenset()  # running or waiting LoRA adapters

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        m = self.metrics
        self.model = self.configured_model or (m.model if m is not None else None)
        waiting = m.waiting if m is not None else 0.0
        self.queue_depth = waiting + len(self.unseen_dispatches)
        usage = m.kv_usage if m is not None else 0.0
        self.kv_usage = 0.0 if usage < 0.0 else 1.0 if usage > 1.0 else usage
        self.adapters = (m.running_adapters | m.waiting_adapters) if m is not None else frozenset()

    def has_adapter(self, adapter: str) -> bool:
        return adapter in self.adapters
