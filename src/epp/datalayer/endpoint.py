"""One pod as the scheduler sees it: identity, the freshest scraped signals, and the EPP's
own count of what it sent there.

The data layer owns these objects and updates them in place (scrapes, dispatches,
completions); the scheduler reads them synchronously within one decision. All of it runs
on the event loop's thread, so a decision never sees a half-applied update.

Load between scrapes. Metrics lag by up to a scrape interval, and every request of a burst
would see the same snapshot (the field's herding bug). So each dispatch is reserved at
pick time and `refresh()` re-derives the load figures at once:

    concurrency = scraped running + waiting + dispatched since that page
                  (the EPP's own in-flight count while the gauges are stale or frozen)
                  + what peer replicas dispatched since that page (epp/replicas)
    queue_depth = scraped waiting + dispatched beyond the pod's free running slots
    busy        = concurrency / running slots                (0 while slots are unknown)

A dispatched request is *waiting* only beyond what the pod can run: ten requests sent to
an idle pod with 256 slots queue nowhere. Slots come from configuration, or are learned as
the running count the pod reported while requests were waiting (with KV room to spare), or
are taken from another pod of the same model that learned them.

Peer replicas (epp/replicas) tell this one of their dispatches. Each is numbered in the
same sequence as this EPP's own (`dispatched_total`, in order of arrival here), so "sent
since that page" covers both: a page whose fetch began after a peer's dispatch arrived
includes it and drops it from `peer`. The EPP never hears of its completion, so it
counts only until then (or `peer_ttl_s` of the store while no page comes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from epp.datalayer.metrics_parser import PodMetrics


@dataclass(slots=True)
class Dispatch:
    """One request the EPP sent to the pod and has not seen complete."""

    seq: int
    tokens: int  # prompt tokens the pod must compute (not in its cache, as far as we know)
    at: float  # store clock


@dataclass(slots=True, eq=False)
class Endpoint:
    name: str
    address: str  # ip:port, as Envoy dials it
    metrics_url: str
    labels: dict[str, str] = field(default_factory=dict)
    configured_model: str | None = None
    configured_slots: int | None = None

    # Scraped (vllm /metrics).
    metrics: PodMetrics | None = None
    metrics_at: float | None = None  # store time of the last good scrape
    consecutive_failures: int = 0
    # Of those, the failures held against the pod: another pod's page was fetched after
    # them, so the EPP could reach pods (datalayer/health.py). The others wait in
    # `unconfirmed_failures` (their store times, oldest first; a few at most).
    charged_failures: int = 0
    unconfirmed_failures: deque[float] = field(default_factory=deque)
    last_error: str | None = None
    # False while the gauges cannot be trusted (stale page, frozen gauges): load then comes
    # from the EPP's own counts only, so old numbers never keep a pod "full" for ever.
    gauges_valid: bool = True
    gauges_frozen: bool = False
    progress_at: float | None = None  # last time the pod's generated-token counter moved
    learned_slots: int | None = None
    # Learned by another pod serving the same model: pods of a pool are alike, and a pod
    # whose own page has not shown a queue yet must not look endlessly roomy.
    pool_slots: int | None = None
    # adapter -> last time the pod reported it (running or waiting)
    adapters_seen: dict[str, float] = field(default_factory=dict)

    # Counted by the EPP itself.
    open: dict[int, Dispatch] = field(default_factory=dict)  # seq -> dispatch, oldest first
    dispatched_total: int = 0  # sequence number of the last dispatch
    seen_through: int = 0  # dispatches up to this seq were sent before the last page's fetch
    in_flight: int = 0
    in_flight_tokens: int = 0
    # Every uncached prompt token ever sent here: the long-run share of work, which places
    # new prefixes evenly when pods are otherwise equal (idle between conversation turns).
    # Peer replicas' dispatches count too.
    dispatched_tokens: int = 0
    # Peer replicas' dispatches no page has shown yet, oldest first (numbered like `open`).
    peer: deque[Dispatch] = field(default_factory=deque)

    # Response path: moving average of 5xx answers, decaying with time.
    error_rate: float = 0.0
    error_at: float = 0.0

    # Derived by the health model after every change (datalayer/health.py): `down` (failed
    # scrapes or stale metrics alone put it below the threshold), `unhealthy` (health with
    # hysteresis says exclude), `excluded` (what routing obeys, after the floor of its
    # model) and `panic` (its model has too few routable pods: routed to anyway).
    health: float = 1.0
    down: bool = False
    unhealthy: bool = False
    excluded: bool = False
    panic: bool = False

    # Derived from the fields above by `refresh()` whenever one of them changes. Plain
    # attributes rather than properties: the scheduler reads each of them once per pod per
    # decision, and with 64+ pods property calls were a third of the scheduling time.
    model: str | None = None
    concurrency: float = 0.0
    queue_depth: float = 0.0
    kv_usage: float = 0.0  # clamped to [0, 1]
    load: float = 0.0  # max(KV usage, busy fraction), in [0, 1]
    adapters: frozenset[str] = frozenset()  # adapters resident as far as we know
    max_loras: int | None = None

    def __post_init__(self) -> None:
        self.refresh()

    @property
    def slots(self) -> int | None:
        return self.configured_slots or self.learned_slots or self.pool_slots

    def refresh(self) -> None:
        m = self.metrics
        self.model = self.configured_model or (m.model if m is not None else None)
        page = m if self.gauges_valid and not self.gauges_frozen else None  # trusted gauges
        gauges = page is not None
        running = page.running if page is not None else 0.0
        waiting = page.waiting if page is not None else 0.0
        unseen = 0
        if self.dispatched_total > self.seen_through:
            through = self.seen_through
            unseen = sum(1 for seq in self.open if seq > through)
        peer = len(self.peer)  # pruned by every page: all of them are unseen
        unseen += peer
        on_pod = running + unseen
        # A valid page plus what was sent since is the truth, also for traffic from other
        # routers; the EPP's own in-flight count stands in only while the gauges cannot be
        # trusted (a completion it never hears of, behind a gateway without the observer
        # filter or with several EPP replicas, must not keep a pod looking busy).
        self.concurrency = on_pod + waiting if gauges else float(max(self.in_flight + peer, unseen))
        slots = self.slots
        if slots:
            beyond = max(0.0, self.concurrency - waiting - slots)
            self.queue_depth = waiting + beyond
            busy = min(1.0, self.concurrency / slots)
        else:
            self.queue_depth = waiting
            busy = 0.0
        usage = page.kv_usage if page is not None else 0.0
        usage = 0.0 if usage < 0.0 else 1.0 if usage > 1.0 else usage
        self.kv_usage = usage
        self.load = usage if usage > busy else busy
        self.adapters = frozenset(self.adapters_seen)
        self.max_loras = m.max_loras if m is not None else None

    def has_adapter(self, adapter: str) -> bool:
        return adapter in self.adapters
