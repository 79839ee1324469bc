"""The compiled scheduler kernels of the filters, the queue scorer and the range check
(src/epp/scheduling/_kernels.c) against their pure-Python twins on random fleets."""

from __future__ import annotations

import math
import random

import pytest
from helpers import endpoint

from epp import kernels
from epp.scheduling.filters import HealthFilter, ModelFilter
from epp.scheduling.scorers.queue import QueueScorer
from epp.scheduling.types import SchedulingRequest

compiled = kernels.SCHEDULING
pytestmark = pytest.mark.skipif(compiled is None, reason="compiled kernels not built")


def fleet(rng: random.Random, size: int):
    pods = []
    for i in range(size):
        e = endpoint(f"p{i}", port=9000 + i, model=rng.choice(["m", "m", "other", None]))
        e.queue_depth = rng.choice([0.0, 1.0, 19.0, 20.0, 21.0, rng.uniform(0, 40), 7])
        e.excluded = rng.random() < 0.3
        e.panic = rng.random() < 0.2
        pods.append(e)
    return pods


def request(base_model: str | None) -> SchedulingRequest:
    return SchedulingRequest(request_id="r", base_model=base_model, block_hashes=[])


def twin(module_user, monkeypatch, function, *args):
    """`function(*args)` with the pure-Python twin of `module_user`'s kernel."""
    with monkeypatch.context() as patch:
        patch.setattr(module_user, "COMPILED", None)
        return function(*args)


@pytest.mark.parametrize("size", [0, 1, 7, 64, 1000])
def test_the_filters_and_the_queue_scorer_are_the_twins(size, monkeypatch):
    from epp.scheduling import filters
    from epp.scheduling.scorers import queue

    rng = random.Random(size)
    for _ in range(30 if size < 1000 else 3):
        pods = fleet(rng, size)
        for wanted in ("m", "other", "absent"):
            model = ModelFilter().filter
            got = model(request(wanted), pods)
            assert got == twin(filters, monkeypatch, model, request(wanted), pods)
        health = HealthFilter().filter
        assert health(request("m"), pods) == twin(filters, monkeypatch, health, request("m"), pods)
        for max_queue in (1, 20, 3):
            score = QueueScorer(max_queue).score
            got = score(request("m"), pods)
            expected = twin(queue, monkeypatch, score, request("m"), pods)
            assert [v.hex() for v in got] == [v.hex() for v in expected]


def test_the_range_check_flags_a_score_outside_the_unit_interval_or_nan():
    rng = random.Random(4)
    pool = [0.0, -0.0, 1.0, 0.5, -1e-300, 1.0000000000000002, math.nan, math.inf, -math.inf]
    for _ in range(3000):
        scores = [rng.choice(pool) for _ in range(rng.randrange(0, 6))]
        expected = any(not 0.0 <= s <= 1.0 for s in scores)  # the twin's rule
        assert compiled.outside_unit(scores) == expected, scores
    # Anything but a list of floats is left to the twin.
    assert compiled.outside_unit([0.5, 1]) is None
    assert compiled.outside_unit((0.5,)) is None


@pytest.mark.parametrize("kernels_used", ["compiled", "python"], indirect=True)
def test_a_scorer_that_returns_nan_scores_zero_and_the_pick_still_happens(kernels_used):
    """A custom scorer's NaN is clamped to 0, like a negative score: before, a NaN first
    total made the picker's tie list empty and the decision raised IndexError."""
    from epp.config import SchedulingConfig
    from epp.scheduling.registry import ScorerRegistry
    from epp.scheduling.scheduler import Scheduler

    class Broken:
        name = "broken"

        def score(self, request, candidates):
            return [math.nan] + [0.5] * (len(candidates) - 1)

    registry = ScorerRegistry()
    registry.register("broken", lambda config: Broken())
    weights = {"cache": 0.5, "load": 0.1, "queue": 0.1, "health": 0.05, "adapter": 0.05}
    config = SchedulingConfig(weights={**weights, "broken": 0.2})
    scheduler = Scheduler(config, registry)
    pods = [endpoint(f"p{i}", port=9000 + i) for i in range(3)]
    decision = scheduler.schedule(request("m"), pods)
    assert decision.factors["broken"] == [0.0, 0.5, 0.5]
    assert decision.primary.name in ("p1", "p2")


def test_the_filter_kernels_raise_on_broken_candidates():
    class Bare:
        pass

    with pytest.raises(AttributeError):
        compiled.model_filter([Bare()], "m")
    with pytest.raises(AttributeError):
        compiled.health_filter([Bare()])
    with pytest.raises(AttributeError):
        compiled.queue_scores([Bare()], 20.0)
    with pytest.raises(ZeroDivisionError):
        compiled.queue_scores([endpoint("a")], 0.0)
    with pytest.raises(TypeError):
        compiled.health_filter((endpoint("a"),))


def test_a_candidate_whose_attribute_empties_the_list_does_not_crash():
    """An attribute hook that empties the list being filtered: the filter reads its size
    at each step and keeps only what it saw."""
    pods: list = []

    class Shrinking:
        model = None
        excluded = False

        @property
        def panic(self):
            pods.clear()
            return True

    pods.extend([Shrinking(), Shrinking(), Shrinking()])
    assert len(compiled.health_filter(pods)) == 1
