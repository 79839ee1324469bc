"""prefill = best expected TTFT among the candidates / this pod's expected TTFT.

Weight 0.5 in the default weights (config.DEFAULT_WEIGHTS); `weights: SPEC_WEIGHTS` turns
it off. The scorer keeps, per pod, when the prefills the EPP dispatched there should be
over (`PrefillState.lane_end`), assuming the pod prefills first come, first served as
vLLM's token budget does. Then:

    cached(pod) = min(prompt tokens - 1, matched blocks(pod) x block size)
    own(pod)    = overhead + (prompt tokens - cached) x per-token cost
                  + cached x per-cached-token cost
    wait(pod)   = max(lane_end(pod) - now, slot wait(pod), 0)
    ttft(pod)   = wait(pod) + own(pod)
    prefill     = min(ttft over the candidates) / ttft(pod)       (1 for the best pod)

The slot wait covers what the lanes cannot see: a pod whose running slots are all taken
starts a new request only when one finishes, after (requests on the pod - slots + 1) x
its mean request time / slots (the EPP's own dispatch-to-completion times,
`PrefillState.service_s`). It needs `scheduling.running_slots` (vLLM's max_num_seqs), see
`slot_wait`.

Inputs: the prompt's token count, the prefix index's match per pod and the block size
(all on the SchedulingRequest), `now` (the data layer's clock, on the request too), the
pods' load figures (Endpoint), the costs of `scheduling.prefill_estimate`, and the state
below. The last prompt token is never counted as cached: the engine computes it to
produce the first token.

State (the PodStateScorer contract, scheduling/types.py), all of it in this module:
- Dispatched: the chosen pod's lane grows by the request's own prefill, priced with the
  match the scorers saw; it starts at `now` if the lane has drained, else at its end. A
  peer replica's dispatch extends it to its `lane_limit` at most, so what peers claim
  drains within replicas.load_ttl_s of the last claim (epp/replicas/inbox.py).
- Completed with a response below 500 and a known duration: the pod's mean request time
  moves towards that duration (weight SERVICE_ALPHA).
- Removed: the pod's state is dropped.

It turns a cache match into seconds saved and sees how much prefill a pod has queued
(the queue score counts requests whatever their length, 50 ms late). With equal cold
prompts it routes like round robin in the order pods free up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epp.config import PrefillEstimateConfig
from epp.datalayer.endpoint import Endpoint
from epp.kernels import SCHEDULING as COMPILED
from epp.scheduling.types import Completed, Dispatched, PodEvent, Removed, SchedulingRequest

# Weight of each completed request in a pod's mean request time.
SERVICE_ALPHA = 0.1


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


@dataclass(slots=True)
class PrefillState:
    """What the scorer keeps per pod (times on the data layer's clock, seconds)."""

    # When the prefills the EPP sent the pod should be over; 0.0: nothing sent yet.
    lane_end: float = 0.0
    # Moving mean of dispatch-to-completion time of the requests the EPP saw end with a
    # response below 500; None until one did. Prices waiting for a running slot.
    service_s: float | None = None


_FRESH = PrefillState()  # read-only: the state of a pod nothing was sent to yet


def slot_wait(
    endpoint: Endpoint,
    now: float,
    service_s: float | None = None,
    pool_service_s: float | None = None,
) -> float:
    """Expected wait for a running slot: with every slot taken, a new request starts when
    the requests ahead of it have freed one each, one per `service_s / slots` on average.
    0 while a slot is free.

    The mean request time is the pod's own (`service_s`), else its pool's (the other
    candidates'), else the age of its oldest request in flight: a pod none of whose
    requests has finished yet is not free, it is slow (taken for free, a slow engine
    would draw cached conversations away from a fast one).

    Only with configured slots (`scheduling.running_slots`): slots learned from a page
    (the running count while requests wait) cannot tell a full pod from one whose step
    budget is taken by long prefills, which the lanes already price (in the virtual
    benchmark, learned slots here double TTFT p90 on prompts with nothing to reuse)."""
    slots = endpoint.configured_slots
    if not slots:
        return 0.0
    ahead = endpoint.concurrency - slots + 1
    if ahead <= 0:
        return 0.0
    service = service_s if service_s is not None else pool_service_s
    if service is None and endpoint.open:
        service = max(0.0, now - next(iter(endpoint.open.values())).at)
    return ahead * service / slots if service else 0.0


def _pool_service_s(
    candidates: Sequence[Endpoint], pods: Callable[[Endpoint, PrefillState], PrefillState]
) -> float | None:
    """The mean of the candidates' own mean request times (None when none has one)."""
    known = [s.service_s for s in (pods(e, _FRESH) for e in candidates) if s.service_s is not None]
    return sum(known) / len(known) if known else None


@dataclass(slots=True)
class PrefillScorer:
    cost: PrefillCost
    name: str = "prefill"
    _pods: dict[Endpoint, PrefillState] = field(default_factory=dict, repr=False)

    def state(self, endpoint: Endpoint) -> PrefillState:
        """The pod's state, created on first use."""
        state = self._pods.get(endpoint)
        if state is None:
            state = self._pods[endpoint] = PrefillState()
        return state

    def observe(self, event: PodEvent) -> None:
        if isinstance(event, Dispatched):
            request = event.request
            own = self.cost.seconds(
                request.prompt_tokens,
                request.prefix_match.get(event.endpoint.name, 0),
                request.block_size,
            )
            state = self.state(event.endpoint)
            now = request.now
            # First come, first served: it starts when the earlier prefills are over.
            end = (now if now > state.lane_end else state.lane_end) + own
            limit = event.lane_limit
            if limit is not None and end > limit:
                end = max(state.lane_end, limit)  # a peer's share of the lane fades
            state.lane_end = end
        elif isinstance(event, Completed):
            took = event.seconds
            if took is None or event.status is None or event.status >= 500:
                return
            state = self.state(event.endpoint)
            previous = state.service_s
            state.service_s = (
                took if previous is None else previous + SERVICE_ALPHA * (took - previous)
            )
        elif isinstance(event, Removed):
            self._pods.pop(event.endpoint, None)

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        if not candidates:
            return []
        if COMPILED is not None and type(candidates) is list:
            cost = self.cost
            scores = COMPILED.prefill(
                candidates, self._pods, request.prefix_match, request.now, _FRESH.lane_end,
                cost.overhead_s, cost.per_token_s, cost.per_cached_token_s,
                request.prompt_tokens, request.block_size,
            )  # fmt: skip
            if scores is not None:  # None: a pod with configured slots (slot_wait)
                return scores
        return self.python_score(request, candidates)

    def python_score(
        self, request: SchedulingRequest, candidates: Sequence[Endpoint]
    ) -> list[float]:
        """`score` in pure Python (the twin of the compiled `prefill`, epp.kernels; the
        only path for pods with configured running slots)."""
        matched = request.prefix_match.get
        prompt_tokens = request.prompt_tokens
        block_size = request.block_size
        now = request.now
        pods = self._pods.get
        # One pass, PrefillCost.seconds and the max() calls inlined (the hottest loop of a
        # decision, once per candidate): the same float operations in the same order.
        cost = self.cost
        overhead, per_token, per_cached = cost.overhead_s, cost.per_token_s, cost.per_cached_token_s
        most_cached = prompt_tokens - 1 if prompt_tokens > 1 else 0
        # The pool's mean request time (slot_wait's fallback) is needed only for a pod with
        # configured slots: computed then, once, over every candidate in order.
        pool: float | None = None
        pool_known = False
        # A pod holding none of the prompt: cached = 0, the same operations as below.
        cold = overhead + prompt_tokens * per_token + 0 * per_cached
        ttft: list[float] = []
        append = ttft.append
        for e in candidates:
            s = pods(e, _FRESH)
            lane = s.lane_end - now
            wait = lane if lane > 0.0 else 0.0
            if e.configured_slots:
                if not pool_known:
                    pool = _pool_service_s(candidates, pods)
                    pool_known = True
                slot = slot_wait(e, now, s.service_s, pool)
                if slot > wait:
                    wait = slot
            blocks = matched(e.name)
            if blocks:
                cached = blocks * block_size
                if cached > most_cached:
                    cached = most_cached
                append(
                    wait + (overhead + (prompt_tokens - cached) * per_token + cached * per_cached)
                )
            else:
                append(wait + cold)
        best = min(ttft)
        # t is 0 only with zero costs and an idle lane: then every such pod is the best.
        return [best / t if t > 0.0 else 1.0 for t in ttft]
