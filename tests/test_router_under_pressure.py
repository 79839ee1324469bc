"""The Router's contract under pressure: load truth between scrapes, admission (wait,
shed, expire), reservations that never leak, health that recovers, LoRA and unknown
models from what the pods report. A real Router over a real store; only the pods'
scraped pages are given by hand (the store's input)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from helpers import router_with

from epp.datalayer.metrics_parser import PodMetrics
from epp.request import IncomingRequest, RequestRejected


def pods(n: int) -> list[dict]:
    return [{"name": f"p{i}", "address": f"127.0.0.1:{8001 + i}", "model": "m"} for i in range(n)]


def body(prompt: str, model: str = "m") -> bytes:
    return json.dumps({"model": model, "prompt": prompt}).encode()


PREFIX = "You are a helpful assistant who answers questions about the sea. " * 40


async def route(router, prompt: str = PREFIX, model: str = "m", headers=None, rid="r"):
    return await router.route(
        IncomingRequest(
            path="/v1/completions", body=body(prompt, model), request_id=rid, headers=headers
        )
    )


async def test_a_burst_of_200_on_three_idle_pods_is_served_not_refused():
    """Finding 2: every dispatch since the last scrape used to count as queued, so one
    50 ms window admitted at most max_queue x pods requests (140 of 200 got 429)."""
    router, _store, *_ = router_with(pods(3))
    results = await asyncio.gather(
        *(route(router, f"question {i} " * 30, rid=f"r{i}") for i in range(200)),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, BaseException)]
    assert refused == []
    spread = Counter(r.endpoint.name for r in results)
    # The EPP's own counts are reserved at pick time: the burst spreads evenly.
    assert set(spread) == {"p0", "p1", "p2"}
    assert max(spread.values()) - min(spread.values()) <= 3


async def test_a_thundering_herd_spreads_one_new_prefix_and_serves_all_50():
    """4 pods, maxQueue 20, 50 concurrent requests of one new prefix: the first pod to
    get it becomes cache-hot, then the queued prefill it draws (the
    `prefill` factor) spreads the rest over the other pods. The store's clock stands
    still: all 50 arrive at once, however slowly this machine routes them."""
    router, _store, *_ = router_with(pods(4), clock=lambda: 1000.0, scheduling={"max_queue": 20})
    results = await asyncio.gather(
        *(route(router, PREFIX + f" q{i}", rid=f"r{i}") for i in range(50)),
        return_exceptions=True,
    )
    assert not [r for r in results if isinstance(r, BaseException)]
    spread = Counter(r.endpoint.name for r in results)
    assert len(spread) == 4
    assert max(spread.values()) <= 20


async def test_saturated_pool_queues_requests_and_releases_them_as_capacity_returns():
    router, store, *_ = router_with(pods(1), scheduling={"max_queue": 2, "running_slots": 1})
    first = await route(router, rid="a")
    second = await route(router, rid="b")
    third = await route(router, rid="c")  # 1 running + 2 waiting: now saturated
    assert store.get("p0").queue_depth == 2
    waiter = asyncio.create_task(route(router, rid="d"))
    await asyncio.sleep(0.01)
    assert not waiter.done() and router.waiting == 1
    router.complete(first.token, 200)
    routed = await asyncio.wait_for(waiter, 1.0)
    assert routed.endpoint.name == "p0" and routed.waited_s > 0
    assert router.waiting == 0
    for r in (second, third, routed):
        router.complete(r.token, 200)
    assert store.get("p0").in_flight == 0


async def test_sheddable_requests_are_refused_with_retry_after_when_saturated():
    router, _store, *_ = router_with(
        pods(1),
        scheduling={"max_queue": 1, "running_slots": 1},
        flow_control={"priority_header": "x-priority", "retry_after_s": 2.5},
    )
    await route(router, rid="a")
    await route(router, rid="b")
    with pytest.raises(RequestRejected) as err:
        await route(router, rid="c", headers={"x-priority": "-1"})
    assert (err.value.status, err.value.reason) == (429, "rejected-saturated")
    assert err.value.retry_after_s == 2.5


async def test_client_priority_headers_are_ignored_unless_trusted():
    router, _store, *_ = router_with(pods(1), scheduling={"max_queue": 1, "running_slots": 1})
    await route(router, rid="a")
    await route(router, rid="b")
    waiter = asyncio.create_task(route(router, rid="c", headers={"x-priority": "-1"}))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # it waits: the header was not trusted
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert router.waiting == 0


async def test_waiting_past_the_ttl_is_a_429_ttl_expired():
    router, _store, *_ = router_with(
        pods(1),
        scheduling={"max_queue": 1, "running_slots": 1},
        flow_control={"ttl_s": 0.05},
    )
    await route(router, rid="a")
    await route(router, rid="b")
    with pytest.raises(RequestRejected) as err:
        await route(router, rid="c")
    assert (err.value.status, err.value.reason) == (429, "rejected-ttl-expired")
    assert err.value.retry_after_s is not None
    assert router.waiting == 0


async def test_a_full_queue_refuses_with_429():
    router, _store, *_ = router_with(
        pods(1),
        scheduling={"max_queue": 1, "running_slots": 1},
        flow_control={"max_requests": 1},
    )
    await route(router, rid="a")
    await route(router, rid="b")
    waiter = asyncio.create_task(route(router, rid="c"))
    await asyncio.sleep(0.01)
    with pytest.raises(RequestRejected) as err:
        await route(router, rid="d")
    assert err.value.status == 429
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


async def test_waiting_requests_leave_by_priority_then_fairly_across_models():
    config = [
        {"name": "p0", "address": "127.0.0.1:8001", "model": "m"},
        {"name": "q0", "address": "127.0.0.1:8002", "model": "n"},
    ]
    router, _store, *_ = router_with(
        config,
        scheduling={"max_queue": 1, "running_slots": 1},
        flow_control={"priority_header": "x-priority"},
    )
    held = [await route(router, rid="m1"), await route(router, rid="m2")]
    order: list[str] = []

    async def waiter(rid: str, priority: str):
        routed = await route(router, rid=rid, headers={"x-priority": priority})
        order.append(rid)
        return routed

    tasks = [asyncio.create_task(waiter("low", "0"))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(waiter("high", "5")))
    await asyncio.sleep(0.01)
    assert router.waiting == 2
    router.complete(held[0].token, 200)  # room for one: the higher priority goes first
    await asyncio.sleep(0.01)
    assert order == ["high"]
    router.complete(held[1].token, 200)
    await asyncio.sleep(0.01)
    assert order == ["high", "low"]
    for t in tasks:
        router.complete((await t).token, 200)


async def test_stale_metrics_never_freeze_dispatch():
    """Every pod's last page says its queue is full, then the pages stop coming (the
    field's worst failure: flow control failing closed on stale metrics)."""
    clock = [100.0]
    router, store, *_ = router_with(pods(2), clock=lambda: clock[0])
    for e in store.all():
        store.scraped(e, PodMetrics(model="m", running=8, waiting=40))
    with pytest.raises(RequestRejected):
        router.route_now(
            IncomingRequest(path="/v1/completions", body=body("x" * 400), request_id="r")
        )
    clock[0] += 30.0  # no page for 30 s
    store.refresh_health()
    routed = router.route_now(
        IncomingRequest(path="/v1/completions", body=body("x" * 400), request_id="r")
    )
    assert routed.endpoint.name in {"p0", "p1"}


