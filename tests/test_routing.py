"""Router: the prefill lanes are kept at dispatch, and only while `prefill` is scored;
scorer state hears of completions and removed pods."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from helpers import router_with

from epp.config import DEFAULT_WEIGHTS, SPEC_WEIGHTS, EndpointConfig, PrefillEstimateConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.request import IncomingRequest
from epp.scheduling.scorers.prefill import PrefillCost, PrefillScorer, PrefillState
from epp.scheduling.types import PodStateScorer

PODS = [
    {"name": "a", "address": "127.0.0.1:8001", "model": "m"},
    {"name": "b", "address": "127.0.0.1:8002", "model": "m"},
]
WITH_PREFILL = {"weights": DEFAULT_WEIGHTS}
WITHOUT_PREFILL = {"weights": SPEC_WEIGHTS}
COST = PrefillCost.from_config(PrefillEstimateConfig())
BODY = json.dumps({"model": "m", "prompt": "x" * 16_384}).encode()  # 4,096 pseudo-tokens


class Clock:
    """A settable clock that counts its reads."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def route(router, request_id: str = "r", body: bytes = BODY):
    return router.route_now(
        IncomingRequest(path="/v1/completions", body=body, request_id=request_id)
    )


def configs(pods: list[dict]) -> list[EndpointConfig]:
    return [EndpointConfig.model_validate(p) for p in pods]


def prefill_of(router) -> PrefillScorer:
    scorer = router.scheduler.scorer("prefill")
    assert isinstance(scorer, PrefillScorer)
    return scorer


def lane_end(router, endpoint) -> float:
    return prefill_of(router).state(endpoint).lane_end


def test_without_the_prefill_scorer_no_lane_is_kept():
    clock = Clock()
    router, *_ = router_with(PODS, clock=clock, scheduling=WITHOUT_PREFILL)
    for i in range(3):
        route(router, f"r{i}")
    assert router.scheduler.scorer("prefill") is None
    assert not any(isinstance(s, PodStateScorer) for s, _ in router.scheduler.profile)


def test_with_the_prefill_scorer_dispatch_moves_the_chosen_pods_lane():
    clock = Clock(100.0)
    router, store, *_ = router_with(PODS, clock=clock, scheduling=WITH_PREFILL)
    first = route(router, "r0")
    assert first.decision.factor("prefill") == 1.0
    cold = COST.seconds(4096, 0, 16)
    assert lane_end(router, first.endpoint) == pytest.approx(100.0 + cold)
    other = next(e for e in store.all() if e is not first.endpoint)
    assert lane_end(router, other) == 0.0

    # Same prompt at once: the pod holding it wins (cache 0.30 + most of the prefill
    # score), and its lane grows by the *cached* estimate: only the last token computed.
    second = route(router, "r1")
    assert second.endpoint is first.endpoint
    hit = COST.seconds(4096, 256, 16)
    assert hit < 0.05
    assert lane_end(router, first.endpoint) == pytest.approx(100.0 + cold + hit)

    # Later, with the lane drained: the next prefill starts at `now`, not at the lane end.
    clock.now = 500.0
    third = route(router, "r2")
    assert third.endpoint is first.endpoint
    assert lane_end(router, first.endpoint) == pytest.approx(500.0 + hit)


def test_a_long_lane_sends_the_same_prompt_to_the_idle_pod():
    clock = Clock(100.0)
    router, *_ = router_with(PODS, clock=clock, scheduling=WITH_PREFILL)
    first = route(router, "r0")
    # Pretend many prefills are queued on the pod holding the prompt (3 s more).
    prefill_of(router).state(first.endpoint).lane_end += 3.0
    second = route(router, "r1")
    assert second.endpoint is not first.endpoint
    assert second.decision.factor("prefill") == 1.0
    assert second.decision.factor("cache") == 0.0


# -- completions ---------------------------------------------------------------------
def test_a_completion_with_a_response_moves_the_pods_mean_request_time():
    clock = Clock(100.0)
    router, *_ = router_with(PODS, clock=clock, scheduling=WITH_PREFILL)
    failed, answered = route(router, "r0"), route(router, "r1")
    clock.now += 2.0
    router.complete(failed.token, 503)
    assert prefill_of(router).state(failed.endpoint).service_s is None  # not a response
    router.complete(answered.token, 200)
    assert prefill_of(router).state(answered.endpoint).service_s == pytest.approx(2.0)


def test_a_request_served_by_a_fallback_blames_the_primary_and_records_the_fallbacks_status():
    """Envoy retried on the next address of the list: the primary refused (a 503 on its
    record, its reservation released), the status is the fallback's."""
    clock = Clock(100.0)
    router, store, _, metrics = router_with(PODS, clock=clock, scheduling=WITH_PREFILL)
    routed = route(router)
    primary = routed.endpoint
    fallback = next(e for e in store.all() if e is not primary)
    clock.now += 1.0
    router.complete(routed.token, 500, served_address=fallback.address)
    assert metrics.fallback_served._value.get() == 1
    assert primary.in_flight == 0 and primary.error_rate > 0.0
    assert fallback.error_rate > 0.0 and fallback.in_flight == 0
    # The primary's completion reached the scorer as the 503 it was: no request time.
    assert prefill_of(router).state(primary).service_s is None
    router.complete(routed.token, 200, served_address=fallback.address)  # once only
    assert metrics.fallback_served._value.get() == 1


