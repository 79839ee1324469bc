from __future__ import annotations

import math

import pytest

from epp.config import DataLayerConfig, EndpointConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_store(**config) -> tuple[EndpointStore, Clock, list[tuple[str, str]]]:
    clock = Clock()
    store = EndpointStore(DataLayerConfig(**config), clock)
    events: list[tuple[str, str]] = []
    store.on_change(lambda event, e: events.append((event, e.name)))
    store.sync(
        [
            EndpointConfig(name="a", address="127.0.0.1:1"),
            EndpointConfig(name="b", address="127.0.0.1:2"),
        ]
    )
    return store, clock, events


def test_sync_adds_removes_and_keeps_state():
    store, _, events = make_store()
    a = store.get("a")
    a.in_flight = 3
    store.sync([EndpointConfig(name="a", address="127.0.0.1:1", labels={"z": "1"})])
    assert store.get("a") is a and a.in_flight == 3 and a.labels == {"z": "1"}
    assert store.get("b") is None and ("removed", "b") in events
    assert store.by_address("127.0.0.1:1") is a and a.metrics_url == "http://127.0.0.1:1/metrics"


def test_never_scraped_pod_is_half_healthy_then_failures_exclude_it():
    store, _, _ = make_store()
    a = store.get("a")
    assert a.health == 0.5
    store.scrape_failed(a, "refused")
    assert a.health == 0.0


def test_consecutive_failures_lower_health_and_a_success_restores_it():
    store, _, _ = make_store()
    a = store.get("a")
    store.scraped(a, PodMetrics(waiting=1))
    assert a.health == 1.0
    healths = []
    for _ in range(3):
        store.scrape_failed(a, "timeout")
        healths.append(a.health)
    assert healths == [0.75, 0.5, 0.25]  # the third failure is below the 0.3 cut-off
    store.scraped(a, PodMetrics())
    assert a.health == 1.0 and a.consecutive_failures == 0


def test_stale_metrics_make_a_pod_unhealthy_while_another_is_fresh():
    store, clock, _ = make_store(stale_after_s=1.0)
    a, b = store.get("a"), store.get("b")
    store.scraped(a, PodMetrics())
    store.scraped(b, PodMetrics())
    clock.now += 0.9
    store.refresh_health()
    assert a.health == 1.0
    clock.now += 0.2
    store.scraped(b, PodMetrics())  # b keeps answering, a went silent
    store.refresh_health()
    assert a.health == 0.0 and a.excluded and b.health == 1.0


def test_when_every_pod_is_stale_nobody_is_excluded_and_old_gauges_are_ignored():
    """The EPP's loop was blocked or the network partitioned: not the pods' fault. Stale
    metrics must never freeze dispatch: health ignores staleness, and the old gauges
    (here a full queue) stop counting, leaving the EPP's own counts."""
    store, clock, _ = make_store(stale_after_s=1.0)
    a, b = store.get("a"), store.get("b")
    store.scraped(a, PodMetrics(waiting=50, kv_usage=0.99))
    store.scraped(b, PodMetrics(waiting=50, kv_usage=0.99))
    assert a.queue_depth == 50
    clock.now += 5.0
    store.refresh_health()
    assert not store.staleness_counts
    assert a.health == 1.0 and not a.excluded
    assert a.queue_depth == 0 and a.kv_usage == 0.0
    store.dispatched(a)
    assert a.in_flight == 1 and a.concurrency == 1


def test_response_errors_lower_health_gradually():
    store, _, _ = make_store(error_rate_alpha=0.5)
    a = store.get("a")
    store.scraped(a, PodMetrics())
    store.completed(a, 500, store.dispatched(a))
    assert a.health == pytest.approx(0.5)
    for _ in range(3):
        store.completed(a, 200, store.dispatched(a))
    assert a.health == pytest.approx(1 - 0.5**4)
    assert a.in_flight == 0


