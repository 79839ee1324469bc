from __future__ import annotations

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


def test_stale_metrics_make_a_pod_unhealthy():
    store, clock, _ = make_store(stale_after_s=1.0)
    a = store.get("a")
    store.scraped(a, PodMetrics())
    clock.now += 0.9
    store.refresh_health()
    assert a.health == 1.0
    clock.now += 0.2
    store.refresh_health()
    assert a.health == 0.0


def test_response_errors_lower_health_gradually():
    store, _, _ = make_store(error_rate_alpha=0.5)
    a = store.get("a")
    store.scraped(a, PodMetrics())
    store.dispatched(a)
    store.completed(a, 500)
    assert a.health == pytest.approx(0.5)
    for _ in range(3):
        store.dispatched(a)
        store.completed(a, 200)
    assert a.health == pytest.approx(1 - 0.5**4)
    assert a.in_flight == 0


def test_dispatch_counts_until_next_scrape_or_completion():
    store, _, _ = make_store()
    a = store.get("a")
    store.scraped(a, PodMetrics(waiting=2))
    first = store.dispatched(a)
    second = store.dispatched(a)
    assert a.queue_depth == 4 and a.in_flight == 2
    store.completed(a, 200, first)  # done before any scrape: no longer waiting
    assert a.queue_depth == 3 and a.in_flight == 1
    store.scraped(a, PodMetrics(waiting=3))  # the page now shows the second one
    assert a.queue_depth == 3
    store.completed(a, 200, second)
    store.completed(a, None)  # an extra completion never goes below zero
    assert a.queue_depth == 3 and a.in_flight == 0


def test_counter_going_backwards_signals_engine_reset():
    store, _, events = make_store()
    a = store.get("a")
    store.scraped(a, PodMetrics(prefix_queries=1000))
    store.scraped(a, PodMetrics(prefix_queries=10))
    assert ("reset", "a") in events


def test_requests_sent_during_a_scrape_stay_counted():
    store, _, _ = make_store()
    a = store.get("a")
    store.dispatched(a)
    mark = a.dispatched_total  # the scrape starts here
    store.dispatched(a)  # sent while the page was in flight: not on it yet
    store.scraped(a, PodMetrics(waiting=1), dispatched_at_start=mark)
    assert a.unseen_dispatches == {2} and a.queue_depth == 2
