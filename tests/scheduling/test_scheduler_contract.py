"""The Scheduler's contract with its callers: the status, reason and message of each
rejection (the router sends them to the client as they are), what it does with a custom
scorer's bad output, the registry's one-line error for unknown names, and what a Decision
reports (its factors and the DEBUG breakdown)."""

from __future__ import annotations

import random

import pytest
from helpers import endpoint

from epp.config import SchedulingConfig
from epp.datalayer.endpoint import Endpoint
from epp.scheduling.filters import BalanceFilter
from epp.scheduling.registry import ScorerRegistry
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import (
    Completed,
    Decision,
    Dispatched,
    Removed,
    SchedulingError,
    SchedulingRequest,
)


def request(**kw) -> SchedulingRequest:
    kw.setdefault("base_model", "m")
    return SchedulingRequest(request_id="r", **kw)


def rejection(scheduler: Scheduler, req: SchedulingRequest, pods) -> SchedulingError:
    with pytest.raises(SchedulingError) as err:
        scheduler.schedule(req, pods)
    return err.value


def test_no_endpoint_known_is_a_503_that_says_so():
    err = rejection(Scheduler(SchedulingConfig()), request(), [])
    assert (err.status, err.reason, err.message) == (
        503,
        "rejected-no-endpoints",
        "no inference endpoints are known",
    )
    assert str(err) == "no inference endpoints are known"


@pytest.mark.parametrize(
    ("case", "status", "reason", "message"),
    [
        (
            "subset",
            503,
            "rejected-subset-no-match",
            "no endpoint of the pool is in the proxy's subset for this request",
        ),
        ("model", 404, "model-not-found", "The model `llama-9b` does not exist."),
        ("health", 503, "rejected-no-healthy-endpoints", "no healthy endpoint is available"),
        ("saturation", 429, "rejected-saturated", "every endpoint's queue is full; retry later"),
    ],
)
def test_the_filter_that_leaves_nobody_answers_with_its_status_reason_and_message(
    case, status, reason, message
):
    pods = [endpoint("a", port=1), endpoint("b", port=2)]
    req = request()
    if case == "subset":
        req = request(subset=frozenset({"10.9.9.9:1"}))
    elif case == "model":
        req = request(model="llama-9b", base_model="llama-9b")
    elif case == "health":
        pods = [endpoint("a", health=0.1), endpoint("b", health=0.2)]
    else:
        pods = [endpoint("a", waiting=20), endpoint("b", waiting=31)]
    err = rejection(Scheduler(SchedulingConfig()), req, pods)
    assert (err.status, err.reason, err.message) == (status, reason, message)
    assert str(err) == message


def test_a_custom_filter_that_leaves_nobody_is_named_in_the_message():
    class NoZone:
        name = "zone"
        reject_status = 503
        reject_reason = "rejected-no-zone"

        def filter(self, request, candidates):
            return []

    scheduler = Scheduler(SchedulingConfig())
    scheduler.filters.append(NoZone())
    err = rejection(scheduler, request(), [endpoint("a")])
    assert (err.status, err.reason, err.message) == (
        503,
        "rejected-no-zone",
        "filter 'zone' removed every endpoint",
    )


def test_the_imbalance_guard_allows_ratio_times_the_least_busy_pods_load():
    # least 10 in flight: the limit is max(10 + 4, 10 x 3) = 30, not 14.
    pods = [endpoint(name) for name in ("least", "twice", "over")]
    for pod, in_flight in zip(pods, (10, 20, 31), strict=True):
        pod.in_flight = in_flight
    kept = BalanceFilter(abs_requests=4, ratio=3.0).filter(request(), pods)
    assert [e.name for e in kept] == ["least", "twice"]


class Fixed:
    """A custom scorer returning the same scores whatever it is asked (possibly wrong)."""

    def __init__(self, scores: list[float]) -> None:
        self.name = "fixed"
        self.scores = scores

    def score(self, request, candidates) -> list[float]:
        return list(self.scores)


def scheduler_with(scores: list[float]) -> Scheduler:
    registry = ScorerRegistry()
    registry.register("fixed", lambda config: Fixed(scores))
    config = SchedulingConfig(weights={"fixed": 0.5, "health": 0.5})
    return Scheduler(config, registry, rng=random.Random(0))


@pytest.mark.parametrize(
    ("returned", "used"),
    [
        ([1.5, 0.5, 0.25], [1.0, 0.5, 0.25]),
        ([-0.5, 0.5, 1.0], [0.0, 0.5, 1.0]),
        ([0.0, 0.5, 1.0], [0.0, 0.5, 1.0]),
    ],
)
def test_a_custom_scorers_scores_outside_the_unit_interval_are_clamped(returned, used):
    pods = [endpoint("a"), endpoint("b"), endpoint("c")]
    decision = scheduler_with(returned).schedule(request(), pods)
    assert decision.factors["fixed"] == used
    assert decision.totals == [pytest.approx(0.5 * s + 0.5) for s in used]


def test_a_scorer_returning_the_wrong_number_of_scores_is_named():
    scheduler = scheduler_with([0.5])
    with pytest.raises(ValueError, match=r"^scorer 'fixed' returned 1 scores$"):
        scheduler.schedule(request(), [endpoint("a"), endpoint("b")])


