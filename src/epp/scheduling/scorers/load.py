"""load = 1 - the pod's utilisation (weight 0.20), utilisation being the larger of

- KV-cache usage (`vllm:kv_cache_usage_perc`: blocks held by running requests / all
  blocks), the usual stand-in for GPU utilisation, which vLLM does not export: it rises
  with batch size and context length, which is what slows a pod;
- the busy fraction: requests on the pod (scraped, plus what the EPP sent since) / its
  running slots, which moves at once with every dispatch (datalayer/endpoint.py).

An idle pod scores 1 and a pod at 80% utilisation 0.2, whichever signal says so."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, sub

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class LoadScorer:
    name: str = "load"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        # [1.0 - e.load for e in candidates] in C-level passes; load is kept within [0, 1].
        return list(map(sub, repeat(1.0), map(attrgetter("load"), candidates)))
