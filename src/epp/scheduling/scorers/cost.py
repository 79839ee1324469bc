"""cost = 1 - pod cost / most expensive candidate's cost: an example of a custom scorer.

Not in the default weights. Label pods with `cost_per_hour` (e.g. 3.67 for an on-demand
A100, 0.38 for a spot A10G) and give the scorer a weight taken from the others, e.g.
`weights: {cache: 0.55, load: 0.20, queue: 0.10, health: 0.05, adapter: 0.05, cost: 0.05}`.
Pods without the label are treated as the most expensive (no bonus)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


def _cost(endpoint: Endpoint, label: str) -> float | None:
    try:
        value = float(endpoint.labels[label])
    except (KeyError, ValueError):
        return None
    return value if value >= 0 else None


@dataclass(slots=True)
class CostScorer:
    label: str = "cost_per_hour"
    name: str = "cost"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        costs = [_cost(e, self.label) for e in candidates]
        known = [c for c in costs if c is not None]
        highest = max(known, default=0.0)
        if highest <= 0:
            return [0.0] * len(candidates)
        return [0.0 if c is None else 1.0 - c / highest for c in costs]
