"""vLLM's KV-cache events and their msgpack wire format (no I/O here).

The event types are the ones vLLM's block pool emits (`vllm/distributed/kv_events.py`),
declared as msgspec structs so that the engine can queue them as they are and the
publisher can encode a whole batch in one call:

- `BlockStored`: full blocks newly written to the cache, with their tokens;
- `BlockRemoved`: blocks evicted;
- `AllBlocksCleared`: the prefix cache was reset.

A batch on the wire (frame 3 of a ZMQ message) is `[ts, events, data_parallel_rank]`.
Since vLLM 0.26 each event is a map with a `"type"` key; before that it was a positional
array whose first element is the type name. `encode_event_batch` writes the map layout;
`decode_event_batch` reads both, ignoring fields it does not know, as a consumer should.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
# `BlockStored.kv_cache_spec_kind` of a plain decoder's attention layers (vLLM 0.32 sends it).
SPEC_FULL_ATTENTION = "full_attention"
SEQ_BYTES = 8
# The replay stream ends with sequence number -1 as 8 signed big-endian bytes.
REPLAY_END_SEQ = b"\xff" * SEQ_BYTES


class BlockStored(msgspec.Struct, tag=True, tag_field="type", gc=False):
    """Full blocks just computed and cached, in prompt order.

    `block_hashes` are the engine's own (`vllm_sim.hashing`); `parent_block_hash` is the
    hash of the block before the first one (None when the first one starts the prompt);
    `token_ids` holds every token of the blocks (the simulator's tokenizer's ids);
    `extra_keys` has one entry per block (the LoRA name, then `cache_salt` on block 0),
    None when empty: with them a subscriber can recompute every hash.
    `kv_cache_spec_kind` is the attention type of the KV cache group, last on the wire as
    vLLM 0.32 puts it (older vLLMs do not send it: it decodes as None then).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = SPEC_FULL_ATTENTION


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", gc=False):
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published batch: wall-clock time, events in order, data-parallel rank."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def encode_event_batch(
    events: Sequence[KvEvent], ts: float, data_parallel_rank: int | None = 0
) -> bytes:
    """The msgpack payload of one batch, with map-style events (vLLM >= 0.26)."""
    return _ENCODER.encode(KvEventBatch(ts, list(events), data_parallel_rank))


def encode_seq(seq: int) -> bytes:
    """A sequence number as frame 2 carries it: 8 bytes, big-endian."""
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence number is {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_event_batch(payload: bytes) -> KvEventBatch:
    """A batch in either layout (map events or positional arrays) -> typed events.

    Raises ValueError on a payload that is not a batch.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError("a batch is [ts, events, data_parallel_rank]")
    rank = raw[2] if len(raw) > 2 else None
    return KvEventBatch(float(raw[0]), [_event(item) for item in raw[1]], rank)


def _event(item: object) -> KvEvent:
    if isinstance(item, dict):
        kind = item.get("type")
        fields = {key: value for key, value in item.items() if key != "type"}
    elif isinstance(item, list) and item:
        kind = item[0]
        fields = dict(zip(_POSITIONAL_FIELDS.get(kind, ()), item[1:], strict=False))
    else:
        raise ValueError(f"not an event: {item!r}")
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=_hashes(fields["block_hashes"]),
            parent_block_hash=_hash_or_none(fields.get("parent_block_hash")),
            token_ids=list(fields["token_ids"]),
            block_size=int(fields["block_size"]),
            lora_id=fields.get("lora_id"),
            medium=fields.get("medium"),
            lora_name=fields.get("lora_name"),
            extra_keys=_extra_keys(fields.get("extra_keys")),
            group_idx=fields.get("group_idx") or 0,
            kv_cache_spec_kind=fields.get("kv_cache_spec_kind"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields["block_hashes"]),
            medium=fields.get("medium"),
            group_idx=fields.get("group_idx") or 0,
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


# Field order of the positional layout (vLLM <= 0.25); trailing fields it added later are
# ignored, as are any beyond these.
_POSITIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def positional_event(event: Mapping[str, Any]) -> list[Any]:
    """A map-style event (`{"type": ..., fields}`) in the positional layout older vLLM
    publishes (<= 0.25): the type, then its fields in order (absent ones as None)."""
    kind = event["type"]
    return [kind, *(event.get(name) for name in _POSITIONAL_FIELDS[kind])]


def _hash(value: object) -> int:
    # With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 hashes are bytes: the low 64 bits are the
    # last 8 bytes, big-endian.
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    if isinstance(value, int):
        return value
    raise ValueError(f"not a block hash: {value!r}")


def _hash_or_none(value: object) -> int | None:
    return None if value is None else _hash(value)


def _hashes(values: object) -> list[int]:
    if not isinstance(values, list):
        raise ValueError("block_hashes must be a list")
    return [_hash(value) for value in values]


def _extra_keys(values: object) -> list[tuple[Any, ...] | None] | None:
    if values is None:
        return None
    if not isinstance(values, list):
        raise ValueError("extra_keys must be a list")
    return [None if keys is None else tuple(keys) for keys in values]