def test_a_pod_excluded_for_errors_comes_back_after_the_error_rate_decays():
    """It gets no requests while excluded, so only time can lower its error rate."""
    store, clock, _ = make_store(error_decay_s=10.0, readmit_health=0.5)
    a, b = store.get("a"), store.get("b")
    for pod in (a, b):
        store.scraped(pod, PodMetrics())
    for _ in range(20):
        store.completed(a, 500, store.dispatched(a))
    assert a.excluded and a.health < 0.3
    readmitted_after = None
    for step in range(1, 200):
        clock.now += 0.1
        store.scraped(a, PodMetrics())
        store.scraped(b, PodMetrics())
        store.refresh_health()
        if not a.excluded:
            readmitted_after = step * 0.1
            break
    # 1 - 0.99 * exp(-t / 10) >= 0.5  =>  t = 10 * ln(0.99 / 0.5) = 6.8 s
    assert readmitted_after == pytest.approx(6.8, abs=0.15)
    assert a.health >= 0.5


def test_hysteresis_keeps_a_recovering_pod_out_until_the_readmit_level():
    store, clock, _ = make_store(error_decay_s=10.0, readmit_health=0.5)
    a = store.get("a")
    store.scraped(a, PodMetrics())
    a.error_rate, a.error_at = 0.75, clock.now  # health 0.25: excluded
    store.refresh_health()
    assert a.excluded
    clock.now += 10 * math.log(0.75 / 0.65)  # health 0.35: above 0.3, below 0.5
    store.refresh_health()
    assert 0.3 < a.health < 0.5 and a.excluded
    clock.now += 10 * math.log(0.65 / 0.45)  # health 0.55
    store.refresh_health()
    assert not a.excluded
    # Not excluded again until it falls below 0.3 (a single error takes it to ~0.44).
    store.record_status(a, 500)
    assert 0.3 < a.health < 0.5 and not a.excluded


def test_dispatched_requests_wait_only_beyond_the_pods_free_slots():
    store, _, _ = make_store()
    a = store.get("a")
    a.configured_slots = 4
    store.scraped(a, PodMetrics(running=2, waiting=0))
    first = store.dispatched(a)
    store.dispatched(a)
    assert (a.queue_depth, a.in_flight, a.concurrency) == (0, 2, 4)
    store.dispatched(a)  # the fifth request on a 4-slot pod waits
    assert a.queue_depth == 1
    store.completed(a, 200, first)  # done before any scrape
    assert a.queue_depth == 0 and a.in_flight == 2
    store.completed(a, None, None)  # a stray completion changes nothing
    assert a.in_flight == 2


def test_slots_are_learned_from_the_running_count_while_requests_wait():
    store, _, _ = make_store()
    a = store.get("a")
    store.scraped(a, PodMetrics(running=3, waiting=0))
    assert a.slots is None
    store.scraped(a, PodMetrics(running=6, waiting=2))
    assert a.slots == 6 and a.load == pytest.approx(1.0)
    store.scraped(a, PodMetrics(running=3, waiting=0))
    assert a.slots == 6 and a.load == pytest.approx(0.5)


def test_requests_sent_during_a_scrape_stay_counted():
    store, _, _ = make_store()
    a = store.get("a")
    store.dispatched(a)
    mark = a.dispatched_total  # the scrape starts here
    store.dispatched(a)  # sent while the page was in flight: not on it yet
    store.scraped(a, PodMetrics(running=1), dispatched_at_start=mark)
    assert a.concurrency == 2 and a.in_flight == 2


def test_completions_nobody_reported_are_reconciled_from_the_pods_counts():
    """Without a response observer the EPP never hears of completions: the pod holding
    fewer requests than the EPP sent it (long enough ago) settles the difference."""
    store, clock, events = make_store()
    a = store.get("a")
    for _ in range(5):
        store.dispatched(a, tokens=100)
    store.scraped(a, PodMetrics(running=5))
    assert a.in_flight == 5  # too recent to judge
    clock.now += 3.0
    store.scraped(a, PodMetrics(running=2))
    assert a.in_flight == 2 and a.in_flight_tokens == 200
    assert ("released", "a") in events


def test_in_flight_entries_expire_after_their_ttl():
    store, clock, _ = make_store(in_flight_ttl_s=60.0)
    a = store.get("a")
    store.dispatched(a)
    clock.now += 61
    store.refresh_health()
    assert a.in_flight == 0 and not a.open


