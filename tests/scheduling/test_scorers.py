"""Each factor's formula, and the composed score on worked examples."""

from __future__ import annotations

import random

import pytest
from helpers import config, endpoint

from epp.config import SPEC_WEIGHTS, SchedulingConfig
from epp.datalayer.endpoint import Dispatch
from epp.scheduling.registry import ScorerRegistry
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.scorers.adapter import AdapterScorer
from epp.scheduling.scorers.cache import CacheScorer
from epp.scheduling.scorers.cost import CostScorer
from epp.scheduling.scorers.health import HealthScorer
from epp.scheduling.scorers.load import LoadScorer
from epp.scheduling.scorers.queue import QueueScorer
from epp.scheduling.types import SchedulingError, SchedulingRequest


def request(blocks: int = 4, match: dict[str, int] | None = None, **kw) -> SchedulingRequest:
    return SchedulingRequest(
        request_id="r",
        base_model="m",
        block_hashes=list(range(blocks)),
        prefix_match=match or {},
        **kw,
    )


def test_cache_scorer_is_matched_over_total_blocks():
    pods = [endpoint("a"), endpoint("b"), endpoint("c")]
    scores = CacheScorer().score(request(4, {"a": 4, "b": 3}), pods)
    assert scores == [1.0, 0.75, 0.0]


def test_cache_scorer_short_prompt_matches_nothing():
    assert CacheScorer().score(request(0), [endpoint("a")]) == [0.0]


@pytest.mark.parametrize(("kv", "expected"), [(0.0, 1.0), (0.9, 0.1), (1.0, 0.0), (1.7, 0.0)])
def test_load_scorer_inverts_kv_usage(kv, expected):
    assert LoadScorer().score(request(), [endpoint("a", kv=kv)]) == [pytest.approx(expected)]


@pytest.mark.parametrize(
    ("waiting", "expected"), [(0, 1.0), (1, 0.95), (2, 0.90), (10, 0.5), (20, 0.0), (35, 0.0)]
)
def test_each_queued_request_costs_one_twentieth(waiting, expected):
    assert QueueScorer(max_queue=20).score(request(), [endpoint("a", waiting=waiting)]) == [
        pytest.approx(expected)
    ]


def test_queue_counts_requests_sent_since_last_scrape_beyond_free_slots():
    pod = endpoint("a", waiting=2)
    pod.configured_slots = 4
    pod.metrics.running = 4
    for seq in (1, 2, 3):  # sent after the page: the pod's 4 slots are full, so they wait
        pod.open[seq] = Dispatch(seq, 0, 0.0)
        pod.dispatched_total = seq
        pod.in_flight += 1
    pod.refresh()
    assert QueueScorer(max_queue=20).score(request(), [pod]) == [pytest.approx(0.75)]
    pod.metrics.running = 1  # 3 free slots: the same 3 run at once, nothing more waits
    pod.refresh()
    assert QueueScorer(max_queue=20).score(request(), [pod]) == [pytest.approx(0.9)]


def test_adapter_scorer():
    pods = [endpoint("a", adapters=frozenset({"sql"})), endpoint("b")]
    assert AdapterScorer().score(request(adapter="sql"), pods) == [1.0, 0.0]
    assert AdapterScorer().score(request(), pods) == [1.0, 1.0]


def test_adapter_scorer_gives_partial_credit_for_a_free_adapter_slot():
    resident = endpoint("a", adapters=frozenset({"sql"}))
    room = endpoint("b", adapters=frozenset({"chat"}))
    full = endpoint("c", adapters=frozenset({"chat", "math"}))
    for pod in (resident, room, full):
        pod.metrics.max_loras = 2
        pod.refresh()
    assert AdapterScorer().score(request(adapter="sql"), [resident, room, full]) == [
        1.0,
        0.5,
        0.0,
    ]


def test_health_scorer_passes_health_through():
    assert HealthScorer().score(request(), [endpoint("a", health=0.7)]) == [0.7]


def test_cache_hot_loaded_pod_beats_idle_cold_pod():
    """80% load + 100% match = 0.64 on cache+load; idle + no match = 0.20."""
    weights = {"cache": 0.6, "load": 0.2, "queue": 0.1, "health": 0.05, "adapter": 0.05}
    scheduler = Scheduler(SchedulingConfig(weights=weights))
    hot, idle = endpoint("hot", kv=0.8), endpoint("idle", kv=0.0)
    decision = scheduler.schedule(request(8, {"hot": 8}), [hot, idle])
    assert decision.primary is hot
    cache, load = decision.factors["cache"], decision.factors["load"]
    assert 0.6 * cache[0] + 0.2 * load[0] == pytest.approx(0.64)
    assert 0.6 * cache[1] + 0.2 * load[1] == pytest.approx(0.20)
    # The rest (queue, health, adapter) is equal for both: 0.10 + 0.05 + 0.05.
    assert decision.totals == [pytest.approx(0.84), pytest.approx(0.40)]


