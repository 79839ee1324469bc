"""queue = 1 - min(queueDepth / maxQueue, 1) (weight 0.10; each waiting request costs
1/maxQueue, 0.05 at the default 20).

queueDepth is the pod's last scraped `vllm:num_requests_waiting` plus the requests this
EPP sent it beyond its free running slots (datalayer/endpoint.py): a burst inside one
50 ms scrape interval sees itself, and a pod with free slots is not charged for work it
starts at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.kernels import SCHEDULING as COMPILED
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class QueueScorer:
    max_queue: int = 20
    name: str = "queue"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        max_queue = float(self.max_queue)
        if COMPILED is not None and type(candidates) is list:
            return COMPILED.queue_scores(candidates, max_queue)
        # The twin of the compiled `queue_scores` (epp.kernels): min(q, 1.0) inlined.
        return [1.0 - (1.0 if (q := e.queue_depth / max_queue) > 1.0 else q) for e in candidates]
