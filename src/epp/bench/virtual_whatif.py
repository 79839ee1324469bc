"""What-if routers for the virtual benchmark: hypotheses about the EPP's scoring, tested
without touching it (the EPP's scorer registry takes extra scorers by design).

`epp_prefill`: the EPP plus one scorer, `prefill`, the expected time to first token on
each pod as the EPP itself can estimate it. The EPP keeps, per pod, when the prefills it
dispatched there will be over, assuming the pod prefills first come, first served:

    own(pod)   = overhead + unmatched prompt tokens x per-token cost
                 + matched prompt tokens x per-cached-token cost
    ttft(pod)  = max(0, lane_end(pod) - now) + own(pod)
    prefill    = min(ttft over the candidates) / ttft(pod)          (1 for the best pod)

and on dispatch moves `lane_end(pod)` to max(now, lane_end(pod)) + own(pod). The match is
the prefix index's (what the EPP already computes); the costs are the pod's per-token
prefill figures, which an EPP would be configured with or learn from observed TTFTs (here
they are taken from the engine configuration). With equal prompts and no reuse this is
round robin in the order pods free up; with reuse it trades a cache hit against the
prefills queued on the pod that holds it. The configured weights are scaled by
1 - PREFILL_WEIGHT and `prefill` gets PREFILL_WEIGHT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.bench.virtual_epp import EppVirtualRouter
from epp.bench.virtual_types import PreparedRequest, RouteChoice, VirtualPods
from epp.config import EppConfig
from epp.datalayer.endpoint import Endpoint
from epp.routing import RoutedRequest
from epp.scheduling.registry import ScorerRegistry
from epp.scheduling.types import SchedulingRequest
from epp.sim.engine import EngineConfig

WHATIF_ROUTERS = ("epp_prefill",)
PREFILL_WEIGHT = 0.5


@dataclass(slots=True)
class PrefillLanes:
    """The EPP's estimate of each pod's prefill queue: when its dispatched prefills end."""

    costs: EngineConfig
    block_size: int = 16
    now: float = 0.0
    lane_end: dict[str, float] = field(default_factory=dict)  # pod name -> seconds
    # own(pod) for the request being routed, kept for the dispatch that follows.
    last: dict[str, float] = field(default_factory=dict)

    def own_seconds(self, prompt_tokens: int, matched_blocks: int) -> float:
        cached = min(max(prompt_tokens - 1, 0), matched_blocks * self.block_size)
        return self.costs.prefill_seconds(prompt_tokens, cached)

    def dispatched(self, pod: str) -> None:
        start = max(self.now, self.lane_end.get(pod, 0.0))
        self.lane_end[pod] = start + self.last.get(pod, 0.0)


@dataclass(slots=True)
class ExpectedTtftScorer:
    lanes: PrefillLanes
    name: str = "prefill"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        lanes = self.lanes
        matched = request.prefix_match.get
        own = {
            e.name: lanes.own_seconds(request.prompt_tokens, matched(e.name, 0)) for e in candidates
        }
        lanes.last = own
        now = lanes.now
        ttft = [max(0.0, lanes.lane_end.get(e.name, 0.0) - now) + own[e.name] for e in candidates]
        best = min(ttft)
        return [best / t if t > 0 else 1.0 for t in ttft]


class PrefillAwareEppRouter(EppVirtualRouter):
    """The EPP with the `prefill` scorer added (module docstring)."""

    name = "epp_prefill"

    def __init__(
        self,
        pods: VirtualPods,
        config: EppConfig | None = None,
        *,
        seed: int = 0,
        adapters: dict[str, str] | None = None,
        weight: float | None = None,
    ) -> None:
        weight = PREFILL_WEIGHT if weight is None else weight
        base = config or EppConfig()
        weights = {k: v * (1 - weight) for k, v in base.scheduling.weights.items()}
        weights["prefill"] = weight
        scheduling = base.scheduling.model_copy(update={"weights": weights})
        self.lanes = PrefillLanes(pods.engines[0].config, block_size=base.prefix.block_size)
        self.weight = weight
        registry = ScorerRegistry()
        registry.register("prefill", lambda _config: ExpectedTtftScorer(self.lanes))
        super().__init__(
            pods,
            base.model_copy(update={"scheduling": scheduling}),
            seed=seed,
            adapters=adapters,
            registry=registry,
        )

    def route(self, request: PreparedRequest, now: float) -> RouteChoice:
        self.lanes.now = now
        choice = super().route(request, now)
        if isinstance(choice.ticket, RoutedRequest):
            self.lanes.dispatched(choice.ticket.endpoint.name)
        return choice

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "prefill_weight": self.weight}
