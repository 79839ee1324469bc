"""The compiled scheduler kernels (src/epp/scheduling/_kernels.c) against their
pure-Python twins, the reference: the same inputs give the same scores to the last bit."""

from __future__ import annotations

import gc
import math
import random
import sys

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


def compiled_prefill(scorer: PrefillScorer, request: SchedulingRequest, fleet: list) -> list | None:
    """The compiled pass on the scorer's state, with the arguments `score` gives it."""
    cost = scorer.cost
    return compiled.prefill(
        fleet, scorer._pods, request.prefix_match, request.now, _FRESH.lane_end,
        cost.overhead_s, cost.per_token_s, cost.per_cached_token_s,
        request.prompt_tokens, request.block_size,
    )  # fmt: skip


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
        got = compiled_prefill(scorer, request, fleet)
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


def test_the_weighted_sum_refuses_a_later_column_longer_than_the_first():
    # The twin's zip(strict=True) refuses both ways; a shorter-only check reads past a list.
    with pytest.raises(ValueError, match="different lengths"):
        compiled.weighted_sum((0.5, 0.5), [[1.0], [1.0, 0.0]])
    with pytest.raises(ValueError):
        weighted_sum(2)(0.5, 0.5, [1.0], [1.0, 0.0])


def test_the_weighted_sum_is_the_twins_on_signed_zeros_and_non_finite_values():
    """A custom scorer may return any float: -0.0 stays -0.0 (no 0.0 + ... start), and
    inf and NaN go through the same operations in the same order."""
    rng = random.Random(4)
    odd = [0.0, -0.0, -1.0, 1.0, math.inf, -math.inf, math.nan, 1e308, -5e-324]
    for _ in range(2000):
        k = rng.randrange(1, 5)
        n = rng.randrange(1, 6)
        weights = tuple(rng.choice(odd) for _ in range(k))
        columns = [[rng.choice(odd) for _ in range(n)] for _ in range(k)]
        expected = weighted_sum(k)(*weights, *columns)
        assert bits(compiled.weighted_sum(weights, columns)) == bits(expected), (weights, columns)


def test_the_prefill_pass_is_the_twins_on_odd_inputs():
    """Outside what the router sends, the kernel still does what the twin does: a clock
    before the fresh lane end, NaN or infinite lane ends and costs (a NaN ttft must not
    replace the minimum: min() keeps the first), negative block counts (truthy, so not
    cold), a cached-token cost that makes the cold formula's 0 * per_cached a NaN."""
    rng = random.Random(5)
    names = [f"p{i}" for i in range(6)]
    odd = [0.0, -0.0, 1.0, -2.0, math.inf, -math.inf, math.nan, 1e-9]
    for _ in range(1500):
        fleet = [endpoint(name, port=9000 + i) for i, name in enumerate(names)]
        cost = PrefillCost(*(rng.choice([*odd, 0.01, 0.0002]) for _ in range(3)))
        scorer = PrefillScorer(cost)
        request = random_request(rng, names)
        request.now = rng.choice([-5.0, 0.0, 3.0, math.nan])
        for name in rng.sample(names, rng.randrange(0, 4)):
            request.prefix_match[name] = rng.choice([-3, -1, 0, 1, 2])
        for e in fleet:
            if rng.random() < 0.6:
                scorer.state(e).lane_end = rng.choice([*odd, request.now + 1.0])
        got = compiled_prefill(scorer, request, fleet)
        assert got is not None
        assert bits(got) == bits(scorer.python_score(request, fleet)), (cost, request)


class LeakArgs:
    """Arguments whose refcounts are their own (no cached small ints or interned strs)."""

    def __init__(self) -> None:
        self.weights = (0.25 + 1e-9, 0.75 + 1e-9)
        self.column = [0.5 + 1e-9, 1.5 + 1e-9, 2.5 + 1e-9]
        self.other = (1.0 + 1e-9, 2.0 + 1e-9, 3.0 + 1e-9)
        self.totals = [1.0 + 1e-9, 3.0 + 1e-9, 3.0 + 2e-9]
        self.fleet = [endpoint("leak-a"), endpoint("leak-b", port=9001)]
        self.pods = {
            self.fleet[0]: PrefillScorer(PrefillCost(0.01, 0.0002, 0.00001)).state(self.fleet[0])
        }
        self.pods[self.fleet[0]].lane_end = 7.0 + 1e-9
        self.fleet[1].name = "".join(["leak-", "b"])  # not interned
        self.matched = {"leak-a": 3000, "leak-b": 4000}
        self.slotted = [endpoint("leak-c"), endpoint("leak-d")]
        self.slotted[1].configured_slots = 4
        self.bad_column = [0.5 + 1e-9, 1.0 + 1e-9, "x"]  # fails on the last candidate
        self.bad_matched = {"leak-b": "many"}
        self.ties = [2.0 + 1e-9] * 300  # indexes past the small-int cache: each a new int
        # What the prefill pass reads, as objects of their own.
        self.lane_end = self.pods[self.fleet[0]].lane_end
        self.names = [e.name for e in self.fleet]
        self.fleet[0].configured_slots = float("0.0")  # falsy: no slots
        self.slotted[1].configured_slots = 10**20
        self.slots = [self.fleet[0].configured_slots, self.slotted[1].configured_slots]

    def refcounts(self) -> list[int]:
        return [
            sys.getrefcount(x)
            for value in vars(self).values()
            for x in (value, *(value if isinstance(value, list | tuple) else ()))
        ]


def leak_calls(a: LeakArgs) -> None:
    costs = (0.0, 0.01, 0.0002, 0.00001)
    assert len(compiled.weighted_sum(a.weights, [a.column, a.other])) == 3
    with pytest.raises(ValueError):
        compiled.weighted_sum(a.weights, [a.column, a.other[:2]])
    with pytest.raises(TypeError):
        compiled.weighted_sum(a.weights, [a.column, a.bad_column])
    with pytest.raises(TypeError):
        compiled.weighted_sum(a.weights, [a.column, 5])
    with pytest.raises(TypeError):
        compiled.weighted_sum(a.weights, 5)
    assert compiled.tied(a.totals, 1e-6) == [1, 2]
    assert len(compiled.tied(a.ties, 0.0)) == 300
    with pytest.raises(TypeError):
        compiled.tied([*a.totals, "x"], 0.1)
    assert len(compiled.prefill(a.fleet, a.pods, a.matched, 5.0, *costs, 9000, 16)) == 2
    assert compiled.prefill(a.slotted, a.pods, a.matched, 5.0, *costs, 9000, 16) is None
    with pytest.raises(TypeError):
        compiled.prefill(a.fleet, a.pods, a.bad_matched, 5.0, *costs, 9000, 16)
    with pytest.raises(AttributeError):
        compiled.prefill([*a.fleet, object()], a.pods, a.matched, 5.0, *costs, 9000, 16)


def test_the_kernels_keep_no_reference_after_a_call():
    """Every path, errors included, gives back what it took: a leaked reference shows in
    an argument's refcount, a leaked new object in the count of allocated blocks."""
    args = LeakArgs()
    for _ in range(200):  # warm up free lists
        leak_calls(args)
    gc.collect()
    refs = args.refcounts()
    blocks = sys.getallocatedblocks()
    nones = sys.getrefcount(None)
    for _ in range(2000):
        leak_calls(args)
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 200  # one leak per call: >= 2000
    assert args.refcounts() == refs
    assert abs(sys.getrefcount(None) - nones) < 1000  # None returned without its reference
