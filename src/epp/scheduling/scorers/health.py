"""health = the pod's continuous health in [0, 1] (weight 0.05); see datalayer/health.py
for how it is derived. Pods below the threshold never reach scoring (HealthFilter)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class HealthScorer:
    name: str = "health"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return list(map(attrgetter("health"), candidates))
