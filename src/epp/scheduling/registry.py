"""Scorer names -> factories, and the weighted profile built from the configured weights;
the operator's own filters.

Registration is explicit (no import side effects): built-ins are listed here, and an
operator's own scorer is added with `registry.register("name", factory)` before the
profile is built, then given a weight in `scheduling.weights`. An operator's own filter
is added with `registry.add_filter(factory)`: it has no weight and always runs (where in
the chain: scheduler.py).
"""

from __future__ import annotations

from collections.abc import Callable

from epp.config import SchedulingConfig
from epp.scheduling.scorers.adapter import AdapterScorer
from epp.scheduling.scorers.cache import CacheScorer
from epp.scheduling.scorers.cost import CostScorer
from epp.scheduling.scorers.health import HealthScorer
from epp.scheduling.scorers.load import LoadScorer
from epp.scheduling.scorers.prefill import PrefillCost, PrefillScorer
from epp.scheduling.scorers.queue import QueueScorer
from epp.scheduling.types import Filter, Scorer

ScorerFactory = Callable[[SchedulingConfig], Scorer]
FilterFactory = Callable[[SchedulingConfig], Filter]

BUILTIN_SCORERS: dict[str, ScorerFactory] = {
    "cache": lambda config: CacheScorer(),
    "load": lambda config: LoadScorer(),
    "queue": lambda config: QueueScorer(max_queue=config.max_queue),
    "health": lambda config: HealthScorer(),
    "adapter": lambda config: AdapterScorer(),
    # `cost` is off unless given a weight; `prefill` has 0.5 in the default weights. It
    # keeps per-pod state of its own (types.PodStateScorer): without a weight, none exists.
    "cost": lambda config: CostScorer(),
    "prefill": lambda config: PrefillScorer(PrefillCost.from_config(config.prefill_estimate)),
}


class ScorerRegistry:
    def __init__(self) -> None:
        self._factories: dict[str, ScorerFactory] = dict(BUILTIN_SCORERS)
        self._filters: list[FilterFactory] = []

    def register(self, name: str, factory: ScorerFactory) -> None:
        if name in self._factories:
            raise ValueError(f"a scorer named {name!r} is already registered")
        self._factories[name] = factory

    def add_filter(self, factory: FilterFactory) -> None:
        """A filter of the operator's own, run in the order added (scheduler.py). It reads
        the pods, and of the request only what flow control keys waiting requests by (its
        base model and subset: routing/types.placement); otherwise a waiting request could
        be held back by another's verdict."""
        self._filters.append(factory)

    def build_filters(self, config: SchedulingConfig) -> list[Filter]:
        """The added filters, built for this config."""
        return [factory(config) for factory in self._filters]

    @property
    def names(self) -> list[str]:
        return sorted(self._factories)

    def check(self, config: SchedulingConfig) -> None:
        """ValueError, one line naming the unknown names and the known ones, when a weight
        names no registered scorer (a typo would otherwise fail only when the profile is built)."""
        unknown = sorted(set(config.weights) - set(self._factories))
        if unknown:
            raise ValueError(
                f"unknown scorer(s) in scheduling.weights: {', '.join(unknown)}; "
                f"known: {', '.join(self.names)}"
            )

    def build(self, config: SchedulingConfig) -> list[tuple[Scorer, float]]:
        """(scorer, weight) pairs for every weight in the config; weight-0 scorers skipped."""
        self.check(config)
        pairs = []
        for name, weight in config.weights.items():
            if weight > 0:
                scorer = self._factories[name](config)
                scorer.name = name
                pairs.append((scorer, weight))
        return pairs
