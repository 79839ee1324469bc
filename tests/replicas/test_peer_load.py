"""A peer replica's dispatches in a pod's load (EndpointStore.peer_dispatched): counted at
once, until a page whose fetch began after their arrival (and at least the transit grace,
ledger.DISPATCH_TRANSIT_S, after it) shows them, or for at most the
store's `peer_ttl_s` while no page comes; never mixed up with this EPP's own requests."""

from __future__ import annotations

from epp.config import DataLayerConfig, EndpointConfig, EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_store(peer_ttl_s: float = 5.0, slots: int | None = 4):
    clock = Clock()
    store = EndpointStore(DataLayerConfig(), clock, running_slots=slots, peer_ttl_s=peer_ttl_s)
    events: list[str] = []
    store.on_change(lambda event, e: events.append(event))
    store.sync([EndpointConfig(name="a", address="127.0.0.1:1")])
    a = store.get("a")
    store.scraped(a, PodMetrics(running=1, waiting=0))
    return store, clock, a, events


def test_a_peer_dispatch_counts_in_the_pods_load_at_once():
    store, _, a, _ = make_store()
    assert a.concurrency == 1.0
    store.peer_dispatched(a, tokens=500)
    store.peer_dispatched(a, tokens=20)
    assert a.concurrency == 3.0
    assert a.load == 3 / 4
    assert a.dispatched_tokens == 520  # the long-run share of work counts it too
    # It is not this EPP's own request: nothing to complete, nothing in flight here.
    assert a.in_flight == 0 and a.open == {}


def test_a_page_fetched_after_the_arrival_shows_it_and_one_fetched_before_does_not():
    store, clock, a, _ = make_store()
    store.peer_dispatched(a)
    clock.now += 1.0  # it reached the pod (ledger.DISPATCH_TRANSIT_S)
    fetch_began = a.dispatched_total  # the scraper notes this when its fetch starts
    store.peer_dispatched(a)  # arrives while the page is on its way
    store.scraped(a, PodMetrics(running=2), dispatched_at_start=fetch_began)
    # The page shows the first (running 2 = the old one + the peer's); the second is
    # still on top of it.
    assert len(a.peer) == 1
    assert a.concurrency == 3.0
    clock.now += 1.0
    store.scraped(a, PodMetrics(running=3))
    assert not a.peer and a.concurrency == 3.0


def test_peer_and_own_dispatches_share_one_sequence_and_stay_apart():
    store, _, a, _ = make_store()
    own = store.dispatched(a, tokens=10)
    store.peer_dispatched(a, tokens=99)
    own2 = store.dispatched(a, tokens=10)
    assert own2 == own + 2  # numbered in order of arrival here
    assert a.in_flight == 2 and a.in_flight_tokens == 20
    assert a.concurrency == 1 + 3
    took = store.completed(a, 200, own2)
    assert took is not None
    assert a.in_flight == 1 and len(a.peer) == 1
    assert a.concurrency == 1 + 2


def test_while_the_gauges_cannot_be_trusted_the_peer_dispatches_add_to_own_in_flight():
    store, clock, a, _ = make_store()
    store.dispatched(a)
    store.peer_dispatched(a)
    clock.now += 3.0  # the page is stale now, and no other pod is fresh: nobody excluded
    store.refresh_health()
    assert not a.gauges_valid
    assert a.concurrency == 2.0  # own 1 + peer 1; the scraped running count no longer


def test_peer_dispatches_expire_after_the_ttl_when_no_page_comes():
    store, clock, a, events = make_store(peer_ttl_s=2.0)
    store.peer_dispatched(a)
    clock.now += 1.0
    store.peer_dispatched(a)
    clock.now += 1.5  # the first is 2.5 s old, the second 1.5 s
    events.clear()
    store.refresh_health()
    assert len(a.peer) == 1
    assert "released" in events  # a pod with room again may take waiting requests
    clock.now += 1.0
    store.refresh_health()
    assert not a.peer


def test_the_ttl_comes_from_the_replicas_configuration():
    config = EppConfig.model_validate({"replicas": {"load_ttl_s": 0.5}})
    clock = Clock()
    store = EndpointStore.for_config(config, clock)
    store.sync([EndpointConfig(name="a", address="127.0.0.1:1")])
    a = store.get("a")
    store.peer_dispatched(a)
    clock.now += 0.6
    store.refresh_health()
    assert not a.peer


def test_gauges_are_not_called_frozen_while_peer_dispatches_are_pending():
    store, clock, a, _ = make_store()
    busy = PodMetrics(running=2, generation_tokens=5.0)
    store.scraped(a, busy)
    clock.now += 10.0  # nothing generated for longer than frozen_gauges_after_s
    store.peer_dispatched(a)
    store.scraped(a, busy, dispatched_at_start=a.dispatched_total - 1)
    assert a.peer and not a.gauges_frozen
    clock.now += 1.0  # it reached the pod (ledger.DISPATCH_TRANSIT_S)
    store.scraped(a, busy)  # the page shows it: nothing of ours or the peers' pending
    assert a.gauges_frozen
