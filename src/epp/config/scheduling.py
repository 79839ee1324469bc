"""Scheduling sections: the score's weights and estimates, the prefix index, admission."""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from epp.config.base import Strict

# The five-factor score of the EPP's specification (no `prefill`). With these weights
# a cache-hot pod at 80% load scores 0.64 on cache + load against 0.20 for an idle cold
# one, each queued request costs 0.05 (at max_queue 20), and a pod of health 0.29 is
# excluded (tests/scheduling/test_scorers.py).
SPEC_WEIGHTS = {"cache": 0.60, "load": 0.20, "queue": 0.10, "health": 0.05, "adapter": 0.05}
# The default: these five factors at half weight, and half on `prefill`, which prices a
# cache match and the work queued on each pod in seconds of expected time to first token.
# Why (docs/benchmarks/virtual.md, "Default weights"): at round robin's saturation rate
# its TTFT p90 is 21x lower than round robin's, against 10x with SPEC_WEIGHTS,
# and no worse than round robin on prompts with nothing to reuse, where SPEC_WEIGHTS
# trails least-outstanding. Set `weights: SPEC_WEIGHTS` for the five-factor score alone.
DEFAULT_WEIGHTS = {name: weight * 0.5 for name, weight in SPEC_WEIGHTS.items()} | {"prefill": 0.5}