def test_frozen_gauges_stop_counting_when_the_pod_generates_nothing():
    """vLLM stops refreshing gauges once every request is cancelled: a pod must not look
    busy for ever."""
    store, clock, _ = make_store(frozen_gauges_after_s=5.0)
    a = store.get("a")
    page = dict(running=8, waiting=30, kv_usage=0.99, generation_tokens=1000)
    store.scraped(a, PodMetrics(**page))
    assert a.queue_depth == 30
    for _ in range(60):
        clock.now += 0.1
        store.scraped(a, PodMetrics(**page))
    assert a.gauges_frozen and a.queue_depth == 0 and a.kv_usage == 0.0
    page["generation_tokens"] = 1010  # it generates again: the gauges are real
    store.scraped(a, PodMetrics(**page))
    assert not a.gauges_frozen and a.queue_depth == 30


def test_counter_going_backwards_signals_engine_reset():
    store, _, events = make_store()
    a = store.get("a")
    store.scraped(a, PodMetrics(prefix_queries=1000))
    store.scraped(a, PodMetrics(prefix_queries=10))
    assert ("reset", "a") in events


def test_a_pod_that_has_not_shown_a_queue_yet_uses_the_slots_its_peers_learned():
    """Pods of one model are alike: a pod whose page lags must not look endlessly roomy
    while its peers are already known to be full (a burst then piles onto it)."""
    store, _, _ = make_store()
    a, b = store.get("a"), store.get("b")
    store.scraped(b, PodMetrics(model="m", running=0))
    store.scraped(a, PodMetrics(model="m", running=8, waiting=5))
    assert a.slots == 8 and b.slots == 8
    for _ in range(30):
        store.dispatched(b)
    assert b.queue_depth == 22  # 30 sent, 8 run, the rest wait
    other = store.get("a")
    assert other.learned_slots == 8


def test_completions_never_heard_of_do_not_keep_a_pod_busy_while_its_page_is_fresh():
    """Behind a gateway without the observer filter, or beside other EPP replicas, the
    pod's counts (which include other routers' traffic) cannot settle the EPP's books;
    the fresh page, not the EPP's stale in-flight count, says how busy the pod is."""
    store, _, _ = make_store()
    a = store.get("a")
    a.configured_slots = 2
    for _ in range(6):
        store.dispatched(a)
    assert a.queue_depth == 4 and a.in_flight == 6
    store.scraped(a, PodMetrics(running=1))  # the page shows one request on the pod
    assert a.in_flight == 6  # too recent to reconcile
    assert a.concurrency == 1 and a.queue_depth == 0


@pytest.mark.parametrize(
    ("before", "after", "reset"),
    [
        (
            {"prefix_queries": 500.0, "start_time": 1.0},
            {"prefix_queries": 900.0, "start_time": 1.0},
            False,
        ),
        ({"prefix_queries": 500.0, "start_time": 1.0}, {"prefix_queries": 100.0}, True),
        # A new server whose counters already passed the old ones: its start time tells.
        (
            {"prefix_queries": 500.0, "start_time": 1.0},
            {"prefix_queries": 900.0, "start_time": 2.0},
            True,
        ),
        ({"prefix_queries": 500.0, "start_time": 1.0}, {"prefix_queries": 900.0}, False),
        ({"prefix_queries": 500.0}, {"prefix_queries": 900.0, "start_time": 2.0}, False),
        # An older process on the same address (API servers sharing a port): not a restart.
        (
            {"prefix_queries": 500.0, "start_time": 2.0},
            {"prefix_queries": 900.0, "start_time": 1.0},
            False,
        ),
    ],
)
def test_a_restart_is_counters_going_back_or_a_new_start_time(before, after, reset):
    store, _, events = make_store()
    endpoint = store.get("a")
    assert endpoint is not None
    store.scraped(endpoint, PodMetrics(model="m", **before))
    events.clear()
    store.scraped(endpoint, PodMetrics(model="m", **after))
    assert (("reset", "a") in events) is reset


def test_the_latest_start_time_stays_so_pages_of_two_processes_are_one_restart():
    store, _, events = make_store()
    endpoint = store.get("a")
    assert endpoint is not None
    for start_time in (1.0, 2.0, 1.0, None, 2.0, 1.0, 3.0):
        store.scraped(endpoint, PodMetrics(model="m", start_time=start_time))
    assert events.count(("reset", "a")) == 2  # 1 -> 2, then 3
    assert endpoint.metrics is not None and endpoint.metrics.start_time == 3.0
