"""The compiled scheduler kernels (src/epp/scheduling/_kernels.c) against their
pure-Python twins, the reference: the same inputs give the same scores to the last bit."""

from __future__ import annotations

import math
import random

import pytest
from helpers import endpoint

from epp import kernels
from epp.scheduling.picker import python_tied
from epp.scheduling.scheduler import weighted_sum
from epp.scheduling.scorers.prefill import _FRESH, PrefillCost, PrefillScorer
from epp.scheduling.types import SchedulingRequest

compiled = kernels.SCHEDULING
pytestmark = pytest.mark.skipif(compiled is None, reason="compiled kernels not built")


def bits(values: list[float]) -> list[str]:
    """Floats as their exact bits (-0.0 and 0.0 differ; every NaN equals itself)."""
    return [v.hex() if not math.isnan(v) else "nan" for v in map(float, values)]


def score_value(rng: random.Random) -> float:
    return rng.choice([0.0, 1.0, 0.5, rng.random(), rng.random() * 1e-9, 1 - 1e-16])


def test_the_weighted_sum_is_the_twins_bit_for_bit():
    rng = random.Random(1)
    for _ in range(500):
        k = rng.randrange(1, 8)
        n = rng.randrange(0, 70)
        weights = tuple(
            rng.choice([0.0, 0.6, 0.2, 0.1, 0.05, rng.random(), 1e-3]) for _ in range(k)
        )
        columns = [[score_value(rng) for _ in range(n)] for _ in range(k)]
        expected = weighted_sum(k)(*weights, *columns)
        assert bits(compiled.weighted_sum(weights, columns)) == bits(expected)
        # A custom scorer's tuple is a column too.
        assert bits(compiled.weighted_sum(weights, [tuple(c) for c in columns])) == bits(expected)


def test_the_weighted_sum_refuses_what_it_cannot_add():
    with pytest.raises(ValueError, match="different lengths"):
        compiled.weighted_sum((0.5, 0.5), [[1.0, 0.0], [1.0]])
    with pytest.raises(ValueError, match="one weight per column"):
        compiled.weighted_sum((0.5,), [[1.0], [1.0]])
    with pytest.raises(ValueError, match="one weight per column"):
        compiled.weighted_sum((), [])
    with pytest.raises(TypeError):
        compiled.weighted_sum((0.5,), [["x"]])


def test_the_ties_are_the_twins_with_nan_and_equal_bests():
    rng = random.Random(2)
    for _ in range(2000):
        n = rng.randrange(1, 40)
        levels = [rng.random() for _ in range(3)]
        totals = [rng.choice([*levels, rng.random()]) for _ in range(n)]
        if rng.random() < 0.1:
            totals[rng.randrange(n)] = math.nan
        eps = rng.choice([0.0, 1e-9, 0.005, 0.3])
        assert compiled.tied(totals, eps) == python_tied(totals, eps), (totals, eps)
    with pytest.raises(ValueError, match="no totals"):
        compiled.tied([], 0.1)


def random_request(rng: random.Random, names: list[str]) -> SchedulingRequest:
    prompt = rng.choice([0, 1, 2, 15, 16, 17, 900, 4096, 100_000])
    match = {n: rng.randrange(0, 300) for n in names if rng.random() < 0.6}
    if rng.random() < 0.2:
        match["not-a-candidate"] = 5
    return SchedulingRequest(
        request_id="r",
        base_model="m",
        block_hashes=[],
        prefix_match=match,
        prompt_tokens=prompt,
        block_size=rng.choice([1, 16, 64]),
        now=rng.choice([0.0, 1000.0, 1e9 + 0.25]),
    )


@pytest.mark.parametrize("pods", [1, 5, 64, 1000])
def test_the_prefill_pass_is_the_twins_bit_for_bit(pods):
    rng = random.Random(pods)
    for _ in range(60 if pods < 1000 else 6):
        fleet = [endpoint(f"p{i}", port=9000 + i) for i in range(pods)]
        cost = rng.choice(
            [
                PrefillCost(0.010, 0.000217, 0.0000077),
                PrefillCost(0.0, 0.0, 0.0),  # zero costs: idle pods score 1.0
                PrefillCost(rng.random(), rng.random() * 1e-3, rng.random() * 1e-4),
            ]
        )
        scorer = PrefillScorer(cost)
        request = random_request(rng, [e.name for e in fleet])
        for e in fleet:
            if rng.random() < 0.6:
                scorer.state(e).lane_end = request.now + rng.uniform(-3.0, 3.0)
        got = compiled.prefill(
            fleet, scorer._pods, request.prefix_match, request.now, _FRESH.lane_end,
            cost.overhead_s, cost.per_token_s, cost.per_cached_token_s,
            request.prompt_tokens, request.block_size,
        )  # fmt: skip
        assert got is not None
        assert bits(got) == bits(scorer.python_score(request, fleet))


def test_a_pod_with_configured_slots_is_left_to_the_twin():
    fleet = [endpoint("a"), endpoint("b")]
    fleet[1].configured_slots = 4
    scorer = PrefillScorer(PrefillCost(0.01, 0.0002, 0.00001))
    request = random_request(random.Random(3), ["a", "b"])
    args = (fleet, scorer._pods, request.prefix_match, request.now, 0.0, 0.01, 0.0002, 0.00001)
    assert compiled.prefill(*args, request.prompt_tokens, request.block_size) is None
    # score() then runs the twin, which prices the slot wait.
    assert scorer.score(request, fleet) == scorer.python_score(request, fleet)


def test_the_prefill_pass_raises_on_a_broken_candidate():
    class NoName:
        configured_slots = None

    with pytest.raises(AttributeError):
        compiled.prefill([NoName()], {}, {}, 0.0, 0.0, 0.01, 0.0002, 0.00001, 10, 16)
    with pytest.raises(TypeError):
        compiled.prefill([endpoint("a")], {}, {"a": "many"}, 0.0, 0.0, 0.1, 0.1, 0.1, 10, 16)