def test_unknown_scorer_names_are_listed_in_one_line_with_the_known_ones():
    registry = ScorerRegistry()
    config = SchedulingConfig(weights={"cache": 0.8, "qeue": 0.1, "lattency": 0.1})
    with pytest.raises(ValueError) as err:
        registry.check(config)
    assert str(err.value) == (
        "unknown scorer(s) in scheduling.weights: lattency, qeue; "
        "known: adapter, cache, cost, health, load, prefill, queue"
    )
    registry.check(SchedulingConfig(weights={"cache": 0.5, "cost": 0.5}))  # all known: fine


def decision(pods: list[Endpoint]) -> Decision:
    return Decision(
        request_id="r",
        endpoints=[pods[1]],
        candidates=pods,
        totals=[0.123456, 0.654321, 0.4],
        factors={"cache": [0.111111, 0.987654, 0.5], "load": [1.0, 0.0, 0.33333]},
        weights={"cache": 0.6, "load": 0.4},
        chosen_index=1,
    )


def test_a_factor_without_a_weight_reads_none_and_one_with_a_weight_the_chosen_pods():
    d = decision([endpoint("a"), endpoint("b"), endpoint("c")])
    assert d.factor("cache") == 0.987654
    assert d.factor("cost") is None
    assert d.primary.name == "b" and d.score == 0.654321


def test_the_breakdown_lists_the_best_first_rounded_to_four_digits():
    d = decision([endpoint("a"), endpoint("b"), endpoint("c")])
    assert d.breakdown() == [
        {"pod": "b", "score": 0.6543, "cache": 0.9877, "load": 0.0},
        {"pod": "c", "score": 0.4, "cache": 0.5, "load": 0.3333},
        {"pod": "a", "score": 0.1235, "cache": 0.1111, "load": 1.0},
    ]
    assert [row["pod"] for row in d.breakdown(2)] == ["b", "c"]


def test_a_seeded_rng_makes_the_tie_breaks_reproducible():
    pods = [endpoint(f"p{i}") for i in range(4)]

    def picks(seed: int) -> list[str]:
        scheduler = Scheduler(SchedulingConfig(), rng=random.Random(seed))
        return [scheduler.schedule(request(), pods).primary.name for _ in range(40)]

    assert picks(11) == picks(11)
    assert len(set(picks(11))) == 4


def test_totals_closer_than_the_configured_tie_epsilon_are_equal():
    # kv 0.01 apart is 0.001 apart in total with the default load weight (0.1): a tie at the
    # default epsilon (0.005), so the pod with fewer requests in flight wins.
    near, busy = endpoint("near", kv=0.01), endpoint("busy", kv=0.0)
    busy.in_flight = 1
    default = Scheduler(SchedulingConfig(), rng=random.Random(0))
    assert default.schedule(request(), [near, busy]).primary is near
    exact = Scheduler(SchedulingConfig(tie_epsilon=0.0), rng=random.Random(0))
    assert exact.schedule(request(), [near, busy]).primary is busy


def test_the_decision_carries_the_request_id_and_the_weights_the_logs_explain_it_with():
    weights = {"cache": 0.6, "load": 0.2, "queue": 0.1, "health": 0.05, "adapter": 0.05}
    scheduler = Scheduler(SchedulingConfig(weights=weights), rng=random.Random(0))
    d = scheduler.schedule(SchedulingRequest(request_id="req-42", base_model="m"), [endpoint("a")])
    assert d.request_id == "req-42"
    assert d.weights == weights


def test_a_scorer_given_weight_zero_is_not_built():
    weights = {"cache": 0.6, "load": 0.4, "prefill": 0.0, "cost": 0.0}
    scheduler = Scheduler(SchedulingConfig(weights=weights), rng=random.Random(0))
    assert scheduler.weights == {"cache": 0.6, "load": 0.4}
    assert scheduler.scorer("prefill") is None and scheduler.scorer("cost") is None
    d = scheduler.schedule(request(), [endpoint("a"), endpoint("b")])
    assert set(d.factors) == {"cache", "load"}


def test_the_imbalance_guard_takes_its_ratio_from_the_config():
    # least 10: limit max(10 + 4, 10 x 2) = 20 with ratio 2 (30 with the default 3).
    pods = [endpoint("least"), endpoint("busy")]
    pods[0].in_flight, pods[1].in_flight = 10, 25
    on = SchedulingConfig(balance={"enabled": True, "abs_requests": 4, "ratio": 2.0})
    d = Scheduler(on, rng=random.Random(0)).schedule(request(), pods)
    assert [e.name for e in d.candidates] == ["least"]
    assert d.filtered_out == {"balance": 1}


def test_the_router_events_reach_every_weighted_scorer_with_state_of_its_own():
    scheduler = Scheduler(SchedulingConfig(), rng=random.Random(0))  # prefill weighted
    prefill = scheduler.scorer("prefill")
    a = endpoint("a")
    scheduler.observe(Dispatched(request(prompt_tokens=4096, now=100.0), a))
    scheduler.observe(Completed(a, 200, 2.0))
    state = prefill.state(a)
    assert state.lane_end > 100.0 and state.service_s == 2.0
    scheduler.observe(Removed(a))
    assert prefill.state(a).service_s is None
    # Without a weight no scorer keeps state: events are accepted and go nowhere.
    unweighted = Scheduler(SchedulingConfig(weights={"cache": 0.5, "load": 0.5}))
    unweighted.observe(Dispatched(request(), a))