def test_reservation_is_released_even_if_observation_fails(monkeypatch):
    """Finding 8: an exception after the dispatch (here in the metrics) leaked it."""
    router, store, _, metrics = router_with(pods(1))

    def broken(*_a, **_k):
        raise RuntimeError("observer bug")

    monkeypatch.setattr(metrics.latency_us, "observe", broken)
    routed = router.route_now(
        IncomingRequest(path="/v1/completions", body=body("x" * 400), request_id="r")
    )
    assert store.get("p0").in_flight == 1
    router.complete(routed.token, 200)
    router.complete(routed.token, 200)  # twice: no effect
    assert store.get("p0").in_flight == 0


def test_a_failing_index_record_does_not_leak_the_reservation(monkeypatch):
    router, store, index, _ = router_with(pods(1))

    def broken(*_a, **_k):
        raise MemoryError

    monkeypatch.setattr(index, "record", broken)
    with pytest.raises(MemoryError):
        router.route_now(
            IncomingRequest(path="/v1/completions", body=body("x" * 400), request_id="r")
        )
    assert store.get("p0").in_flight == 0


def test_completion_from_a_fallback_counts_the_fallback_served_metric():
    router, store, _, metrics = router_with(pods(2))
    routed = router.route_now(
        IncomingRequest(path="/v1/completions", body=body("x" * 400), request_id="r")
    )
    other = next(e for e in store.all() if e is not routed.endpoint)
    router.complete(routed.token, 200, served_address=other.address)
    assert metrics.fallback_served._value.get() == 1
    assert routed.endpoint.in_flight == 0


