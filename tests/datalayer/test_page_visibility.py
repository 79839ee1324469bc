"""A page shows a dispatch only once the request can have reached the pod.

The EPP reserves a request when it picks the pod; Envoy then forwards it and vLLM renders,
tokenizes and schedules it before its gauges count it. A page fetched in that window does
not show the request yet, so the ledger must keep counting it on top of the page: a
dispatch is on a page only if the page was fetched at least the transit grace
(`ledger.DISPATCH_TRANSIT_S`, the store's `dispatch_transit_s`) after it. Counting it as
seen too early drops the pod's estimated load under what it carries, and under load the
EPP sends it more than it can run. Pure ledger and store, on a fake clock.
"""

from __future__ import annotations

from epp.config import DataLayerConfig, EndpointConfig, EppConfig
from epp.datalayer import ledger
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore

GRACE = ledger.DISPATCH_TRANSIT_S


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_store(slots: int = 2, **options):
    clock = Clock()
    store = EndpointStore(DataLayerConfig(), clock, running_slots=slots, **options)
    store.sync([EndpointConfig(name="a", address="127.0.0.1:1")])
    a = store.get("a")
    assert a is not None
    store.scraped(a, PodMetrics(running=0, waiting=0))
    return store, clock, a


def test_the_grace_is_a_transit_estimate_well_under_the_reconcile_grace():
    assert 0.0 < GRACE < ledger.RECONCILE_GRACE_S


def test_ledger_a_page_fetched_1ms_after_a_dispatch_does_not_see_it():
    endpoint = Endpoint(name="a", address="127.0.0.1:1", metrics_url="")
    seq = ledger.reserve(endpoint, tokens=10, now=100.0)
    ledger.page_seen(endpoint, endpoint.dispatched_total, fetched_at=100.001, grace=GRACE)
    assert endpoint.seen_through == seq - 1
    endpoint.metrics = PodMetrics(running=0, waiting=0)
    endpoint.refresh()
    assert endpoint.concurrency == 1  # still counted on top of the page


def test_ledger_a_page_fetched_after_the_grace_sees_it():
    endpoint = Endpoint(name="a", address="127.0.0.1:1", metrics_url="")
    seq = ledger.reserve(endpoint, tokens=10, now=100.0)
    ledger.page_seen(endpoint, endpoint.dispatched_total, fetched_at=100.0 + GRACE, grace=GRACE)
    assert endpoint.seen_through == seq


def test_ledger_only_the_dispatches_older_than_the_grace_are_seen():
    endpoint = Endpoint(name="a", address="127.0.0.1:1", metrics_url="")
    old = ledger.reserve(endpoint, tokens=1, now=100.0)
    ledger.reserve_for_peer(endpoint, tokens=1, now=100.0)
    young = ledger.reserve(endpoint, tokens=1, now=100.0 + GRACE)
    ledger.reserve_for_peer(endpoint, tokens=1, now=100.0 + GRACE)
    ledger.page_seen(
        endpoint, endpoint.dispatched_total, fetched_at=100.0 + GRACE + 0.001, grace=GRACE
    )
    assert endpoint.seen_through == young - 1 > old
    assert [d.seq for d in endpoint.peer] == [young + 1]  # the older peer's is on the page


def test_store_a_page_fetched_1ms_after_a_dispatch_keeps_it_counted():
    store, clock, a = make_store()
    clock.now += 1.0
    store.dispatched(a)
    store.dispatched(a)
    clock.now += 0.001  # the page is fetched before the requests reach the pod
    store.scraped(a, PodMetrics(running=0, waiting=0))
    assert a.concurrency == 2 and a.load == 1.0
    store.dispatched(a)  # a third request on a 2-slot pod waits
    assert a.queue_depth == 1


def test_store_a_page_fetched_after_the_grace_clears_it():
    store, clock, a = make_store()
    clock.now += 1.0
    store.dispatched(a)
    store.dispatched(a)
    clock.now += GRACE
    store.scraped(a, PodMetrics(running=2, waiting=0))
    assert a.concurrency == 2  # on the page, not counted twice
    assert a.in_flight == 2  # seen is not over: its completion still releases it


def test_store_a_peer_dispatch_stays_counted_until_a_page_after_the_grace():
    store, clock, a = make_store()
    clock.now += 1.0
    store.peer_dispatched(a)
    clock.now += 0.001
    store.scraped(a, PodMetrics(running=0, waiting=0))
    assert len(a.peer) == 1 and a.concurrency == 1
    clock.now += GRACE
    store.scraped(a, PodMetrics(running=1, waiting=0))
    assert not a.peer and a.concurrency == 1


def test_store_the_grace_counts_from_when_the_fetch_began():
    """The pod may render the page as soon as the fetch begins: a slow fetch that arrives
    after the grace does not show a request sent just before it began."""
    store, clock, a = make_store()
    clock.now += 1.0
    store.dispatched(a)
    began = clock.now + 0.001
    clock.now += GRACE + 0.5  # the answer comes late
    store.scraped(a, PodMetrics(running=0, waiting=0), fetch_began_at=began)
    assert a.concurrency == 1
    clock.now += GRACE
    store.scraped(a, PodMetrics(running=1, waiting=0), fetch_began_at=clock.now - 0.01)
    assert a.concurrency == 1 and a.in_flight == 1


def test_the_store_for_a_config_takes_the_default_grace_or_the_one_given():
    for transit, counted in ((None, 1), (0.0, 0)):
        clock = Clock()
        options = {} if transit is None else {"dispatch_transit_s": transit}
        store = EndpointStore.for_config(EppConfig(), clock, **options)
        store.sync([EndpointConfig(name="a", address="127.0.0.1:1")])
        a = store.get("a")
        assert a is not None
        store.dispatched(a)
        clock.now += 0.001
        store.scraped(a, PodMetrics(running=0, waiting=0))
        assert a.concurrency == counted, transit


def test_store_the_grace_is_a_setting_of_the_store():
    store, clock, a = make_store(dispatch_transit_s=0.0)
    clock.now += 1.0
    store.dispatched(a)
    store.scraped(a, PodMetrics(running=1, waiting=0))  # same instant: seen
    assert a.concurrency == 1
