"""What-if routers for the virtual benchmark: EPP configurations not run by default.

`epp_spec`: the EPP with the spec's five weights (cache 0.60, load 0.20, queue 0.10,
health 0.05, adapter 0.05) instead of the default prefill-priced ones.

`epp_prefill`: the EPP with its optional built-in `prefill` scorer turned on (expected
time to first token per pod; formula in `epp.scheduling.scorers.prefill`). The configured
weights are scaled by 1 - PREFILL_WEIGHT and `prefill` gets PREFILL_WEIGHT. The scorer's
cost model (`scheduling.prefill_estimate`) is set from the simulated pods' own prefill
costs, as an operator would set it from the model and GPU the pods run, so the estimate is
exact for a pod that prefills only what the EPP sent it.

`epp_precise` (precise mode: the index fed by the engines' KV events) and
`epp_approx_engine_tok` (approximate, with the engine's tokenizer) live in
`epp_bench.virtual.precise`.
"""

from __future__ import annotations

from typing import Any

from epp.config import SPEC_WEIGHTS, EppConfig
from epp_bench.virtual.epp import EppVirtualRouter
from epp_bench.virtual.types import VirtualPods
from vllm_sim.engine import EngineConfig

WHATIF_ROUTERS = (
    "epp_prefill",
    "epp_spec",
    "epp_precise",
    "epp_precise_fixed2",
    "epp_precise_fixed30",
    "epp_approx_engine_tok",
)
PREFILL_WEIGHT = 0.5


def prefill_config(base: EppConfig, engine: EngineConfig, weight: float) -> EppConfig:
    """`base` with `prefill` at `weight`, the other weights scaled to leave room for it,
    and the prefill estimate taken from the engine's costs."""
    others = {k: v for k, v in base.scheduling.weights.items() if k != "prefill"}
    total = sum(others.values()) or 1.0
    weights = {name: value * (1 - weight) / total for name, value in others.items()}
    weights["prefill"] = weight
    estimate = {
        "overhead_s": engine.prefill_overhead_s,
        "per_token_s": engine.prefill_per_token_s,
        "per_cached_token_s": engine.prefill_per_cached_token_s,
    }
    scheduling = base.scheduling.model_dump()
    scheduling.update(weights=weights, prefill_estimate=estimate)
    # Validated again (model_copy would not): weights summing to 1, costs in range.
    return EppConfig.model_validate({**base.model_dump(), "scheduling": scheduling})


class PrefillAwareEppRouter(EppVirtualRouter):
    """The EPP with `prefill` at PREFILL_WEIGHT (module docstring)."""

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
        self.weight = PREFILL_WEIGHT if weight is None else weight
        config = prefill_config(config or EppConfig(), pods.engines[0].config, self.weight)
        super().__init__(pods, config, seed=seed, adapters=adapters)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "prefill_weight": self.weight}


def spec_config(base: EppConfig | None) -> EppConfig:
    """`base` with the spec's five weights (no `prefill`): the default before it moved to
    prefill-priced weights, kept to show what that choice changes (`epp_spec`)."""
    base = base or EppConfig()
    scheduling = {**base.scheduling.model_dump(), "weights": dict(SPEC_WEIGHTS)}
    return EppConfig.model_validate({**base.model_dump(), "scheduling": scheduling})