def test_unknown_model_is_404_like_vllm():
    router, *_ = router_with(pods(2))
    with pytest.raises(RequestRejected) as err:
        router.route_now(
            IncomingRequest(path="/v1/completions", body=body("hi", "nope"), request_id="r")
        )
    assert (err.value.status, err.value.reason) == (404, "model-not-found")


def test_an_adapter_reported_by_the_pods_is_servable_without_configuration():
    """Finding 5: an adapter missing from `adapters:` got 503 although the pods reported
    it in vllm:lora_requests_info."""
    router, store, *_ = router_with(pods(2))
    p0, p1 = store.get("p0"), store.get("p1")
    store.scraped(p0, PodMetrics(model="m", running_adapters=frozenset({"sql-lora"})))
    routed = router.route_now(
        IncomingRequest(path="/v1/completions", body=body("x" * 400, "sql-lora"), request_id="r")
    )
    assert routed.endpoint is p0
    assert routed.decision.factor("adapter") == 1.0
    assert p1.adapters == frozenset()


async def test_waiting_requests_are_served_fairly_across_models():
    """One model's backlog must not starve another's: within a priority, the queue takes
    one request per model in turn."""
    router, *_ = router_with(
        pods(1), scheduling={"max_queue": 1, "running_slots": 1}, adapters={"a": "m"}
    )
    held = [await route(router, rid="h1"), await route(router, rid="h2")]
    order: list[str] = []

    async def waiter(rid: str, model: str):
        routed = await route(router, model=model, rid=rid)
        order.append(rid)
        return routed

    tasks = []
    for rid, model in (("m1", "m"), ("m2", "m"), ("m3", "m"), ("a1", "a")):
        tasks.append(asyncio.create_task(waiter(rid, model)))
        await asyncio.sleep(0.005)
    assert router.waiting == 4
    releasable = list(held)
    while len(order) < 4:
        router.complete(releasable.pop(0).token, 200)
        await asyncio.sleep(0.01)
        releasable += [t.result() for t in tasks if t.done() and t.result() not in releasable]
    assert order[:2] == ["m1", "a1"]  # the adapter's request did not wait behind m2, m3
    assert sorted(order) == ["a1", "m1", "m2", "m3"]


async def test_admission_metrics_are_exported():
    router, _store, _index, metrics = router_with(
        pods(1), scheduling={"max_queue": 1, "running_slots": 1}, flow_control={"ttl_s": 0.02}
    )
    await route(router, rid="a")
    await route(router, rid="b")
    with pytest.raises(RequestRejected):
        await route(router, rid="c")
    page = metrics.exposition().decode()
    assert 'epp_flow_control_requests_total{outcome="rejected-ttl-expired"} 1.0' in page
    assert "epp_flow_control_queue_size 0.0" in page
    assert "epp_flow_control_wait_seconds_count 1.0" in page


async def test_another_models_backlog_does_not_hold_back_a_model_with_room():
    config = [
        {"name": "p0", "address": "127.0.0.1:8001", "model": "m"},
        {"name": "q0", "address": "127.0.0.1:8002", "model": "n"},
    ]
    router, *_ = router_with(config, scheduling={"max_queue": 1, "running_slots": 1})
    await route(router, rid="m1")
    await route(router, rid="m2")
    waiter = asyncio.create_task(route(router, rid="m3"))
    await asyncio.sleep(0.01)
    assert router.waiting == 1
    other = await asyncio.wait_for(route(router, model="n", rid="n1"), 0.5)
    assert other.endpoint.name == "q0"
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
