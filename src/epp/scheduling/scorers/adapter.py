"""adapter = 1 if the requested LoRA adapter is resident on the pod, 0.5 if the pod has a
free adapter slot (it loads the adapter without evicting another: a short one-off cost),
else 0 (weight 0.05). A request for a base model needs no adapter: every pod scores 1, so
the factor cannot tip a decision it has no stake in.

Resident means reported by the pod in `vllm:lora_requests_info` (running or waiting)
within `datalayer.adapter_memory_s`: vLLM lists only adapters that have requests, so a
recently used adapter is assumed still loaded. Free slot: fewer adapters than the pod's
`max_lora`; a pod that does not report `max_lora` gets no partial credit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest

FREE_SLOT_CREDIT = 0.5


@dataclass(slots=True)
class AdapterScorer:
    name: str = "adapter"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        adapter = request.adapter
        if adapter is None:
            return [1.0] * len(candidates)
        return [_score(e, adapter) for e in candidates]


def _score(endpoint: Endpoint, adapter: str) -> float:
    if adapter in endpoint.adapters:
        return 1.0
    slots = endpoint.max_loras
    if slots is not None and len(endpoint.adapters) < slots:
        return FREE_SLOT_CREDIT
    return 0.0
