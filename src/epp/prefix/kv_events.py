"""vLLM's KV-cache event batches, decoded strictly and defensively (no I/O here).

A batch is frame 3 of a ZMQ message from a vLLM pod's publisher (docs: vllm.md):
`[ts, events, data_parallel_rank]`. Since vLLM 0.26 each event is a map with a `"type"`
key; before, a positional array whose first element is the type name. Both are read:

- `BlockStored`: full blocks newly cached, in prompt order: `block_hashes`,
  `parent_block_hash` (None at prompt start), `token_ids` (every token of those blocks),
  `block_size`, `lora_name`, `medium`, `extra_keys` (one per block: the LoRA name, then
  `cache_salt` on block 0), `kv_cache_spec_kind` (vLLM 0.32);
- `BlockRemoved`: `block_hashes` evicted, `medium`;
- `AllBlocksCleared`: the prefix cache was reset.

Hashes are unsigned 64-bit ints by default, bytes with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`
(the last 8 bytes, big-endian, are the value). Unknown fields are ignored.

The decoder never raises on input. A payload that is not a batch returns None; an event
that breaks the rules (unknown type, wrong field types, a hash that is no hash, token ids
that do not fill the blocks, more blocks than `max_blocks_per_event`) is dropped and the
rest of the batch kept; a batch over `max_payload_bytes` or `max_events` is refused
whole. Each case is counted in `KvEventStats` (read by a metrics module) and logged at
most a few lines a second per reason.

Fast path: one typed msgspec decode of the map layout with int hashes (what vLLM sends by
default), then a bounds pass. Anything else (the positional layout, bytes hashes, unknown
event types, garbage) takes a tolerant path that checks every event by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

log = structlog.get_logger("epp.kv_events")

MASK64 = (1 << 64) - 1
SEQ_BYTES = 8
REPLAY_END_SEQ = MASK64  # the replay stream ends with seq ff..ff (-1 as signed)
MEDIUM_GPU = "GPU"
SPEC_FULL_ATTENTION = "full_attention"


class BlockStored(msgspec.Struct, tag=True, tag_field="type", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", gc=False):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on one batch. The defaults are far above what one engine step produces (a
    step stores at most its batched tokens, 2k-64k: about 250 KB of payload at most) and
    keep a hostile or broken publisher from making the router allocate without bound.
    Decoding is the one part of ingest that is not sliced: about 10-15 ms of event loop
    per MB of payload (docs/benchmarks/index.md), so the payload cap bounds that pause."""

    max_payload_bytes: int = 1024 * 1024
    max_events: int = 100_000
    max_blocks_per_event: int = 65_536
    max_block_size: int = 4096


# Every reason counted; a metrics module exports them as one counter with a `reason`
# label (a fixed set: never a value taken from the input).
REASONS = (
    "batches",  # batches decoded (some of their events may have been dropped)
    "events",  # events kept
    "malformed_payload",  # not msgpack, or not [ts, events, rank]
    "oversized_payload",  # payload over max_payload_bytes: refused whole
    "oversized_batch",  # more events than max_events: refused whole
    "invalid_event",  # an event breaking the rules: dropped
    "unknown_event_type",  # a type we do not know: dropped
    "bytes_hashes",  # hashes sent as bytes (accepted; counted per event)
    "positional_layout",  # batches in the pre-0.26 positional layout (accepted)
    "malformed_frames",  # a ZMQ message that is not [topic, seq(8 bytes), payload]
    "unknown_pod",  # events for a pod the index does not follow: dropped
    "blocks_stored",  # engine blocks stored
    "blocks_removed",  # engine blocks removed that the index held
    "unknown_removals",  # engine blocks removed that the index did not hold
    "all_blocks_cleared",
    "unknown_parent",  # BlockStored whose parent is unknown: kept, unmatchable
    "relearned_blocks",  # blocks held out of our sight, learnt from a child's parent
    "relearn_ambiguous",  # an unknown parent two open predictions placed differently
    "ignored_medium",  # blocks on CPU / disk tiers: not in the GPU cache the router scores
    "ignored_group",  # blocks of a KV cache group that is not full attention
    "unsupported_block_size",  # engine block size not a multiple of prefix.block_size
    "opaque_extra_keys",  # blocks with extra keys we cannot reproduce (multimodal)
    # the subscriber (epp.datalayer.kv_subscriber)
    "gaps",  # sequence gaps (lost batches)
    "publisher_restarts",  # sequence back, a new start time, or the pod's counters reset
    "restart_drops_skipped",  # a new start time after the entries were rebuilt from it: kept
    "resyncs",  # full resyncs: entries dropped, rebuilt from the replay buffer
    "resync_failures",  # a replay that did not answer or did not cover: entries dropped
    "resync_partial",  # the replay buffer no longer reached back far enough
    "probe_failed",  # the idle probe of the replay socket did not answer
    "disconnects",  # the publisher's connection went away: entries dropped
    "subscriber_error",  # an unexpected error in a subscriber cycle (logged)
)


