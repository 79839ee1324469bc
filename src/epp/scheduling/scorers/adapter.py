"""adapter = 1 if the requested LoRA adapter is loaded (running or waiting) on the pod,
else 0 (weight 0.05). A request for a base model needs no adapter: every pod scores 1,
so the factor cannot tip a decision it has no stake in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class AdapterScorer:
    name: str = "adapter"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        adapter = request.adapter
        if adapter is None:
            return [1.0] * len(candidates)
        return [1.0 if e.has_adapter(adapter) else 0.0 for e in candidates]
