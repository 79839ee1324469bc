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
    store, clock, _ = make_store()
    a, b = store.get("a"), store.get("b")
    assert a.health == 0.5
    clock.now += 0.05
    store.scrape_failed(a, "refused")
    assert a.health == 0.5  # nobody answered since: it could be the EPP's failure
    clock.now += 0.05
    store.scraped(b, PodMetrics())  # the EPP reaches pods: a's failure is a's
    store.refresh_health()
    assert a.health == 0.0 and a.excluded


def test_consecutive_failures_lower_health_and_a_success_restores_it():
    store, clock, _ = make_store()
    a, b = store.get("a"), store.get("b")
    store.scraped(a, PodMetrics(waiting=1))
    assert a.health == 1.0
    healths = []
    for _ in range(3):
        clock.now += 0.025
        store.scrape_failed(a, "timeout")
        clock.now += 0.025
        store.scraped(b, PodMetrics())  # b answers after a's failure
        store.refresh_health()
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
    store, clock, _ = make_store()
    a = store.get("a")
    store.dispatched(a)
    mark = a.dispatched_total  # the scrape starts here
    store.dispatched(a)  # sent while the page was in flight: not on it yet
    clock.now += 1.0  # long enough for the first to reach the pod (ledger.DISPATCH_TRANSIT_S)
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


def test_gauges_of_a_page_without_a_generation_counter_never_look_frozen():
    """vLLM's frozen gauges are vLLM's bug, told by its generation counter: an SGLang or
    Triton page has none, and its busy gauges must keep counting while this EPP sends
    nothing (another replica's or a direct client's load)."""
    store, clock, _ = make_store(frozen_gauges_after_s=5.0)
    a = store.get("a")
    page = dict(running=8, waiting=30, kv_usage=0.99, generation_tokens=None)
    for _ in range(60):
        clock.now += 0.1
        store.scraped(a, PodMetrics(**page))
    assert not a.gauges_frozen and a.queue_depth == 30 and a.kv_usage == pytest.approx(0.99)


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
    store, clock, _ = make_store()
    a = store.get("a")
    a.configured_slots = 2
    for _ in range(6):
        store.dispatched(a)
    assert a.queue_depth == 4 and a.in_flight == 6
    clock.now += 1.0  # the requests reached the pod (ledger.DISPATCH_TRANSIT_S)
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


# -- partitions: failures that hit every pod at once are not the pods' ------------------
def store_of(names: list[str], model_of=lambda name: "m", **store_options):
    clock = Clock()
    store = EndpointStore(DataLayerConfig(stale_after_s=1.0), clock, **store_options)
    store.sync(
        [
            EndpointConfig(name=n, address=f"127.0.0.1:{i + 1}", model=model_of(n))
            for i, n in enumerate(names)
        ]
    )
    return store, clock


def scrape_round(store, clock, failing: set[str], step: float = 0.05, error="refused"):
    """One scrape of every pod, the answers first (the same store time for all)."""
    clock.now += step
    for e in store.all():
        if e.name not in failing:
            store.scraped(e, PodMetrics())
    for e in store.all():
        if e.name in failing:
            store.scrape_failed(e, error)
    store.refresh_health()


def test_a_partition_from_every_pods_metrics_excludes_nobody():
    """The EPP cannot reach any metrics port (refused, 20 rounds a second for 10 s; the
    pages go stale) while Envoy still reaches the pods: nobody is excluded."""
    store, clock = store_of(["a", "b", "c", "d"])
    scrape_round(store, clock, failing=set())
    everyone = {e.name for e in store.all()}
    for _ in range(200):
        scrape_round(store, clock, failing=everyone)
        assert not any(e.excluded or e.down for e in store.all())
    assert all(e.consecutive_failures == 200 for e in store.all())
    assert all(e.health == 1.0 and e.charged_failures == 0 for e in store.all())
    # The network comes back for a, not for the others: now their failures are theirs.
    for _ in range(3):
        scrape_round(store, clock, failing=everyone - {"a"})
    assert [e.name for e in store.all() if e.excluded] == ["b", "c", "d"]
    scrape_round(store, clock, failing=set())
    assert not any(e.excluded for e in store.all())