@dataclass(slots=True)
class KvEventStats:
    """Counters (reason -> count) and a rate-limited warning log, shared by the decoder,
    the precise index and the subscribers. No Prometheus here: a metrics module reads
    `counts` (and `KvEventSubscriber` states) when it renders."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    log_burst: float = 10.0
    log_per_second: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, list[float]] = field(default_factory=dict)  # reason -> [tokens, at]
    suppressed: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def problem(self, reason: str, n: int = 1, **fields: Any) -> None:
        """Count `n` of `reason` and log a warning, unless that reason is over its budget
        (`log_burst` lines, refilled at `log_per_second`)."""
        self.counts[reason] = self.counts.get(reason, 0) + n
        now = self.clock()
        bucket = self._buckets.get(reason)
        if bucket is None:
            bucket = self._buckets[reason] = [self.log_burst, now]
        else:
            bucket[0] = min(self.log_burst, bucket[0] + (now - bucket[1]) * self.log_per_second)
            bucket[1] = now
        if bucket[0] < 1.0:
            self.suppressed[reason] = self.suppressed.get(reason, 0) + 1
            return
        bucket[0] -= 1.0
        dropped = self.suppressed.pop(reason, 0)
        if dropped:
            fields["suppressed"] = dropped
        log.warning("kv_event_problem", reason=reason, count=n, **fields)


# -- decoding ------------------------------------------------------------------------------


class _PosStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _PosRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _PosCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _PosBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_PosStored | _PosRemoved | _PosCleared]
    data_parallel_rank: int | None = None


# The map layout with hashes as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): typed too.
class _BytesStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _BytesRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _BytesBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BytesStored | _BytesRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_MAP_DECODER = msgspec.msgpack.Decoder(EventBatch)
_BYTES_DECODER = msgspec.msgpack.Decoder(_BytesBatch)
_POS_DECODER = msgspec.msgpack.Decoder(_PosBatch)
_ANY_DECODER = msgspec.msgpack.Decoder()

# Field order of the positional layout (vLLM <= 0.25); later trailing fields are ignored.
_POSITIONAL: dict[str, tuple[str, ...]] = {
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


class _Invalid(Exception):
    """One event breaks the rules (message says which)."""


class KvEventDecoder:
    def __init__(self, limits: DecodeLimits | None = None, stats: KvEventStats | None = None):
        self.limits = limits or DecodeLimits()
        self.stats = stats or KvEventStats()

    def decode(self, payload: bytes, pod: str | None = None) -> EventBatch | None:
        """The batch in `payload`, with every event that breaks the rules dropped; None
        when the payload is refused or is not a batch (counted and logged)."""
        limits = self.limits
        stats = self.stats
        if len(payload) > limits.max_payload_bytes:
            stats.problem("oversized_payload", pod=pod, bytes=len(payload))
            return None
        batch: EventBatch | None
        try:
            batch = _MAP_DECODER.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            batch = None
        except Exception:  # hostile input: RecursionError, MemoryError, ...
            batch = None
        if batch is not None:
            if len(batch.events) > limits.max_events:
                stats.problem("oversized_batch", pod=pod, events=len(batch.events))
                return None
            kept = [event for event in batch.events if self._fast_ok(event, pod)]
            if len(kept) != len(batch.events):
                batch.events = kept
        else:
            batch = self._slow(payload, pod)
            if batch is None:
                return None
        stats.counts["batches"] += 1
        stats.counts["events"] += len(batch.events)
        return batch

    # A typed decode guarantees the types; what is left is bounds and hash ranges.
    def _fast_ok(self, event: KvEvent, pod: str | None) -> bool:
        if isinstance(event, AllBlocksCleared):
            return True
        try:
            if isinstance(event, BlockStored):
                self._check_stored(event)
            else:
                event.block_hashes = self._check_hashes(event.block_hashes)
        except _Invalid as exc:
            self.stats.problem("invalid_event", pod=pod, error=str(exc))
            return False
        return True

    def _check_hashes(self, hashes: list[int]) -> list[int]:
        if len(hashes) > self.limits.max_blocks_per_event:
            raise _Invalid(f"{len(hashes)} blocks in one event")
        if not hashes:
            raise _Invalid("no block hashes")
        if min(hashes) < 0:  # a signed int64 publisher: the same 64 bits
            return [value & MASK64 for value in hashes]
        return hashes

    def _check_stored(self, event: BlockStored) -> None:
        event.block_hashes = self._check_hashes(event.block_hashes)
        n = len(event.block_hashes)
        if not 1 <= event.block_size <= self.limits.max_block_size:
            raise _Invalid(f"block_size {event.block_size}")
        if len(event.token_ids) != n * event.block_size:
            raise _Invalid(f"{len(event.token_ids)} token ids for {n} blocks of {event.block_size}")
        if event.parent_block_hash is not None and event.parent_block_hash < 0:
            event.parent_block_hash &= MASK64
        extra = event.extra_keys
        if extra is not None and len(extra) != n:
            raise _Invalid(f"{len(extra)} extra_keys for {n} blocks")

    def _slow(self, payload: bytes, pod: str | None) -> EventBatch | None:
        stats = self.stats
        try:
            with_bytes = _BYTES_DECODER.decode(payload)
        except Exception:
            with_bytes = None
        if with_bytes is not None:
            if len(with_bytes.events) > self.limits.max_events:
                stats.problem("oversized_batch", pod=pod, events=len(with_bytes.events))
                return None
            converted: list[KvEvent] = []
            for raw_event in with_bytes.events:
                try:
                    event = _from_bytes(raw_event)
                except _Invalid as exc:
                    stats.problem("invalid_event", pod=pod, error=str(exc))
                    continue
                if not isinstance(raw_event, AllBlocksCleared) and any(
                    type(h) is bytes for h in raw_event.block_hashes
                ):
                    stats.add("bytes_hashes")
                if self._fast_ok(event, pod):
                    converted.append(event)
            return EventBatch(with_bytes.ts, converted, with_bytes.data_parallel_rank)
        try:
            positional = _POS_DECODER.decode(payload)
        except Exception:
            positional = None
        if positional is not None:
            stats.counts["positional_layout"] += 1
            if len(positional.events) > self.limits.max_events:
                stats.problem("oversized_batch", pod=pod, events=len(positional.events))
                return None
            events: list[KvEvent] = []
            for item in positional.events:
                event = _from_positional(item)
                if self._fast_ok(event, pod):
                    events.append(event)
            return EventBatch(positional.ts, events, positional.data_parallel_rank)
        try:
            raw = _ANY_DECODER.decode(payload)
        except Exception as exc:
            stats.problem("malformed_payload", pod=pod, error=_short(exc))
            return None
        if (
            not isinstance(raw, list)
            or len(raw) < 2
            or not isinstance(raw[0], int | float)
            or isinstance(raw[0], bool)
            or not isinstance(raw[1], list)
        ):
            stats.problem("malformed_payload", pod=pod, error="not [ts, events, rank]")
            return None
        if len(raw[1]) > self.limits.max_events:
            stats.problem("oversized_batch", pod=pod, events=len(raw[1]))
            return None
        rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
        events = []
        for item in raw[1]:
            try:
                tolerated = self._tolerant(item, pod)
            except _Invalid as exc:
                stats.problem("invalid_event", pod=pod, error=str(exc))
                continue
            if tolerated is not None:
                events.append(tolerated)
        return EventBatch(float(raw[0]), events, rank)

    def _tolerant(self, item: object, pod: str | None) -> KvEvent | None:
        if isinstance(item, dict):
            kind = item.get("type")
            fields = item
        elif isinstance(item, list) and item:
            kind = item[0]
            names = _POSITIONAL.get(kind) if isinstance(kind, str) else None
            fields = dict(zip(names or (), item[1:], strict=False))
        else:
            raise _Invalid("an event is neither a map nor a non-empty array")
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        if kind == "BlockRemoved":
            hashes = self._hash_list(fields.get("block_hashes"), pod)
            return BlockRemoved(hashes, _opt_str(fields.get("medium")))
        if kind == "BlockStored":
            hashes = self._hash_list(fields.get("block_hashes"), pod)
            parent = fields.get("parent_block_hash")
            token_ids = fields.get("token_ids")
            block_size = fields.get("block_size")
            if not isinstance(token_ids, list) or not all(
                type(token) is int for token in token_ids
            ):
                raise _Invalid("token_ids must be a list of ints")
            if type(block_size) is not int:
                raise _Invalid("block_size must be an int")
            extra = fields.get("extra_keys")
            if extra is not None and not isinstance(extra, list):
                raise _Invalid("extra_keys must be a list or null")
            lora_name = fields.get("lora_name")
            if lora_name is not None and not isinstance(lora_name, str):
                raise _Invalid("lora_name must be a string or null")
            event = BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if parent is None else _hash_value(parent),
                token_ids=token_ids,
                block_size=block_size,
                medium=_opt_str(fields.get("medium")),
                lora_name=lora_name,
                extra_keys=extra,
                kv_cache_spec_kind=_opt_str(fields.get("kv_cache_spec_kind")),
            )
            self._check_stored(event)
            return event
        self.stats.problem("unknown_event_type", pod=pod, type=_short(kind))
        return None

    def _hash_list(self, values: object, pod: str | None) -> list[int]:
        if not isinstance(values, list):
            raise _Invalid("block_hashes must be a list")
        if len(values) > self.limits.max_blocks_per_event:
            raise _Invalid(f"{len(values)} blocks in one event")
        hashes = [_hash_value(value) for value in values]
        if values and isinstance(values[0], bytes):
            self.stats.add("bytes_hashes")
        return self._check_hashes(hashes)


def _hash_value(value: object) -> int:
    if isinstance(value, bytes):
        if not value:
            raise _Invalid("an empty bytes hash")
        return int.from_bytes(value[-8:], "big")
    if type(value) is int:
        return value & MASK64
    raise _Invalid(f"a block hash must be an int or bytes, not {type(value).__name__}")


def _opt_str(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _Invalid(f"expected a string, got {type(value).__name__}")


def _short(value: object, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _from_bytes(item: _BytesStored | _BytesRemoved | AllBlocksCleared) -> KvEvent:
    if isinstance(item, _BytesStored):
        parent = item.parent_block_hash
        return BlockStored(
            block_hashes=[_hash_value(h) for h in item.block_hashes],
            parent_block_hash=None if parent is None else _hash_value(parent),
            token_ids=item.token_ids,
            block_size=item.block_size,
            lora_id=item.lora_id,
            medium=item.medium,
            lora_name=item.lora_name,
            extra_keys=item.extra_keys,
            group_idx=item.group_idx,
            kv_cache_spec_kind=item.kv_cache_spec_kind,
        )
    if isinstance(item, _BytesRemoved):
        return BlockRemoved(
            [_hash_value(h) for h in item.block_hashes], item.medium, item.group_idx
        )
    return item


def _from_positional(item: _PosStored | _PosRemoved | _PosCleared) -> KvEvent:
    if isinstance(item, _PosStored):
        return BlockStored(
            block_hashes=item.block_hashes,
            parent_block_hash=item.parent_block_hash,
            token_ids=item.token_ids,
            block_size=item.block_size,
            lora_id=item.lora_id,
            medium=item.medium,
            lora_name=item.lora_name,
            extra_keys=item.extra_keys,
            group_idx=item.group_idx,
        )
    if isinstance(item, _PosRemoved):
        return BlockRemoved(item.block_hashes, item.medium, item.group_idx)
    return AllBlocksCleared()


# -- helpers -------------------------------------------------------------------------------


def decode_seq(frame: bytes) -> int | None:
    """A sequence number frame (8 bytes, big-endian); None if it is not one."""
    if len(frame) != SEQ_BYTES:
        return None
    return int.from_bytes(frame, "big")


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def event_blocks(event: KvEvent) -> int:
    """The work an event costs to apply, in blocks (at least 1)."""
    if isinstance(event, AllBlocksCleared):
        return 1
    return len(event.block_hashes) or 1


def split_events(events: Sequence[KvEvent], max_blocks: int) -> Iterator[list[KvEvent]]:
    """The events in order, in slices of about `max_blocks` blocks, cutting a large
    BlockStored or BlockRemoved into pieces, so that applying one slice is bounded work.
    A piece of a BlockStored after the first has the previous piece's last block as its
    parent, and its own extra keys, so it applies exactly as the whole would."""
    if max_blocks < 1:
        raise ValueError("max_blocks must be at least 1")
    out: list[KvEvent] = []
    budget = max_blocks
    for event in events:
        cost = event_blocks(event)
        if cost <= budget:
            out.append(event)
            budget -= cost
            if budget <= 0:
                yield out
                out, budget = [], max_blocks
            continue
        for piece in _pieces(event, max_blocks):
            cost = event_blocks(piece)
            if cost > budget and out:
                yield out
                out, budget = [], max_blocks
            out.append(piece)
            budget -= cost
    if out:
        yield out


def _pieces(event: KvEvent, size: int) -> Iterator[KvEvent]:
    if isinstance(event, BlockRemoved):
        hashes = event.block_hashes
        for start in range(0, len(hashes), size):
            yield BlockRemoved(hashes[start : start + size], event.medium, event.group_idx)
        return
    if not isinstance(event, BlockStored):
        yield event
        return
    hashes = event.block_hashes
    bs = event.block_size
    parent = event.parent_block_hash
    for start in range(0, len(hashes), size):
        end = min(start + size, len(hashes))
        extra = event.extra_keys
        yield BlockStored(
            block_hashes=hashes[start:end],
            parent_block_hash=parent if start == 0 else hashes[start - 1],
            token_ids=event.token_ids[start * bs : end * bs],
            block_size=bs,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=None if extra is None else extra[start:end],
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
        )
