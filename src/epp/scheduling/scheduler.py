"""Filters -> weighted scorers -> picker, over the endpoints the data layer keeps."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, overload

from epp.config import SchedulingConfig
from epp.datalayer.endpoint import Endpoint
from epp.kernels import SCHEDULING as COMPILED
from epp.scheduling.filters import (
    BalanceFilter,
    HealthFilter,
    ModelFilter,
    SaturationFilter,
    SubsetFilter,
)
from epp.scheduling.picker import MaxScorePicker
from epp.scheduling.registry import ScorerRegistry
from epp.scheduling.types import (
    Decision,
    Filter,
    Picker,
    PodEvent,
    PodStateScorer,
    SchedulingError,
    SchedulingRequest,
    Scorer,
)


class Scheduler:
    def __init__(
        self,
        config: SchedulingConfig,
        registry: ScorerRegistry | None = None,
        picker: Picker | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        registry = registry or ScorerRegistry()
        # The registry's filters (the operator's own) run after those that say which pods
        # may serve the request and before those that measure room: a pod they remove
        # neither makes a request wait for it (saturation: 429, flow control holds it) nor
        # counts as the least busy pod (balance).
        self.filters: list[Filter] = [
            SubsetFilter(),
            ModelFilter(),
            HealthFilter(),
            *registry.build_filters(config),
            SaturationFilter(max_queue=config.max_queue),
        ]
        if config.balance.enabled:
            self.filters.append(BalanceFilter(config.balance.abs_requests, config.balance.ratio))
        self.profile = registry.build(config)
        self.weights = {scorer.name: weight for scorer, weight in self.profile}
        self._profile_weights = tuple(weight for _, weight in self.profile)
        self._weighted_sum = weighted_sum(len(self.profile))
        # Scorers with per-pod state of their own (types.PodStateScorer).
        self._observers = [s for s, _ in self.profile if isinstance(s, PodStateScorer)]
        self.picker = picker or MaxScorePicker(rng, config.tie_epsilon)

    def scorer(self, name: str) -> Scorer | None:
        """The profile's scorer of that name (None if it has no weight)."""
        return next((s for s, _ in self.profile if s.name == name), None)

    def observe(self, event: PodEvent) -> None:
        """What the router did (a dispatch, a completion, a pod removed), for the scorers
        that keep per-pod state; nothing happens when none does."""
        for scorer in self._observers:
            scorer.observe(event)

    def schedule(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> Decision:
        if not endpoints:
            raise SchedulingError(503, "rejected-no-endpoints", "no inference endpoints are known")
        candidates = list(endpoints)
        removed: dict[str, int] = {}
        for f in self.filters:
            kept = f.filter(request, candidates)
            if len(kept) != len(candidates):
                removed[f.name] = len(candidates) - len(kept)
            if not kept:
                raise SchedulingError(f.reject_status, f.reject_reason, _explain(f.name, request))
            candidates = kept
        factors: dict[str, list[float]] = {}
        columns: list[list[float]] = []
        for scorer, _weight in self.profile:
            scores = scorer.score(request, candidates)
            if len(scores) != len(candidates):
                raise ValueError(f"scorer {scorer.name!r} returned {len(scores)} scores")
            # Scores outside [0, 1] (a custom scorer's bug) are clamped, not trusted; the
            # copy only happens when needed.
            if scores and _outside_unit(scores):  # NaN counts as 0: it would tie nothing
                scores = [0.0 if not s >= 0.0 else 1.0 if s > 1.0 else s for s in scores]
            factors[scorer.name] = scores
            columns.append(scores)
        if COMPILED is not None:
            totals = COMPILED.weighted_sum(self._profile_weights, columns)
        else:
            totals = self._weighted_sum(*self._profile_weights, *columns)
        # Equal scores: the pod with the fewest requests in flight from this EPP wins, then
        # the one given the least work so far (uncached prompt tokens); see picker.py. Read
        # only for the tied candidates, so computed on demand.
        tiebreak = _Tiebreak(candidates)
        chosen = self.picker.pick(totals, 1 + self.config.fallbacks, tiebreak)
        return Decision(
            request_id=request.request_id,
            endpoints=[candidates[i] for i in chosen],
            candidates=candidates,
            totals=totals,
            factors=factors,
            weights=self.weights,
            chosen_index=chosen[0],
            filtered_out=removed,
        )


def _outside_unit(scores: list[float]) -> bool:
    """A score outside [0, 1], or NaN (a custom scorer's bug): the scores are clamped."""
    outside = COMPILED.outside_unit(scores) if COMPILED is not None else None
    if outside is None:  # the twin (and any list the kernel leaves to it: not all floats)
        return any(not 0.0 <= s <= 1.0 for s in scores)
    return outside


def weighted_sum(count: int) -> Callable[..., list[float]]:
    """A function of `count` weights then `count` score lists returning, per candidate,
    (the pure-Python twin of the compiled `weighted_sum`, epp.kernels)
    w0 * s0 + w1 * s1 + ... added left to right (the same float operations in the same
    order as adding one weighted list at a time), in one comprehension over the pods: a
    decision at 1,000 pods spent a fifth of its time in one list pass per scorer. The
    comprehension is generated because its arity is the profile's length."""
    if count < 1:
        # The config guarantees at least one scorer; a profile without any cannot decide.
        def no_scorer(*_: object) -> list[float]:
            raise AssertionError("the scheduling profile has no scorer")

        return no_scorer
    weights = ", ".join(f"w{i}" for i in range(count))
    lists = ", ".join(f"s{i}" for i in range(count))
    items = ", ".join(f"x{i}" for i in range(count))
    terms = " + ".join(f"w{i} * x{i}" for i in range(count))
    source = (
        f"def weighted_sum({weights}, {lists}):\n"
        f"    return [{terms} for {items}{',' if count == 1 else ''} in zip({lists}, strict=True)]\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<weighted_sum {count}>", "exec"), namespace)
    function: Callable[..., list[float]] = namespace["weighted_sum"]
    return function


class _Tiebreak(Sequence[float]):
    """Per candidate: requests in flight from this EPP + dispatched tokens x 1e-13 (lower
    wins), computed when the picker reads it."""

    __slots__ = ("_candidates",)

    def __init__(self, candidates: list[Endpoint]) -> None:
        self._candidates = candidates

    def __len__(self) -> int:
        return len(self._candidates)

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[float]: ...
    def __getitem__(self, index: int | slice) -> float | Sequence[float]:
        if isinstance(index, slice):
            return [e.in_flight + e.dispatched_tokens * 1e-13 for e in self._candidates[index]]
        e = self._candidates[index]
        return e.in_flight + e.dispatched_tokens * 1e-13


def _explain(filter_name: str, request: SchedulingRequest) -> str:
    return {
        "subset": "no endpoint of the pool is in the proxy's subset for this request",
        "model": f"The model `{request.model}` does not exist.",
        "health": "no healthy endpoint is available",
        "saturation": "every endpoint's queue is full; retry later",
    }.get(filter_name, f"filter {filter_name!r} removed every endpoint")
