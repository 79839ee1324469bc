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


def test_the_range_check_is_pythons_min_and_max():
    rng = random.Random(4)
    pool = [0.0, -0.0, 1.0, 0.5, -1e-300, 1.0000000000000002, math.nan, math.inf, -math.inf]
    for _ in range(3000):
        scores = [rng.choice(pool) for _ in range(rng.randrange(1, 6))]
        assert compiled.outside_unit(scores) == (min(scores) < 0.0 or max(scores) > 1.0), scores
    # Anything but a non-empty list of floats is left to the twin.
    assert compiled.outside_unit([]) is None
    assert compiled.outside_unit([0.5, 1]) is None
    assert compiled.outside_unit((0.5,)) is None


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
