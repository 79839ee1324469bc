"""The optional `prefill` scorer: expected TTFT per pod, best / this pod's; its per-pod
state (lanes, mean request time) kept from the router's events."""

from __future__ import annotations

import random

import pytest
from helpers import endpoint

from epp.config import DEFAULT_WEIGHTS, SPEC_WEIGHTS, PrefillEstimateConfig, SchedulingConfig
from epp.scheduling.registry import BUILTIN_SCORERS
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.scorers.prefill import PrefillCost, PrefillScorer, PrefillState
from epp.scheduling.types import Completed, Dispatched, Removed, SchedulingRequest

COST = PrefillCost.from_config(PrefillEstimateConfig())  # 8B on A100: 0.9 s per 4,096 cold
NOW = 1000.0
PROMPT = 4096  # 256 blocks of 16
OWN_HOT = 0.010 + 1 * 0.000217 + 4095 * 0.0000077  # full match: only the last token computed
OWN_COLD = 0.010 + 4096 * 0.000217
BREAK_EVEN = OWN_COLD - OWN_HOT  # ~0.857 s of queued prefill on the hot pod


def request(match: dict[str, int] | None = None, prompt: int = PROMPT) -> SchedulingRequest:
    return SchedulingRequest(
        request_id="r",
        base_model="m",
        block_hashes=list(range(prompt // 16)),
        prefix_match=match or {},
        prompt_tokens=prompt,
        block_size=16,
        now=NOW,
    )


def pod(name: str):
    return endpoint(name)


def scorer_with(lanes: dict, cost: PrefillCost = COST) -> PrefillScorer:
    """A scorer whose lanes end `lanes[pod]` seconds after NOW."""
    scorer = PrefillScorer(cost)
    for e, left in lanes.items():
        scorer.state(e).lane_end = NOW + left
    return scorer


def test_idle_pods_without_a_match_tie_at_one(kernels_used):
    assert PrefillScorer(COST).score(request(), [pod("a"), pod("b"), pod("c")]) == [1.0] * 3


@pytest.mark.parametrize(
    ("hot_lane_s", "winner"),
    [
        (0.0, "hot"),
        (0.5, "hot"),
        (BREAK_EVEN - 0.01, "hot"),
        (BREAK_EVEN + 0.01, "idle"),
        (3.0, "idle"),
        (-5.0, "hot"),  # a lane that ended in the past is free, not "5 s early"
    ],
)
def test_full_prefix_match_wins_until_its_queued_prefill_outweighs_the_hit(
    hot_lane_s, winner, kernels_used
):
    hot, idle = pod("hot"), pod("idle")
    scorer = scorer_with({hot: hot_lane_s, idle: 0.0})
    hot_score, idle_score = scorer.score(request({"hot": 256}), [hot, idle])
    scores = {"hot": hot_score, "idle": idle_score}
    loser = "idle" if winner == "hot" else "hot"
    assert scores[winner] == 1.0
    assert 0.0 < scores[loser] < 1.0
    ttft_hot = max(0.0, hot_lane_s) + OWN_HOT
    expected = min(ttft_hot, OWN_COLD) / max(ttft_hot, OWN_COLD)
    assert scores[loser] == pytest.approx(expected)


def test_the_last_prompt_token_is_never_counted_as_cached(kernels_used):
    # 32 tokens, both blocks held: 31 cached, 1 computed (it produces the first token).
    assert COST.seconds(32, 2, 16) == pytest.approx(0.010 + 0.000217 + 31 * 0.0000077)
    assert COST.seconds(0, 0, 16) == pytest.approx(0.010)
    assert COST.seconds(40, 99, 16) == COST.seconds(40, 3, 16)  # a match beyond the prompt


def test_scores_stay_in_unit_interval_and_the_best_pod_gets_one(kernels_used):
    rng = random.Random(7)
    for _ in range(300):
        prompt = rng.randrange(0, 20_000)
        pods = [pod(f"p{i}") for i in range(rng.randrange(1, 9))]
        scorer = scorer_with({p: rng.uniform(-2.0, 10.0) for p in pods})
        match = {p.name: rng.randrange(0, prompt // 16 + 2) for p in pods if rng.random() < 0.5}
        scores = scorer.score(request(match, prompt), pods)
        assert all(0.0 <= s <= 1.0 for s in scores) and max(scores) == 1.0
        # Zero costs and every lane free: nothing to tell apart, nothing divided by zero.
        idle = [pod(p.name) for p in pods]
        zero = scorer_with(dict.fromkeys(idle, 0.0), PrefillCost(0.0, 0.0, 0.0))
        assert zero.score(request(match, prompt), idle) == [1.0] * len(idle)


def test_on_by_default_at_half_the_weight_and_off_with_the_spec_weights(kernels_used):
    assert "prefill" in BUILTIN_SCORERS
    assert Scheduler(SchedulingConfig()).weights["prefill"] == 0.5
    assert {n: w * 0.5 for n, w in SPEC_WEIGHTS.items()} | {"prefill": 0.5} == DEFAULT_WEIGHTS
    assert "prefill" not in Scheduler(SchedulingConfig(weights=SPEC_WEIGHTS)).weights


@pytest.mark.parametrize(("hot_lane_s", "winner"), [(1.0, "hot"), (3.0, "idle")])
def test_weighted_with_the_halved_defaults_the_cache_hit_holds_longer(
    hot_lane_s, winner, kernels_used
):
    # Composite: the cache factor (0.30) still favours the hot pod, so it loses only once
    # its expected TTFT is ~2.5x the idle pod's (~2.2 s of queued prefill here).
    scheduler = Scheduler(SchedulingConfig(weights=DEFAULT_WEIGHTS), rng=random.Random(0))
    hot, idle = pod("hot"), pod("idle")
    prefill = scheduler.scorer("prefill")
    assert isinstance(prefill, PrefillScorer)
    prefill.state(hot).lane_end = NOW + hot_lane_s
    decision = scheduler.schedule(request({"hot": 256}), [hot, idle])
    assert decision.primary.name == winner
    expected = 1.0 if winner == "idle" else OWN_COLD / (hot_lane_s + OWN_HOT)
    assert decision.factor("prefill") == pytest.approx(expected)


def test_a_pod_with_every_running_slot_taken_prices_the_wait_for_one(kernels_used):
    """Seen on two real vLLM servers: a cache-hot pod running its 4 slots with one more
    waiting beat a pod with a free slot (0.86 vs 0.29), because the estimate saw only
    queued prefill. A full pod's new request waits for (on pod - slots + 1) completions,
    one every service time / slots."""
    full, free = pod("full"), pod("free")
    scheduler = Scheduler(SchedulingConfig(), rng=random.Random(0))
    prefill = scheduler.scorer("prefill")
    assert isinstance(prefill, PrefillScorer)
    for e, running, waiting in ((full, 4, 1), (free, 1, 0)):
        e.configured_slots = 4
        prefill.state(e).service_s = 4.0
        e.metrics.running, e.metrics.waiting = running, waiting
        e.refresh()
    decision = scheduler.schedule(request({"full": 230}), [full, free])
    assert decision.primary is free
    wait = (5 - 4 + 1) * 4.0 / 4  # two completions ahead of it, one every second
    assert decision.factor("prefill") == 1.0
    prefill = dict(
        zip((e.name for e in decision.candidates), decision.factors["prefill"], strict=True)
    )
    own_full = COST.seconds(PROMPT, 230, 16)
    assert prefill["full"] == pytest.approx(OWN_COLD / (wait + own_full))
    # With a slot free the cache-hot pod wins again.
    full.metrics.running, full.metrics.waiting = 3, 0
    full.refresh()
    assert scheduler.schedule(request({"full": 230}), [full, free]).primary is full


def test_slot_wait_takes_the_pods_then_the_pools_mean_then_its_oldest_request(kernels_used):
    from epp.datalayer.endpoint import Dispatch
    from epp.scheduling.scorers.prefill import slot_wait

    e = pod("a")
    e.metrics.running, e.metrics.waiting = 8, 4
    e.refresh()
    assert slot_wait(e, NOW) == 0.0  # slots not configured: learned ones are not trusted
    e.configured_slots = 8
    e.refresh()
    assert slot_wait(e, NOW) == 0.0  # nothing known about its request times
    e.open[1] = Dispatch(1, 100, NOW - 1.5)  # none finished, the oldest running for 1.5 s
    e.in_flight = 1
    e.refresh()
    assert slot_wait(e, NOW) == pytest.approx(5 * 1.5 / 8)
    assert slot_wait(e, NOW, pool_service_s=3.0) == pytest.approx(5 * 3.0 / 8)
    assert slot_wait(e, NOW, service_s=4.0, pool_service_s=3.0) == pytest.approx(5 * 4.0 / 8)


def test_dispatch_queues_the_prefill_on_the_pods_lane_first_come_first_served(kernels_used):
    scorer, a = PrefillScorer(COST), pod("a")
    assert scorer.score(request(), [a]) == [1.0]  # a pod never seen: an idle lane
    scorer.observe(Dispatched(request({"a": 0}), a))
    assert scorer.state(a).lane_end == pytest.approx(NOW + OWN_COLD)
    # The next one starts when the first is over, and is priced with the match it saw.
    scorer.observe(Dispatched(request({"a": 256}), a))
    assert scorer.state(a).lane_end == pytest.approx(NOW + OWN_COLD + OWN_HOT)
    # Once the lane has drained, a prefill starts at `now`.
    later = request({"a": 256})
    later.now = NOW + 60.0
    scorer.observe(Dispatched(later, a))
    assert scorer.state(a).lane_end == pytest.approx(NOW + 60.0 + OWN_HOT)


def test_completions_with_a_response_move_the_mean_request_time(kernels_used):
    scorer, a = PrefillScorer(COST), pod("a")
    for status, seconds in ((None, 9.0), (503, 9.0), (200, None)):
        scorer.observe(Completed(a, status, seconds))
    assert scorer.state(a).service_s is None  # no response, a 5xx, or duration unknown
    scorer.observe(Completed(a, 200, 2.0))
    assert scorer.state(a).service_s == 2.0
    scorer.observe(Completed(a, 404, 12.0))
    assert scorer.state(a).service_s == pytest.approx(2.0 + 0.1 * (12.0 - 2.0))


def test_a_removed_pod_starts_afresh(kernels_used):
    scorer, a = PrefillScorer(COST), pod("a")
    scorer.observe(Dispatched(request(), a))
    scorer.observe(Completed(a, 200, 1.0))
    scorer.observe(Removed(a))
    assert scorer.state(a) == PrefillState()
    scorer.observe(Removed(pod("never-seen")))  # nothing to forget: no error


def test_a_one_token_prompt_computes_its_token_whatever_the_match(kernels_used):
    assert COST.seconds(1, 1, 16) == pytest.approx(0.010 + 0.000217)
    assert COST.seconds(0, 1, 16) == pytest.approx(0.010)


def test_slot_wait_uses_the_age_of_a_young_oldest_request_as_it_is(kernels_used):
    from epp.datalayer.endpoint import Dispatch
    from epp.scheduling.scorers.prefill import slot_wait

    e = pod("a")
    e.configured_slots = 8
    e.metrics.running, e.metrics.waiting = 8, 4
    e.open[1] = Dispatch(1, 100, NOW - 0.5)  # running for half a second only
    e.in_flight = 1
    e.refresh()
    assert slot_wait(e, NOW) == pytest.approx(5 * 0.5 / 8)


def test_a_peers_dispatch_extends_the_lane_up_to_its_limit_only(kernels_used):
    scorer, a = PrefillScorer(COST), pod("a")
    scorer.observe(Dispatched(request(), a, lane_limit=NOW + 0.5))  # OWN_COLD is ~0.9 s
    assert scorer.state(a).lane_end == pytest.approx(NOW + 0.5)
    scorer.observe(Dispatched(request(), a, lane_limit=NOW + 0.2))  # a limit never shortens it
    assert scorer.state(a).lane_end == pytest.approx(NOW + 0.5)
    scorer.observe(Dispatched(request({"a": 256}), a, lane_limit=NOW + 9.0))  # under the limit
    assert scorer.state(a).lane_end == pytest.approx(NOW + 0.5 + OWN_HOT)


def test_a_500_answer_does_not_move_the_mean_request_time(kernels_used):
    scorer, a = PrefillScorer(COST), pod("a")
    scorer.observe(Completed(a, 500, 9.0))
    assert scorer.state(a).service_s is None
    scorer.observe(Completed(a, 499, 3.0))
    assert scorer.state(a).service_s == 3.0


def test_a_full_pod_without_request_times_of_its_own_is_priced_with_the_pools_mean(kernels_used):
    # Three pods, every slot taken and one request waiting (two completions ahead of a new
    # one), none with a request in flight from this EPP: each waits 2 x service / 4 slots,
    # with its own mean request time, else the mean of the others' (2 s and 4 s: 3 s).
    pods = [pod("none"), pod("two"), pod("four")]
    scorer = PrefillScorer(COST)
    for e, service in zip(pods, (None, 2.0, 4.0), strict=True):
        e.configured_slots = 4
        e.metrics.running, e.metrics.waiting = 4, 1
        e.refresh()
        scorer.state(e).service_s = service
    waits = [2 * 3.0 / 4, 2 * 2.0 / 4, 2 * 4.0 / 4]
    best = waits[1] + OWN_COLD
    assert scorer.score(request(), pods) == [pytest.approx(best / (w + OWN_COLD)) for w in waits]


def test_a_pod_whose_slots_are_exactly_full_makes_a_new_request_wait_for_one_completion(
    kernels_used,
):
    from epp.scheduling.scorers.prefill import slot_wait

    e = pod("a")
    e.configured_slots = 4
    e.metrics.running, e.metrics.waiting = 4, 0
    e.refresh()
    assert slot_wait(e, NOW, service_s=2.0) == pytest.approx(1 * 2.0 / 4)
    e.metrics.running = 3  # a slot free: no wait
    e.refresh()
    assert slot_wait(e, NOW, service_s=2.0) == 0.0


def test_a_dispatch_to_a_pod_without_a_match_is_priced_cold(kernels_used):
    scorer, a = PrefillScorer(COST), pod("a")
    scorer.observe(Dispatched(request({"b": 256}), a))  # only another pod holds the prompt
    assert scorer.state(a).lane_end == pytest.approx(NOW + OWN_COLD)


def test_the_scorer_prices_a_full_pod_without_request_times_by_its_oldest_request(kernels_used):
    from epp.datalayer.endpoint import Dispatch

    full, free = pod("full"), pod("free")
    for e, running in ((full, 4), (free, 1)):
        e.configured_slots = 4
        e.metrics.running, e.metrics.waiting = running, 0
    full.open[1] = Dispatch(1, 100, NOW - 2.0)  # nothing finished yet, running for 2 s
    full.in_flight = 1
    for e in (full, free):
        e.refresh()
    wait = 1 * 2.0 / 4
    assert PrefillScorer(COST).score(request(), [full, free]) == [
        pytest.approx(OWN_COLD / (wait + OWN_COLD)),
        1.0,
    ]


def test_the_one_pass_score_is_exactly_the_documented_formula(kernels_used):
    """The scoring loop inlines PrefillCost.seconds and slot_wait's max for speed: over
    random pods (lanes drained or not, slots configured or not, full or not, request times
    known or not, matches past the prompt) every score equals, to the last bit, the module
    formula computed from those two documented functions."""
    from epp.scheduling.scorers.prefill import slot_wait

    rng = random.Random(7)
    for _ in range(200):
        pods = [pod(f"p{i}") for i in range(rng.randrange(1, 12))]
        scorer = PrefillScorer(COST)
        match: dict[str, int] = {}
        for e in pods:
            if rng.random() < 0.6:
                scorer.state(e).lane_end = NOW + rng.uniform(-2.0, 2.0)
            if rng.random() < 0.5:
                scorer.state(e).service_s = rng.uniform(0.1, 5.0)
            if rng.random() < 0.5:
                e.configured_slots = rng.randrange(1, 6)
                e.metrics.running, e.metrics.waiting = rng.randrange(0, 8), rng.randrange(0, 4)
                e.refresh()
            if rng.random() < 0.7:
                match[e.name] = rng.randrange(0, 300)
        prompt = rng.choice([1, 2, 17, 900, PROMPT])
        scores = scorer.score(request(match, prompt), pods)
        states = [scorer._pods.get(e, PrefillState()) for e in pods]
        known = [s.service_s for s in states if s.service_s is not None]
        pool = sum(known) / len(known) if known else None
        ttft = [
            max(max(0.0, s.lane_end - NOW), slot_wait(e, NOW, s.service_s, pool))
            + COST.seconds(prompt, match.get(e.name, 0), 16)
            for e, s in zip(pods, states, strict=True)
        ]
        best = min(ttft)
        assert scores == [best / t if t > 0.0 else 1.0 for t in ttft]
