"""load = 1 - KV-cache usage (weight 0.20).

The spec's signal is GPU utilisation; vLLM does not export it, and its KV-cache usage
(`vllm:kv_cache_usage_perc`: blocks held by running requests / all blocks) is the usual
stand-in: it rises with batch size and context length, which is what slows a pod."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class LoadScorer:
    name: str = "load"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return [1.0 - e.kv_usage for e in candidates]  # kv_usage is kept within [0, 1]