def test_counterintuitive_case_busy_pod_with_empty_queue_wins():
    """80% busy with 0 queued beats 40% busy with 10 queued? Load 0.2*0.2=0.04 vs
    0.2*0.6=0.12 and queue 0.10 vs 0.05: B wins by 0.03 with the default weights, which is
    what the formula says; with w_queue raised to 0.30 A wins."""
    a, b = endpoint("a", kv=0.8, waiting=0), endpoint("b", kv=0.4, waiting=10)
    default = Scheduler(SchedulingConfig(weights=SPEC_WEIGHTS)).schedule(request(), [a, b])
    assert default.totals[1] - default.totals[0] == pytest.approx(0.03)
    queue_heavy = SchedulingConfig(
        weights={"cache": 0.4, "load": 0.2, "queue": 0.3, "health": 0.05, "adapter": 0.05}
    )
    assert Scheduler(queue_heavy).schedule(request(), [a, b]).primary is a


def test_health_below_threshold_is_excluded():
    sick, fine = endpoint("sick", health=0.29), endpoint("fine", health=0.3)
    decision = Scheduler(SchedulingConfig()).schedule(request(4, {"sick": 4}), [sick, fine])
    assert decision.primary is fine
    assert [e.name for e in decision.candidates] == ["fine"]
    assert decision.filtered_out == {"health": 1}


def test_no_healthy_pod_is_503():
    with pytest.raises(SchedulingError) as err:
        Scheduler(SchedulingConfig()).schedule(request(), [endpoint("a", health=0.1)])
    assert err.value.status == 503


def test_full_queue_leaves_pool_and_all_saturated_is_429():
    hot, cold = endpoint("hot", waiting=20), endpoint("cold", waiting=19)
    scheduler = Scheduler(SchedulingConfig())
    assert scheduler.schedule(request(4, {"hot": 4}), [hot, cold]).primary is cold
    cold.metrics.waiting = 25
    cold.refresh()
    with pytest.raises(SchedulingError) as err:
        scheduler.schedule(request(), [hot, cold])
    assert (err.value.status, err.value.reason) == (429, "rejected-saturated")


def test_subset_hint_restricts_and_empty_match_is_503():
    a, b = endpoint("a", port=1), endpoint("b", port=2)
    scheduler = Scheduler(SchedulingConfig())
    decision = scheduler.schedule(request(4, {"a": 4}, subset=frozenset({b.address})), [a, b])
    assert decision.primary is b and len(decision.candidates) == 1
    with pytest.raises(SchedulingError) as err:
        scheduler.schedule(request(subset=frozenset({"10.9.9.9:1"})), [a, b])
    assert err.value.status == 503


def test_model_filter_keeps_unknown_and_matching_pods():
    a, b, c = endpoint("a", model="m"), endpoint("b", model="other"), endpoint("c", model=None)
    decision = Scheduler(SchedulingConfig()).schedule(request(), [a, b, c])
    assert {e.name for e in decision.candidates} == {"a", "c"}


def test_ties_are_broken_at_random_not_by_order():
    pods = [endpoint(f"p{i}") for i in range(4)]
    scheduler = Scheduler(SchedulingConfig(), rng=random.Random(7))
    chosen = {scheduler.schedule(request(), pods).primary.name for _ in range(200)}
    assert chosen == {"p0", "p1", "p2", "p3"}


def test_fallbacks_are_next_best_and_bounded_by_pool():
    pods = [endpoint("a", kv=0.1), endpoint("b", kv=0.5), endpoint("c", kv=0.9)]
    decision = Scheduler(SchedulingConfig(fallbacks=3)).schedule(request(), pods)
    assert [e.name for e in decision.endpoints] == ["a", "b", "c"]
    decision = Scheduler(SchedulingConfig(fallbacks=1)).schedule(request(), pods)
    assert [e.name for e in decision.endpoints] == ["a", "b"]


def test_composite_score_stays_in_unit_interval_and_breakdown_sorted():
    pods = [endpoint("a", kv=0.3, waiting=4, health=0.8), endpoint("b", kv=0.0)]
    decision = Scheduler(SchedulingConfig()).schedule(request(4, {"a": 4}), pods)
    assert all(0.0 <= t <= 1.0 for t in decision.totals)
    rows = decision.breakdown()
    assert rows[0]["score"] >= rows[1]["score"]
    assert set(rows[0]) == {
        "pod",
        "score",
        "cache",
        "load",
        "queue",
        "health",
        "adapter",
        "prefill",
    }


@pytest.mark.parametrize(
    "weights",
    [
        {"cache": 0.6, "load": 0.2},
        {"cache": 0.6, "load": 0.2, "queue": 0.1, "health": 0.05, "adapter": 0.15},
        {"cache": 1.2, "load": -0.2},
        {},
    ],
)
def test_weights_must_sum_to_one(weights):
    with pytest.raises(ValueError, match="weight"):
        config(scheduling={"weights": weights})


def test_unknown_scorer_name_is_a_clear_error():
    bad = SchedulingConfig(weights={"cache": 0.9, "lattency": 0.1})
    with pytest.raises(ValueError, match="lattency"):
        Scheduler(bad)


