"""Admission under pressure, the Router's side (issue 15, findings 5 and 6): a waiting
request holds back only the requests that compete with it for the same pods, a release
pass places as many as the pods have room for (tests/test_maintenance_loop.py: a request
whose dispatch raised).

A real Router over a real store (the pods' scraped pages given by hand, the store's
input); no wall-clock waits: the event loop is turned a bounded number of times, and the
store's clock is injected where time matters."""

from __future__ import annotations

import asyncio
import json

from helpers import router_with

from epp.datalayer.metrics_parser import PodMetrics
from epp.request import IncomingRequest

ADDRESS = {f"p{i}": f"127.0.0.1:{8001 + i}" for i in range(8)}


def pods(n: int) -> list[dict]:
    return [{"name": f"p{i}", "address": ADDRESS[f"p{i}"], "model": "m"} for i in range(n)]


def body(i: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"question {i} " * 30}).encode()


def route(router, i: int, subset: frozenset[str] | None = None, headers=None):
    return router.route(
        IncomingRequest(
            path="/v1/completions", body=body(i), request_id=f"r{i}", subset=subset, headers=headers
        )
    )


async def settle(turns: int = 20) -> None:
    """Lets every task that can run, run (a bounded number of event-loop turns)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def cancel(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


ONE_EACH = {"max_queue": 1, "running_slots": 1}  # 1 running + 1 queued: saturated


async def test_a_hint_naming_a_saturated_pod_does_not_hold_back_a_request_for_an_idle_pod():
    """Finding 5: the head of the model's queue (subset hint: only p0, saturated) blocked
    every request of its model, even with p1 idle, for up to flow_control.ttl_s."""
    router, store, *_ = router_with(pods(2), scheduling=ONE_EACH)
    only_p0 = frozenset({ADDRESS["p0"]})
    held = [await route(router, i, only_p0) for i in range(2)]  # p0 is saturated
    assert {r.endpoint.name for r in held} == {"p0"}
    hinted = asyncio.create_task(route(router, 10, only_p0))
    await settle()
    assert router.waiting == 1
    free = asyncio.create_task(route(router, 11))  # any pod: p1 is idle
    await settle()
    assert free.done(), "a request for an idle pod waited behind one for a saturated pod"
    assert free.result().endpoint.name == "p1"
    assert not hinted.done() and router.waiting == 1
    # The hinted request keeps its place on p0: a newer request for p0 waits behind it.
    later = asyncio.create_task(route(router, 12, only_p0))
    await settle()
    assert router.waiting == 2
    router.complete(held[0].token, 200)  # room for one on p0
    await settle()
    assert hinted.done() and hinted.result().endpoint.name == "p0"
    assert not later.done()
    await cancel(later)
    assert store.get("p1").in_flight == 1


async def test_a_newer_request_does_not_take_room_a_waiting_one_may_use():
    """FIFO where they compete: room on the waiting request's pod goes to it, not to a
    request that arrives before the release pass has run."""
    router, *_ = router_with(pods(1), scheduling=ONE_EACH)
    held = [await route(router, i) for i in range(2)]
    first = asyncio.create_task(route(router, 10))
    await settle()

    async def room_then_a_newer_request():
        router.complete(held[0].token, 200)  # room for one; the release pass is only due
        return await route(router, 11)  # arrives before that pass runs

    second = asyncio.create_task(room_then_a_newer_request())
    await settle()
    assert first.done() and first.result().endpoint.name == "p0"
    assert not second.done()
    await cancel(second)


async def test_a_request_after_one_that_found_no_room_is_still_offered_a_pod():
    """Finding 5, in the release pass: the first waiting request (hint: only p0) finds no
    room, the next one (any pod) is placed on p1 in the same pass."""
    router, *_ = router_with(pods(2), scheduling=ONE_EACH)
    only_p0 = frozenset({ADDRESS["p0"]})
    held = [await route(router, i) for i in range(4)]  # 2 per pod: both saturated
    hinted = asyncio.create_task(route(router, 10, only_p0))
    await settle()
    free = asyncio.create_task(route(router, 11))
    await settle()
    assert router.waiting == 2
    on_p1 = next(r for r in held if r.endpoint.name == "p1")
    router.complete(on_p1.token, 200)
    assert router.release_waiting() == 1
    await settle()
    assert free.done() and free.result().endpoint.name == "p1"
    assert not hinted.done()
    await cancel(hinted)


async def test_a_newer_request_with_a_full_placement_waits_without_a_scheduling_attempt():
    """The cost of a backlog: while requests wait and nothing returned room, a newer
    request for the same pods joins them at once (no index lookup, no filters)."""
    router, *_ = router_with(pods(1), scheduling=ONE_EACH)
    for i in range(2):
        await route(router, i)
    waiters = [asyncio.create_task(route(router, 10))]
    await settle()
    attempts = []
    schedule = router.scheduler.schedule
    router.scheduler.schedule = lambda *a: attempts.append(1) or schedule(*a)
    waiters += [asyncio.create_task(route(router, 11 + i)) for i in range(5)]
    await settle()
    assert router.waiting == 6 and attempts == []
    await cancel(*waiters)


async def test_room_on_another_models_pod_costs_the_waiting_requests_no_attempt():
    """A completion on model n's pod cannot give model m's waiting requests room: the
    release pass it triggers does not try them (one on m's pod does)."""
    config = [
        {"name": "p0", "address": ADDRESS["p0"], "model": "m"},
        {"name": "q0", "address": ADDRESS["p1"], "model": "n"},
    ]
    router, *_ = router_with(config, scheduling=ONE_EACH)
    on_m = [await route(router, i) for i in range(2)]
    on_n = await router.route(
        IncomingRequest(
            path="/v1/completions",
            body=json.dumps({"model": "n", "prompt": "x " * 90}).encode(),
            request_id="n1",
        ),
    )
    waiter = asyncio.create_task(route(router, 10))
    await settle()
    assert router.waiting == 1
    attempts = []
    schedule = router.scheduler.schedule
    router.scheduler.schedule = lambda *a: attempts.append(1) or schedule(*a)
    router.complete(on_n.token, 200)
    await settle()
    assert attempts == [] and not waiter.done()
    router.complete(on_m[0].token, 200)
    await settle()
    assert attempts == [1] and waiter.done()


async def test_room_that_only_time_returns_is_found_by_the_tick():
    """No store event says a stale page's "queue full" stopped counting: the tick
    forgets which placements were full and offers the waiting requests a pod."""
    clock = [100.0]
    router, store, *_ = router_with(pods(1), clock=lambda: clock[0], scheduling=ONE_EACH)
    store.scraped(store.get("p0"), PodMetrics(model="m", running=1, waiting=1))
    waiter = asyncio.create_task(route(router, 1))
    await settle()
    assert router.waiting == 1
    clock[0] += 30.0  # the page is stale: its gauges no longer count
    store.refresh_health()
    await settle()
    assert not waiter.done()  # nothing announced the room
    router.tick()
    await settle()
    assert waiter.done() and waiter.result().endpoint.name == "p0"


async def test_a_release_pass_places_as_many_waiting_requests_as_pods_have_room_for():
    """Finding 5: a pass released one request per model, so 4 requests waiting for 4
    pods that freed up at once went one per event or tick."""
    router, store, *_ = router_with(pods(4), scheduling=ONE_EACH)
    held = [await route(router, i) for i in range(8)]  # 2 per pod: all saturated
    assert {store.get(f"p{i}").queue_depth for i in range(4)} == {1}
    waiters = [asyncio.create_task(route(router, 100 + i)) for i in range(4)]
    await settle()
    assert router.waiting == 4
    firsts = {}
    for routed in held:
        firsts.setdefault(routed.endpoint.name, routed)
    for routed in firsts.values():  # one completion per pod, in one loop turn
        router.complete(routed.token, 200)
    assert router.release_waiting() == 4  # one pass
    assert router.waiting == 0
    await settle()
    assert sorted(w.result().endpoint.name for w in waiters) == ["p0", "p1", "p2", "p3"]


async def test_a_scrape_showing_room_releases_waiting_requests_without_a_tick():
    """Release on events: a page showing the pod less busy is enough (no tick runs
    here)."""
    clock = [100.0]
    router, store, *_ = router_with(pods(1), clock=lambda: clock[0], scheduling=ONE_EACH)
    p0 = store.get("p0")
    store.scraped(p0, PodMetrics(model="m", running=1, waiting=1))  # another router's load
    waiter = asyncio.create_task(route(router, 1))
    await settle()
    assert router.waiting == 1
    clock[0] += 0.05
    store.scraped(p0, PodMetrics(model="m", running=0, waiting=0))
    await settle()
    assert waiter.done() and waiter.result().endpoint is p0


async def test_priority_still_orders_requests_competing_for_the_same_pods():
    router, *_ = router_with(
        pods(1), scheduling=ONE_EACH, flow_control={"priority_header": "x-priority"}
    )
    held = [await route(router, i) for i in range(2)]
    low = asyncio.create_task(route(router, 10, headers={"x-priority": "0"}))
    await settle()
    high = asyncio.create_task(route(router, 11, headers={"x-priority": "5"}))
    await settle()
    assert router.waiting == 2
    router.complete(held[0].token, 200)
    await settle()
    assert high.done() and not low.done()
    router.complete(held[1].token, 200)
    await settle()
    assert low.done()
