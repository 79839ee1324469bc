"""The KV events the router keeps, and the one declaration of their fields.

vLLM's block pool emits them (`vllm/distributed/kv_events.py`; vLLM 0.32's file is in
tests/fixtures/upstream/vllm-0.32.0). Each field is declared once below, in vLLM's order
(the positional layout depends on it), with its kind (fields.py): every layout's typed
decoder is built from these declarations (layouts.py) and the by-hand reader checks each
field by its kind. vLLM fields not declared here are ignored.

- `BlockStored`: full blocks newly cached, in prompt order: `parent_block_hash` is None at
  prompt start, `token_ids` holds every token of those blocks, `extra_keys` one entry per
  block (the LoRA name, then `cache_salt` on block 0), `group_idx` the KV cache group.
- `BlockRemoved`: blocks evicted.
- `AllBlocksCleared`: the prefix cache was reset.

Hashes are unsigned 64-bit ints here, whatever the publisher sent.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from epp.prefix.kv_events.fields import (
    HASH_OR_NONE,
    HASHES,
    INT,
    INT_OR_NONE,
    INTS,
    LIST_OR_NONE,
    NAME_OR_NONE,
    STR_OR_NONE,
)

MEDIUM_GPU = "GPU"
SPEC_FULL_ATTENTION = "full_attention"


class BlockStored(msgspec.Struct, tag=True, tag_field="type", gc=False):
    block_hashes: Annotated[list[int], HASHES]
    parent_block_hash: Annotated[int | None, HASH_OR_NONE]
    token_ids: Annotated[list[int], INTS]
    block_size: Annotated[int, INT]
    lora_id: Annotated[int | None, INT_OR_NONE] = None
    medium: Annotated[str | None, STR_OR_NONE] = None
    lora_name: Annotated[str | None, NAME_OR_NONE] = None
    extra_keys: Annotated[list[Any] | None, LIST_OR_NONE] = None
    group_idx: Annotated[int | None, INT_OR_NONE] = None
    kv_cache_spec_kind: Annotated[str | None, STR_OR_NONE] = None  # vLLM >= 0.32


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", gc=False):
    block_hashes: Annotated[list[int], HASHES]
    medium: Annotated[str | None, STR_OR_NONE] = None
    group_idx: Annotated[int | None, INT_OR_NONE] = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: tuple[type[KvEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """Frame 3 of a publisher's ZMQ message: `[ts, events, data_parallel_rank]`."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None