def test_a_partition_of_hanging_scrapes_excludes_nobody_and_a_silent_pod_still_goes():
    """Scrapes time out (1 s each) on every pod: stale pages and failures are not charged.
    One pod silent while the others answer is charged at once (staleness)."""
    store, clock = store_of(["a", "b", "c"])
    scrape_round(store, clock, failing=set())
    everyone = {e.name for e in store.all()}
    for _ in range(10):
        scrape_round(store, clock, failing=everyone, step=1.0, error="TimeoutError: ")
        assert not any(e.excluded for e in store.all())
    scrape_round(store, clock, failing=set())
    for _ in range(30):  # a hangs, b and c answer: 1.5 s
        clock.now += 0.05
        for e in store.all():
            if e.name != "a":
                store.scraped(e, PodMetrics())
        store.refresh_health()
    assert [e.name for e in store.all() if e.excluded] == ["a"]


def test_a_never_scraped_pod_is_not_charged_while_no_pod_answers():
    store, clock = store_of(["a", "b"])
    for _ in range(20):
        scrape_round(store, clock, failing={"a", "b"})
    assert [e.health for e in store.all()] == [0.5, 0.5]


# -- the floor: errors exclude at most a share of a model's pods, the worst first -------
def fail_requests(store, endpoint, count: int, status: int = 500) -> None:
    for _ in range(count):
        store.completed(endpoint, status, store.dispatched(endpoint))


def test_errors_exclude_at_most_half_of_a_models_pods_the_worst_first():
    """One client's requests answered 500 by every pod: two of four pods go out (the
    worst), the other two stay routable although their health says exclude."""
    store, clock = store_of(["a", "b", "c", "d"])
    scrape_round(store, clock, failing=set())
    for count, e in zip([30, 20, 12, 10], store.all(), strict=True):
        fail_requests(store, e, count)
    assert all(e.unhealthy for e in store.all())
    assert [e.name for e in store.all() if e.excluded] == ["a", "b"]
    assert not any(e.panic for e in store.all())
    # b recovers: its room goes to the worst of the others.
    store.get("b").error_rate = 0.0
    store.refresh_health()
    assert [e.name for e in store.all() if e.excluded] == ["a", "c"]


def test_pods_down_for_scrapes_take_the_room_errors_would_have():
    store, clock = store_of(["a", "b", "c", "d"])
    scrape_round(store, clock, failing=set())
    for _ in range(3):
        scrape_round(store, clock, failing={"a"})
    assert store.get("a").down and store.get("a").excluded
    for e in store.all()[1:]:
        fail_requests(store, e, 20)
    assert [e.name for e in store.all() if e.excluded] == ["a", "b"]


def test_the_floor_is_per_model_and_a_single_pod_is_never_excluded_for_errors():
    store, clock = store_of(["m1", "m2", "solo"], model_of=lambda n: "solo" if n == "solo" else "m")
    scrape_round(store, clock, failing=set())
    for e in store.all():
        fail_requests(store, e, 30)
    assert [e.name for e in store.all() if e.excluded] == ["m1"]
    assert store.get("solo").unhealthy and not store.get("solo").excluded


def test_the_share_is_configurable_and_one_lets_errors_exclude_every_pod():
    store, clock = store_of(["a", "b"], max_error_exclusion_share=1.0)
    scrape_round(store, clock, failing=set())
    for e in store.all():
        fail_requests(store, e, 30)
    assert all(e.excluded for e in store.all())
    assert all(e.panic for e in store.all())  # none left: routed to all anyway


