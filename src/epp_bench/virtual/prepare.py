"""Workload -> prepared requests, and KV sizing from a workload's distinct prefixes.

Preparing is the costly part of a virtual run that does not depend on the router or the
rate (JSON bodies, tokenizing, hashing), so a ladder prepares once and replays many times.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from epp.prefix.hashing import block_hashes, chain_seed
from epp.request import CHAT_PATH, COMPLETIONS_PATH
from epp.tokenize import ByteEstimateTokenizer
from epp_bench.virtual.types import PreparedRequest
from epp_bench.workloads.types import BenchRequest, Workload
from vllm_sim.engine import EngineConfig


def _prepare_one(
    request: BenchRequest,
    adapters: frozenset[str],
    block_size: int,
    tokenizer: ByteEstimateTokenizer,
) -> PreparedRequest:
    if request.kind == "chat":
        assert request.messages is not None
        tokens = tokenizer.encode_chat(request.messages)
        path = CHAT_PATH
    else:
        assert request.prompt is not None
        tokens = tokenizer.encode(request.prompt)
        path = COMPLETIONS_PATH
    # As the simulated pod hashes: seeded by the model name as requested (an adapter's
    # name selects the adapter) and cache_salt.
    seed = chain_seed(request.model, None, request.cache_salt)
    return PreparedRequest(
        index=request.index,
        path=path,
        body=json.dumps(request.body(stream=True), separators=(",", ":")).encode(),
        model=request.model,
        adapter=request.model if request.model in adapters else None,
        prompt_tokens=len(tokens),
        max_tokens=request.max_tokens,
        hashes=tuple(block_hashes(tokens, block_size, seed)),
    )


def prepare(workload: Workload, block_size: int = 16) -> tuple[PreparedRequest, ...]:
    """Every request of `workload`, indexed as in the workload."""
    adapters = frozenset(workload.params.get("adapters", {}))
    tokenizer = ByteEstimateTokenizer()
    prepared = tuple(_prepare_one(r, adapters, block_size, tokenizer) for r in workload.requests)
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