class PrefillEstimateConfig(Strict):
    """Per-pod prefill cost, for the optional `prefill` scorer (expected time to first
    token): a prompt's own prefill is estimated as

        overhead_s + uncached tokens x per_token_s + cached tokens x per_cached_token_s

    The defaults are Llama-3.1-8B on one A100 (the `llama-8b-a100` simulator
    preset): a cold 4,096-token prompt prefills in 0.9 s (10 ms + 4,096 x 217 us), and a
    fully cached one in 45 ms (the last block is recomputed; the rest costs ~7.7 us per
    token to look up). They are only right for that model on that GPU: set them per
    model/GPU, e.g. from the TTFT of single cold and fully cached requests on an idle pod.
    Unused unless `prefill` has a weight in `scheduling.weights`.
    """

    overhead_s: float = Field(0.010, ge=0.0, allow_inf_nan=False)
    per_token_s: float = Field(0.000217, ge=0.0, allow_inf_nan=False)
    per_cached_token_s: float = Field(0.0000077, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _cached_not_dearer(self) -> PrefillEstimateConfig:
        # A cached token dearer than a computed one would make the scorer avoid cache hits.
        if self.per_cached_token_s > self.per_token_s:
            raise ValueError(
                f"per_cached_token_s ({self.per_cached_token_s}) must not exceed "
                f"per_token_s ({self.per_token_s})"
            )
        return self


class BalanceConfig(Strict):
    """The imbalance guard: a pod far busier than the least busy candidate leaves the
    candidate set, whatever its cache match. "Far busier" means both more than `abs_requests`
    more requests in flight and more than `ratio` times as many. Without it a popular
    prefix funnels every new conversation to the pod that holds it (cache 0.60 outweighs
    any load signal), and a fleet splits 3:1 while one pod idles. 0 disables a bound.

    Off by default: the `prefill` factor's slot wait and the tie-break by work given so
    far do that job, and the guard moves conversations off their cache (with it on, the
    demo's TTFT p90 is 280 ms against 72 ms and its hit rate 89.9% against 91.6%;
    virtual multi-turn p90 +30 ms).
    """

    abs_requests: float = Field(4.0, ge=0.0)
    ratio: float = Field(3.0, ge=1.0)
    enabled: bool = False


class SchedulingConfig(Strict):
    # Keys are scorer names in the registry (built-ins or registered custom scorers).
    weights: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    max_queue: int = Field(20, ge=1, description="queue depth at which a pod is saturated")
    health_threshold: float = Field(0.3, ge=0.0, le=1.0, description="pods below are excluded")
    # The floor under exclusion (datalayer/health.py "Floor and panic"). Response errors
    # exclude at most this share of a model's pods (rounded down), counting the pods already
    # out for failed scrapes or stale metrics: one client whose requests the pods answer 500
    # can take half a model's pods, never all (Envoy's max_ejection_percent; 10% there,
    # which with 2-8 pods a model would mean never).
    max_error_exclusion_share: float = Field(0.5, ge=0.0, le=1.0)
    # Panic: a model with no routable pod, or fewer than this share of its pods routable,
    # is routed to all its pods as if none were excluded (Envoy's healthy_panic_threshold,
    # 50% there). 0: only when none is left, since a pod out for failed scrapes while its
    # peers answer is most likely down. `health_panic: false`: 503 instead.
    healthy_panic_share: float = Field(0.0, ge=0.0, le=1.0)
    health_panic: bool = True
    fallbacks: int = Field(0, ge=0, le=16, description="fallback endpoints after the primary")
    # Scores closer than this are equal, and the EPP's own load counts decide between them.
    # Real gauges never tie exactly: a 0.2-weighted KV usage differing by 2% is 0.004,
    # noise that must not outvote "this pod has three more requests in flight".
    tie_epsilon: float = Field(0.005, ge=0.0, le=0.1, description="scores closer are equal")
    # Requests a pod runs at once (vLLM's max_num_seqs). Dispatched requests count as
    # waiting only beyond it. None: learned per pod from its metrics (the running count
    # seen while requests wait); until then only the pod's reported waiting counts.
    running_slots: int | None = Field(None, ge=1)
    balance: BalanceConfig = Field(default_factory=lambda: BalanceConfig())
    # Here rather than top level: scorer factories receive this section (see registry.py).
    prefill_estimate: PrefillEstimateConfig = Field(default_factory=PrefillEstimateConfig)

    @field_validator("weights")
    @classmethod
    def _weights_sum_to_one(cls, weights: dict[str, float]) -> dict[str, float]:
        if not weights:
            raise ValueError("at least one scorer weight is required")
        for name, weight in weights.items():
            if not (0.0 <= weight <= 1.0) or math.isnan(weight):
                raise ValueError(f"weight of {name!r} must be in [0, 1], got {weight}")
        total = math.fsum(weights.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"scorer weights must sum to 1.0, got {total:.6f} "
                f"({', '.join(f'{k}={v}' for k, v in weights.items())})"
            )
        return weights


class PrefixConfig(Strict):
    block_size: int = Field(16, ge=1, le=4096, description="tokens per hashed block")
    capacity_per_pod: int = Field(31_250, ge=1, description="blocks remembered per pod (LRU)")
    # When a pod reports its KV capacity (vllm:cache_config_info num_gpu_blocks), remember
    # no more blocks for it than it can hold: beyond that the memory is certainly stale.
    use_reported_capacity: bool = True
    # Bounded work per request: at most this many blocks of a prompt (its head) are
    # tokenized, hashed and looked up; the rest of the prompt is only counted (estimated).
    # 8,192 blocks of 16 tokens cover a 128k-token prompt.
    max_blocks_per_request: int = Field(8192, ge=1, le=1_000_000)
    # One request records at most this fraction of a pod's capacity (its prompt's head),
    # so a huge prompt cannot push everything else out of the index for that pod. Not
    # lower: on pods with a small KV cache an ordinary conversation takes a third of it,
    # and a cut record loses the conversation's history (at 0.25 the demo's 300-block
    # pods match only the system prompt: hit rate 86% against 91.6% at 0.5).
    max_record_fraction: float = Field(0.5, gt=0.0, le=1.0, allow_inf_nan=False)


class FlowControlConfig(Strict):
    """Admission when every candidate pod is saturated (queue at max_queue).

    Sheddable requests (priority < 0) get 429 at once; the others wait here, ordered by
    priority then arrival, fair across models within a priority, until a pod has room,
    their TTL passes (429 rejected-ttl-expired) or the queue is full (429)."""

    enabled: bool = True
    max_requests: int = Field(1000, ge=0)
    max_bytes: int = Field(256 * 1024 * 1024, ge=0)
    ttl_s: float = Field(60.0, gt=0.0)
    retry_after_s: float = Field(1.0, gt=0.0)
    # Priority per model name (the name clients send); others get default_priority.
    priorities: dict[str, int] = Field(default_factory=dict)
    default_priority: int = 0
    # A request header carrying an integer priority, honoured only when set here: clients
    # can send any header, so the gateway must strip it from untrusted traffic.
    priority_header: str | None = None
    # An InferenceObjective the client names (x-llm-d-inference-objective) may lower its
    # model's own priority (InferenceModel criticality, `priorities`) but not raise it,
    # unless this is true (every client trusted). Models without one take the objective's.
    objective_may_raise: bool = False
