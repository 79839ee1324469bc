"""One pod as the scheduler sees it: identity, the freshest scraped signals, and the EPP's
own count of what it sent there.

The data layer owns these objects and updates them in place (scrapes, dispatches,
completions); the scheduler reads them synchronously within one decision. All of it runs
on the event loop's thread, so a decision never sees a half-applied update. Each field has
one writing module, named in `FIELD_OWNERS` below (the table and the reasons are in
`Endpoint`'s docstring; tests/test_ownership.py enforces it); everybody else reads, and
scheduling reads through `EndpointView`.

Load between scrapes. Metrics lag by up to a scrape interval, and every request of a burst
would see the same snapshot and herd onto the pod it shows least loaded. So each dispatch
is reserved at pick time and `refresh()` re-derives the load figures at once:

    concurrency = scraped running + waiting + dispatched since that page (or too shortly
                  before it to be on it: datalayer/ledger.py, DISPATCH_TRANSIT_S)
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
since that page" covers both: a page whose fetch began after a peer's dispatch arrived,
and at least the transit grace after it (datalayer/ledger.py, `DISPATCH_TRANSIT_S`),
includes it and drops it from `peer`. The EPP never hears of its completion, so it
counts only until then (or `peer_ttl_s` of the store while no page comes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Protocol

from epp.datalayer.metrics_parser import PodMetrics


@dataclass(slots=True)
class Dispatch:
    """One request the EPP sent to the pod and has not seen complete."""

    seq: int
    tokens: int  # prompt tokens the pod must compute (not in its cache, as far as we know)
    at: float  # store clock


@dataclass(slots=True, eq=False)
class Endpoint:
    """Who writes which field. One module per field; all others read. A module that needs
    a field changed calls the store (datalayer/store.py), which applies the change through
    the field's owner; it never assigns the field.

    ============================  =====================  ===================================
    fields                        owner                  why
    ============================  =====================  ===================================
    name, address, metrics_url,   datalayer/store.py     discovery says what the pod is;
    labels, configured_model,     (`sync`)               `sync` is the one place a pod is
    configured_slots                                     created, updated and removed
    metrics, metrics_at,          datalayer/store.py     what the pod's pages say, and what
    consecutive_failures,         (`scraped`,            is learned from a pool's pages
    last_error, progress_at,      `scrape_failed`;       (slots, frozen gauges, adapters);
    gauges_frozen, learned_slots, datalayer/scraper.py   the scraper fetches and parses,
    pool_slots, adapters_seen     fetches the pages)     the store applies
    open, dispatched_total,       datalayer/ledger.py    one ledger of what was sent where:
    in_flight, in_flight_tokens,  (called by the store:  a reservation is released by its
    dispatched_tokens, peer,      `dispatched`,          completion, by a page that shows
    seen_through                  `completed`,           it over, or by its TTL, and all
                                  `peer_dispatched`,     three must agree on one `open`.
                                  a page, the clock)     The store's callers: the router's
                                                         accounting (reservations and
                                                         their ends), replicas/inbox.py
                                                         (peers' reservations)
    charged_failures,             datalayer/health.py    the health model (see there):
    unconfirmed_failures,                                its inputs beyond the page and its
    error_rate, error_at,                                verdicts, which routing obeys; the
    health, down, unhealthy,                             store says when, health.py how
    excluded, panic, gauges_valid
    model, concurrency,           datalayer/endpoint.py  derived from the fields above by
    queue_depth, kv_usage, load,  (`refresh`)            `refresh()`, which each owner calls
    adapters, max_loras                                  after changing one of its inputs
    ============================  =====================  ===================================

    Scorers, filters and pickers only read (`EndpointView`); a scorer that needs per-pod
    state of its own keeps it itself (scheduling/types.py, PodStateScorer). Constructing
    an Endpoint sets every field, so only the store constructs them.
    """

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
    seen_through: int = 0  # dispatches up to this seq may be on the last page (ledger.py)
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
    # decision, and at 64+ pods property calls would be a third of the scheduling time.
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


STORE: Final = "epp.datalayer.store"
LEDGER: Final = "epp.datalayer.ledger"
HEALTH: Final = "epp.datalayer.health"
DERIVED: Final = "epp.datalayer.endpoint"

# field -> the one module that assigns it (the table in Endpoint's docstring says why).
FIELD_OWNERS: Final[Mapping[str, str]] = MappingProxyType(
    {
        # Discovery.
        "name": STORE,
        "address": STORE,
        "metrics_url": STORE,
        "labels": STORE,
        "configured_model": STORE,
        "configured_slots": STORE,
        # Pages, and what is learned from them.
        "metrics": STORE,
        "metrics_at": STORE,
        "consecutive_failures": STORE,
        "last_error": STORE,
        "progress_at": STORE,
        "gauges_frozen": STORE,
        "learned_slots": STORE,
        "pool_slots": STORE,
        "adapters_seen": STORE,
        # The ledger of what was sent where.
        "open": LEDGER,
        "dispatched_total": LEDGER,
        "in_flight": LEDGER,
        "in_flight_tokens": LEDGER,
        "dispatched_tokens": LEDGER,
        "peer": LEDGER,
        "seen_through": LEDGER,
        # The health model.
        "charged_failures": HEALTH,
        "unconfirmed_failures": HEALTH,
        "error_rate": HEALTH,
        "error_at": HEALTH,
        "health": HEALTH,
        "down": HEALTH,
        "unhealthy": HEALTH,
        "excluded": HEALTH,
        "panic": HEALTH,
        "gauges_valid": HEALTH,
        # Derived by refresh().
        "model": DERIVED,
        "concurrency": DERIVED,
        "queue_depth": DERIVED,
        "kv_usage": DERIVED,
        "load": DERIVED,
        "adapters": DERIVED,
        "max_loras": DERIVED,
    }
)


class EndpointView(Protocol):
    """An Endpoint as scheduling may see it: read-only, and only what filters, scorers and
    the scheduler read. An Endpoint is one (checked by mypy below); a scorer that needs
    another field adds it here, read-only."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def model(self) -> str | None: ...
    @property
    def configured_slots(self) -> int | None: ...
    @property
    def slots(self) -> int | None: ...
    @property
    def concurrency(self) -> float: ...
    @property
    def queue_depth(self) -> float: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def load(self) -> float: ...
    @property
    def adapters(self) -> frozenset[str]: ...
    @property
    def max_loras(self) -> int | None: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def open(self) -> Mapping[int, Dispatch]: ...
    @property
    def dispatched_tokens(self) -> int: ...
    @property
    def health(self) -> float: ...
    @property
    def excluded(self) -> bool: ...
    @property
    def panic(self) -> bool: ...
    def has_adapter(self, adapter: str) -> bool: ...


if TYPE_CHECKING:

    def _an_endpoint_is_a_view(endpoint: Endpoint) -> EndpointView:
        return endpoint
