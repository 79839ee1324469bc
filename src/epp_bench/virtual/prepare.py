"""Workload -> prepared requests, and KV sizing from a workload's distinct prefixes.

Preparing is the costly part of a virtual run that does not depend on the router or the
rate (JSON bodies, tokenizing, hashing), so a ladder prepares once and replays many times.

The two sides of the wire see each request through their own code, as in a live run: the
EPP gets the JSON body and parses it with the router's own code at routing time
(`epp_bench.virtual.epp`), while the engine side (prompt length, block hashes) is what a
simulated pod computes for the same body, `vllm_sim.openai_request.engine_prompt`: the
simulator's tokenizer and chat template, and vLLM's block hashing. The router's hit
rates are thus measured against a cache it cannot reproduce by construction.
"""

from __future__ import annotations

import json
import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from epp.request import CHAT_PATH, COMPLETIONS_PATH
from epp_bench.virtual.types import PreparedRequest
from epp_bench.workloads.types import BenchRequest, Workload
from vllm_sim.engine import EngineConfig
from vllm_sim.openai_request import ApiError, Endpoint, ServedModels, engine_prompt
from vllm_sim.tokenizer import SimTokenizer, Tokenizer


def served_models(workload: Workload) -> ServedModels:
    """The models a simulated pod of this workload answers to: the workload's base model
    and its LoRA adapters (`params["adapters"]`), as `run_virtual` names them."""
    adapters = tuple(workload.params.get("adapters", {}))
    base = str(
        workload.params.get("base_model")
        or workload.params.get("model")
        or next((r.model for r in workload.requests if r.model not in adapters), "")
    )
    return ServedModels(base, adapters)


def _prepare_one(
    request: BenchRequest, served: ServedModels, block_size: int, tokenizer: Tokenizer
) -> PreparedRequest:
    body = request.body(stream=True)
    if request.kind == "chat":
        endpoint, path = Endpoint.CHAT, CHAT_PATH
    else:
        endpoint, path = Endpoint.COMPLETIONS, COMPLETIONS_PATH
    try:
        prompt = engine_prompt(endpoint, body, served, tokenizer, block_size)
    except ApiError as exc:
        raise ValueError(
            f"request {request.index}: a simulated pod would refuse it ({exc.status}): {exc}"
        ) from None
    gen = prompt.request
    return PreparedRequest(
        index=request.index,
        path=path,
        body=json.dumps(body, separators=(",", ":")).encode(),
        model=request.model,
        adapter=gen.adapter,
        prompt_tokens=len(gen.tokens),
        max_tokens=request.max_tokens,
        hashes=tuple(prompt.block_hashes),
        token_ids=array("I", gen.tokens),
    )


def prepare(workload: Workload, block_size: int = 16) -> tuple[PreparedRequest, ...]:
    """Every request of `workload`, indexed as in the workload.

    Raises ValueError for a request a simulated pod would refuse (an unknown model, an
    empty prompt).
    """
    served = served_models(workload)
    tokenizer = SimTokenizer()
    prepared = tuple(_prepare_one(r, served, block_size, tokenizer) for r in workload.requests)
    for position, request in enumerate(prepared):
        if request.index != position:
            raise ValueError("workload requests must be indexed 0..n-1 in order")
    return prepared


def distinct_prefix_blocks(prepared: Sequence[PreparedRequest]) -> int:
    """Distinct blocks that more than one request's prompt contains: the reusable prefixes.

    A block seen once can never be a cache hit, so it is no prefix worth holding. When
    nothing repeats (no-reuse), every distinct block counts, so sizing still works.
    """
    seen: Counter[int] = Counter()
    for request in prepared:
        seen.update(set(request.hashes))
    shared = sum(1 for count in seen.values() if count > 1)
    return shared or len(seen)


def size_kv_for_fraction(
    engine: EngineConfig, prepared: Sequence[PreparedRequest], pods: int, fraction: float
) -> EngineConfig:
    """`engine` with num_gpu_blocks set so that the pods together hold `fraction` of the
    workload's distinct prefix blocks (never less than the largest request needs)."""
    if fraction <= 0:
        raise ValueError(f"kv fraction must be > 0, got {fraction}")
    per_pod = math.ceil(fraction * distinct_prefix_blocks(prepared) / pods)
    largest = max(
        (-(-(r.prompt_tokens + r.max_tokens) // engine.block_size) for r in prepared), default=1
    )
    return replace(engine, num_gpu_blocks=max(per_pod, largest))
