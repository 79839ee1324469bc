"""Router: the prefill lanes are kept at dispatch, and only while `prefill` is scored;
scorer state hears of completions and removed pods."""

from __future__ import annotations

import json

import pytest
from helpers import router_with

from epp.config import DEFAULT_WEIGHTS, SPEC_WEIGHTS, PrefillEstimateConfig
from epp.scheduling.scorers.prefill import PrefillCost, PrefillScorer
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


def route(router, request_id: str = "r"):
    return router.route_now(path="/v1/completions", body=BODY, request_id=request_id)


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
