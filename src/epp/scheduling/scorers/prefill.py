"""prefill = best expected TTFT among the candidates / this pod's expected TTFT (optional).

Not in the default weights. The EPP keeps, per pod, when the prefills it dispatched there
should be over (`Endpoint.prefill_lane_end`, moved by the Router at each dispatch),
assuming the pod prefills first come, first served as vLLM's token budget does. Then:

    cached(pod) = min(prompt tokens - 1, matched blocks(pod) x block size)
    own(pod)    = overhead + (prompt tokens - cached) x per-token cost
                  + cached x per-cached-token cost
    wait(pod)   = max(prefill_lane_end(pod) - now, slot wait(pod), 0)
    ttft(pod)   = wait(pod) + own(pod)
    prefill     = min(ttft over the candidates) / ttft(pod)       (1 for the best pod)

The slot wait covers what the lanes cannot see: a pod whose running slots are all taken
starts a new request only when one finishes, after (requests on the pod - slots + 1) x
its mean request time / slots (the EPP's own dispatch-to-completion times, `service_s`).
It needs `scheduling.running_slots` (vLLM's max_num_seqs), see `slot_wait`.

Inputs: the prompt's token count, the prefix index's match per pod and the block size
(all on the SchedulingRequest), `now` (the data layer's clock, on the request too), each
pod's lane end, and the costs of `scheduling.prefill_estimate`. The last prompt token is
never counted as cached: the engine computes it to produce the first token.

It turns a cache match into seconds saved and sees how much prefill a pod has queued
(the queue score counts requests whatever their length, 50 ms late). With equal cold
prompts it routes like round robin in the order pods free up. Enable it by giving it a
weight taken from the others, e.g. every default weight halved and `prefill: 0.5`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.config import PrefillEstimateConfig
from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """The configured per-pod prefill cost model (plain floats: read per candidate)."""

    overhead_s: float
    per_token_s: float
    per_cached_token_s: float

    @classmethod
    def from_config(cls, config: PrefillEstimateConfig) -> PrefillCost:
        return cls(config.overhead_s, config.per_token_s, config.per_cached_token_s)

    def seconds(self, prompt_tokens: int, matched_blocks: int, block_size: int) -> float:
        """Own prefill time of a prompt whose first `matched_blocks` blocks are cached."""
        cached = min(max(prompt_tokens - 1, 0), matched_blocks * block_size)
        return (
            self.overhead_s
            + (prompt_tokens - cached) * self.per_token_s
            + cached * self.per_cached_token_s
        )


def slot_wait(endpoint: Endpoint, now: float, pool_service_s: float | None = None) -> float:
    """Expected wait for a running slot: with every slot taken, a new request starts when
    the requests ahead of it have freed one each, one per `service_s / slots` on average.
    0 while a slot is free.

    The mean request time is the pod's own (`service_s`), else its pool's (the other
    candidates'), else the age of its oldest request in flight: a pod none of whose
    requests has finished yet is not free, it is slow (seen on real vLLM: a slow engine
    drew cached conversations away from a fast one for a second).

    Only with configured slots (`scheduling.running_slots`): slots learned from a page
    (the running count while requests wait) cannot tell a full pod from one whose step
    budget is taken by long prefills, which the lanes already price; measured in the
    virtual benchmark, using learned slots here doubled TTFT p90 on no-reuse prompts."""
    slots = endpoint.configured_slots
    if not slots:
        return 0.0
    ahead = endpoint.concurrency - slots + 1
    if ahead <= 0:
        return 0.0
    service = endpoint.service_s if endpoint.service_s is not None else pool_service_s
    if service is None and endpoint.open:
        service = max(0.0, now - next(iter(endpoint.open.values())).at)
    return ahead * service / slots if service else 0.0


@dataclass(slots=True)
class PrefillScorer:
    cost: PrefillCost
    name: str = "prefill"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        if not candidates:
            return []
        seconds = self.cost.seconds
        matched = request.prefix_match.get
        prompt_tokens = request.prompt_tokens
        block_size = request.block_size
        now = request.now
        known = [e.service_s for e in candidates if e.service_s is not None]
        pool = sum(known) / len(known) if known else None
        ttft = [
            max(max(0.0, e.prefill_lane_end - now), slot_wait(e, now, pool))
            + seconds(prompt_tokens, matched(e.name, 0), block_size)
            for e in candidates
        ]
        best = min(ttft)
        # t is 0 only with zero costs and an idle lane: then every such pod is the best.
        return [best / t if t > 0.0 else 1.0 for t in ttft]