def test_a_fallback_the_store_does_not_know_still_releases_the_primary():
    router, _store, _, metrics = router_with(PODS)
    routed = route(router)
    router.complete(routed.token, 200, served_address="10.9.9.9:8000")
    assert metrics.fallback_served._value.get() == 1
    assert routed.endpoint.in_flight == 0 and routed.endpoint.error_rate > 0.0


# -- endpoint store events, as the app connects them ---------------------------------
def hashes_of(router) -> list:
    return router.prepare(IncomingRequest(path="/v1/completions", body=BODY, request_id="h")).hashes


def test_a_removed_pod_leaves_the_index_its_open_requests_and_the_scorer_state():
    clock = Clock(100.0)
    router, store, index, _ = router_with(PODS, clock=clock, scheduling=WITH_PREFILL)
    routed = route(router)
    gone = routed.endpoint
    assert index.match(hashes_of(router)) == {gone.name: 256}
    assert lane_end(router, gone) > 100.0
    store.sync(configs([p for p in PODS if p["name"] != gone.name]))
    assert index.blocks(gone.name) == 0 and index.match(hashes_of(router)) == {}
    # The scorer forgot it (asking again creates a fresh state) ...
    assert prefill_of(router).state(gone) == PrefillState()
    # ... and so did the router: completing its request changes nothing.
    router.complete(routed.token, 500)
    assert gone.error_rate == 0.0 and gone.in_flight == 1
    # Added again under the same name, the pod starts afresh.
    store.sync(configs(PODS))
    again = store.get(gone.name)
    assert again is not gone and lane_end(router, again) == 0.0


def test_an_engine_restart_forgets_the_pods_blocks_but_not_its_capacity():
    router, store, index, _ = router_with(PODS)
    routed = route(router)
    pod = routed.endpoint
    store.scraped(pod, PodMetrics(model="m", prefix_queries=50, num_gpu_blocks=100, block_size=32))
    # Its page reports 100 blocks of 32 tokens: 200 of ours, and the index keeps no more.
    assert index.capacity(pod.name) == 200 and index.blocks(pod.name) == 200
    store.scraped(pod, PodMetrics(model="m", prefix_queries=10, num_gpu_blocks=100, block_size=32))
    assert index.blocks(pod.name) == 0 and index.capacity(pod.name) == 200


@pytest.mark.parametrize(
    ("reported_blocks", "reported_size", "use_reported", "capacity"),
    [
        (1000, 16, True, 1000),  # the pod's own KV size
        (1000, 32, True, 2000),  # counted in our 16-token blocks
        (10**9, 16, True, 31_250),  # never above capacity_per_pod
        (1000, 16, False, 31_250),  # switched off
        (None, None, True, 31_250),  # not reported
    ],
)
def test_a_pods_index_capacity_is_the_smaller_of_its_reported_kv_and_the_configured_one(
    reported_blocks, reported_size, use_reported, capacity
):
    _router, store, index, _ = router_with(PODS, prefix={"use_reported_capacity": use_reported})
    a = store.get("a")
    store.scraped(
        a, PodMetrics(model="m", num_gpu_blocks=reported_blocks, block_size=reported_size)
    )
    assert index.capacity("a") == capacity


async def test_a_pod_added_while_requests_wait_takes_them():
    router, store, *_ = router_with(PODS[:1], scheduling={"max_queue": 1, "running_slots": 1})
    held = [
        await router.route(IncomingRequest(path="/v1/completions", body=BODY, request_id=f"h{i}"))
        for i in (0, 1)
    ]
    waiter = asyncio.create_task(
        router.route(IncomingRequest(path="/v1/completions", body=BODY, request_id="w"))
    )
    while router.waiting == 0:
        await asyncio.sleep(0)
    store.sync(configs(PODS))  # "added": b has room
    routed = await asyncio.wait_for(waiter, 10.0)  # a guard against a hang, not a timing
    assert routed.endpoint.name == "b" and router.waiting == 0
    assert {h.endpoint.name for h in held} == {"a"}


# -- health on the response path -----------------------------------------------------
def test_a_pod_excluded_for_5xx_gets_traffic_again_once_its_error_rate_decays():
    """Excluded, it gets no request whose success could lower its error rate: only time
    does (error_decay_s 10 s), down to the readmit level (health 0.5)."""
    clock = Clock(100.0)
    router, store, *_ = router_with(PODS, clock=clock, scheduling=WITHOUT_PREFILL)
    hot = route(router, "warm").endpoint  # holds BODY's prompt from now on
    failures = 0
    while not hot.excluded:
        routed = route(router, f"f{failures}")
        assert routed.endpoint is hot  # cache-hot, until excluded
        router.complete(routed.token, 500)
        failures += 1
    assert failures == 6  # health 0.8^6 = 0.26 < 0.3
    rate = 1 - 0.8**6

    def after(seconds: float):
        clock.now += seconds
        for e in store.all():
            store.scraped(e, PodMetrics(model="m"))
        store.refresh_health()

    back_at = 10 * math.log(rate / 0.5)  # 3.9 s: 1 - rate x e^(-t/10) reaches 0.5
    after(back_at - 0.2)
    other = route(router, "cold", json.dumps({"model": "m", "prompt": "y" * 400}).encode())
    assert hot.excluded and other.decision.filtered_out == {"health": 1}
    router.complete(other.token, 200)
    after(0.4)
    assert not hot.excluded
    assert route(router, "back").endpoint is hot