# -- panic: a model with no routable pod is routed to all its pods ----------------------
def test_a_model_whose_pods_are_all_down_is_in_panic_counted_and_logged_once():
    from structlog.testing import capture_logs

    store, clock = store_of(["a", "b", "x"], model_of=lambda n: "other" if n == "x" else "m")
    scrape_round(store, clock, failing=set())
    with capture_logs() as logs:
        for _ in range(40):  # 2 s: x answers, a and b do not (down, not a partition)
            scrape_round(store, clock, failing={"a", "b"})
    a, b, x = store.all()
    assert a.excluded and b.excluded and a.panic and b.panic and not x.panic
    assert store.floor_stats.panics == 1
    assert [entry["event"] for entry in logs if entry["event"].startswith("health_panic")] == [
        "health_panic"
    ]
    store.dispatched(a)
    store.dispatched(x)
    assert store.floor_stats.panic_requests == 1
    scrape_round(store, clock, failing={"a"})
    assert not b.excluded and not a.panic and not b.panic


def test_panic_at_a_share_and_switched_off():
    store, clock = store_of(
        ["a", "b", "c", "x"],
        healthy_panic_share=0.5,
        model_of=lambda n: "other" if n == "x" else "m",
    )
    scrape_round(store, clock, failing=set())
    for _ in range(3):
        scrape_round(store, clock, failing={"a", "b"})
    assert all(e.panic for e in store.all()[:3])  # 1 of 3 routable < 50%
    store, clock = store_of(
        ["a", "x"], health_panic=False, model_of=lambda n: "other" if n == "x" else "m"
    )
    scrape_round(store, clock, failing=set())
    for _ in range(3):
        scrape_round(store, clock, failing={"a"})
    assert store.get("a").excluded and not store.get("a").panic


def test_the_scheduler_routes_to_pods_the_floor_keeps_though_their_health_is_low():
    """The health filter obeys the store's verdict, not the raw health: a capped pod
    (health below 0.3) is a candidate, an excluded one is not; in panic all are."""
    from epp.config import SchedulingConfig
    from epp.scheduling.scheduler import Scheduler
    from epp.scheduling.types import SchedulingRequest

    def request(model: str | None = None) -> SchedulingRequest:
        return SchedulingRequest(request_id="r", base_model=model)

    store, clock = store_of(["a", "b", "c", "d"])
    scrape_round(store, clock, failing=set())
    for count, e in zip([30, 20, 12, 10], store.all(), strict=True):
        fail_requests(store, e, count)
    assert all(e.health < 0.3 for e in store.all())
    decision = Scheduler(SchedulingConfig()).schedule(request(), store.all())
    assert sorted(e.name for e in decision.candidates) == ["c", "d"]
    store, clock = store_of(["a", "b", "x"], model_of=lambda n: "other" if n == "x" else "m")
    scrape_round(store, clock, failing=set())
    for _ in range(3):
        scrape_round(store, clock, failing={"a", "b"})
    decision = Scheduler(SchedulingConfig()).schedule(request(model="m"), store.all()[:2])
    assert sorted(e.name for e in decision.candidates) == ["a", "b"]


def test_a_flapping_panic_is_counted_each_time_and_logged_once_in_ten_seconds():
    from structlog.testing import capture_logs

    store, clock = store_of(["a", "x"], model_of=lambda n: "other" if n == "x" else "m")
    scrape_round(store, clock, failing=set())
    with capture_logs() as logs:
        for _ in range(3):  # in and out of panic three times within a second
            for _ in range(3):
                scrape_round(store, clock, failing={"a"})
            assert store.get("a").panic
            scrape_round(store, clock, failing=set())
            assert not store.get("a").panic
        clock.now += 10.0
        for _ in range(3):
            scrape_round(store, clock, failing={"a"})
    assert store.floor_stats.panics == 4
    assert [e["event"] for e in logs if e["event"] == "health_panic"] == ["health_panic"] * 2