def test_custom_scorer_registered_with_a_weight_changes_the_decision():
    """Cost-aware routing: equal cache, the cheap spot pod wins."""
    registry = ScorerRegistry()

    class PreferLabel:
        name = "zone"

        def score(self, request, candidates):
            return [1.0 if e.labels.get("zone") == "local" else 0.0 for e in candidates]

    registry.register("zone", lambda cfg: PreferLabel())
    with pytest.raises(ValueError, match="already registered"):
        registry.register("zone", lambda cfg: PreferLabel())
    weights = {
        "cache": 0.5,
        "load": 0.2,
        "queue": 0.1,
        "health": 0.05,
        "adapter": 0.05,
        "zone": 0.1,
    }
    scheduler = Scheduler(SchedulingConfig(weights=weights), registry)
    far, near = (
        endpoint("far", labels={"zone": "remote"}),
        endpoint("near", labels={"zone": "local"}),
    )
    assert scheduler.schedule(request(), [far, near]).primary is near
    # ... but not against a full cache match: 0.5 * 1.0 outweighs 0.1.
    assert scheduler.schedule(request(4, {"far": 4}), [far, near]).primary is far


def test_builtin_cost_scorer():
    pods = [
        endpoint("a100", labels={"cost_per_hour": "3.67"}),
        endpoint("a10g", labels={"cost_per_hour": "0.38"}),
        endpoint("unlabelled"),
    ]
    scores = CostScorer().score(request(), pods)
    assert scores[0] == 0.0 and scores[1] == pytest.approx(1 - 0.38 / 3.67) and scores[2] == 0.0


def test_equal_scores_go_to_the_pod_with_fewer_requests_in_flight():
    """Metrics lag: two idle-looking pods, one just given a request by this EPP."""
    busy, idle = endpoint("busy"), endpoint("idle")
    busy.in_flight = 1
    scheduler = Scheduler(SchedulingConfig(fallbacks=1), rng=random.Random(1))
    for _ in range(20):
        decision = scheduler.schedule(request(), [busy, idle])
        assert decision.primary is idle
        assert [e.name for e in decision.endpoints] == ["idle", "busy"]


def test_equal_idle_pods_take_new_prefixes_in_turn_by_the_work_given_so_far():
    """Between conversation turns both pods are idle: the one given less work so far
    takes the next new prefix, so groups alternate instead of landing 3:1 by chance."""
    a, b = endpoint("a"), endpoint("b")
    a.dispatched_tokens, b.dispatched_tokens = 5_000, 700
    scheduler = Scheduler(SchedulingConfig(), rng=random.Random(3))
    for _ in range(10):
        assert scheduler.schedule(request(), [a, b]).primary is b
    b.in_flight = 1  # requests in flight still come first
    assert scheduler.schedule(request(), [a, b]).primary is a


def test_the_imbalance_guard_when_enabled_drops_a_far_busier_pod_whatever_its_cache():
    hot, idle = endpoint("hot"), endpoint("idle")
    hot.in_flight, idle.in_flight = 5, 0
    on = SchedulingConfig(balance={"enabled": True, "abs_requests": 4, "ratio": 3.0})
    decision = Scheduler(on).schedule(request(4, {"hot": 4}), [hot, idle])
    assert decision.primary is idle and decision.filtered_out == {"balance": 1}
    hot.in_flight = 4  # not more than least + 4: kept, and its cache wins
    assert Scheduler(on).schedule(request(4, {"hot": 4}), [hot, idle]).primary is hot
    # Off by default.
    hot.in_flight = 50
    assert (
        Scheduler(SchedulingConfig()).schedule(request(4, {"hot": 4}), [hot, idle]).primary is hot
    )


def test_cache_scorer_a_one_block_prompt_held_whole_scores_one():
    assert CacheScorer().score(request(1, {"a": 1}), [endpoint("a"), endpoint("b")]) == [1.0, 0.0]


def test_cache_scorer_a_prompt_without_blocks_scores_zero_whatever_the_match_says():
    assert CacheScorer().score(request(0, {"a": 3}), [endpoint("a"), endpoint("b")]) == [0.0, 0.0]


def cost_pods(*costs: str | None):
    return [
        endpoint(f"p{i}", labels={} if c is None else {"cost_per_hour": c})
        for i, c in enumerate(costs)
    ]


@pytest.mark.parametrize(
    ("costs", "expected"),
    [
        ((None, None), [0.0, 0.0]),  # nobody labelled: no bonus for anyone
        (("0", "0"), [0.0, 0.0]),  # all free: nothing to tell apart
        (("0", "2"), [1.0, 0.0]),  # a free pod gets the whole bonus
        (("0.25", "0.5"), [0.5, 0.0]),  # costs below 1 compare like any others
        (("-1", "1", "2"), [0.0, 0.5, 0.0]),  # a negative cost is no cost label
        (("cheap", "1", "2"), [0.0, 0.5, 0.0]),  # nor is one that is not a number
    ],
)
def test_cost_scorer_edge_cases(costs, expected):
    assert CostScorer().score(request(), cost_pods(*costs)) == [pytest.approx(e) for e in expected]
