"""A payload (frame 3 of a publisher's message) decoded into an EventBatch, strictly and
defensively: the decoder never raises on input.

A payload over `max_payload_bytes`, with more than `max_events` events, or that is not
`[ts, events, data_parallel_rank]` is refused whole (None). An event that breaks the rules
(unknown type, wrong field types, a hash that is no hash, token ids that do not fill the
blocks, more blocks than `max_blocks_per_event`) is dropped and the rest kept. Each case is
counted in `KvEventStats` and logged at most a few lines a second per reason.

The layouts' typed decoders are tried first (layouts.py; the map layout with int hashes,
vLLM's default, is the first and the fastest); a batch none of them reads is read event by
event. Typing leaves the bounds to check, the same on both paths (`_checked`). An event
whose block hashes came as bytes is counted (`bytes_hashes`) once its fields are read,
before its bounds are checked, on either path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from epp.prefix.kv_events.events import AllBlocksCleared, BlockStored, EventBatch, KvEvent
from epp.prefix.kv_events.fields import MASK64, Invalid
from epp.prefix.kv_events.layouts import LAYOUTS, Layout, UnknownType, read_by_hand, sent_bytes
from epp.prefix.kv_events.stats import KvEventStats

_ANY_DECODER = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on one batch. The defaults are far above what one engine step produces (a
    step stores at most its batched tokens, 2k-64k: about 250 KB of payload at most) and
    keep a hostile or broken publisher from making the router allocate without bound.
    Decoding is the one part of ingest that is not sliced: its event-loop time grows with
    the payload (docs/benchmarks/index.md), so the payload cap bounds that pause."""

    max_payload_bytes: int = 1024 * 1024
    max_events: int = 100_000
    max_blocks_per_event: int = 65_536
    max_block_size: int = 4096


class KvEventDecoder:
    def __init__(self, limits: DecodeLimits | None = None, stats: KvEventStats | None = None):
        self.limits = limits or DecodeLimits()
        self.stats = stats or KvEventStats()

    def decode(self, payload: bytes, pod: str | None = None) -> EventBatch | None:
        """The batch in `payload`, with every event that breaks the rules dropped; None
        when the payload is refused or is not a batch (counted and logged)."""
        if len(payload) > self.limits.max_payload_bytes:
            self.stats.problem("oversized_payload", pod=pod, bytes=len(payload))
            return None
        for layout in LAYOUTS:
            try:
                raw = layout.decoder.decode(payload)
            except Exception:  # msgspec's errors; hostile input: RecursionError, MemoryError
                continue
            batch = self._typed(layout, raw, pod)
            break
        else:
            batch = self._by_hand(payload, pod)
        if batch is None:
            return None
        self.stats.counts["batches"] += 1
        self.stats.counts["events"] += len(batch.events)
        return batch

    def _typed(self, layout: Layout, raw: Any, pod: str | None) -> EventBatch | None:
        """The events of a batch a layout's typed decoder read, converted and checked."""
        if layout.counter is not None:
            self.stats.counts[layout.counter] += 1
        if not self._few_enough(len(raw.events), pod):
            return None
        converters = layout.converters
        if converters is None:
            batch: EventBatch = raw
            kept = [event for event in batch.events if self._checked(event, pod)]
            if len(kept) != len(batch.events):
                batch.events = kept
            return batch
        events: list[KvEvent] = []
        for item in raw.events:
            try:
                event = converters[type(item)](item)
            except Invalid as exc:
                self.stats.problem("invalid_event", pod=pod, error=str(exc))
                continue
            if layout.bytes_hashes and sent_bytes(item):
                self.stats.add("bytes_hashes")
            if self._checked(event, pod):
                events.append(event)
        return EventBatch(raw.ts, events, raw.data_parallel_rank)

    def _by_hand(self, payload: bytes, pod: str | None) -> EventBatch | None:
        try:
            raw = _ANY_DECODER.decode(payload)
        except Exception as exc:
            self.stats.problem("malformed_payload", pod=pod, error=_short(exc))
            return None
        if (
            not isinstance(raw, list)
            or len(raw) < 2
            or not isinstance(raw[0], int | float)
            or isinstance(raw[0], bool)
            or not isinstance(raw[1], list)
        ):
            self.stats.problem("malformed_payload", pod=pod, error="not [ts, events, rank]")
            return None
        if not self._few_enough(len(raw[1]), pod):
            return None
        rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
        events = [self._read(item, pod) for item in raw[1]]
        return EventBatch(float(raw[0]), [e for e in events if e is not None], rank)

    def _read(self, item: object, pod: str | None) -> KvEvent | None:
        try:
            event, bytes_hashes = read_by_hand(item)
        except UnknownType as exc:
            self.stats.problem("unknown_event_type", pod=pod, type=_short(exc.args[0]))
            return None
        except Invalid as exc:
            self.stats.problem("invalid_event", pod=pod, error=str(exc))
            return None
        if bytes_hashes:
            self.stats.add("bytes_hashes")
        return event if self._checked(event, pod) else None

    def _few_enough(self, events: int, pod: str | None) -> bool:
        if events > self.limits.max_events:
            self.stats.problem("oversized_batch", pod=pod, events=events)
            return False
        return True

    def _checked(self, event: KvEvent, pod: str | None) -> bool:
        """Whether `event` is within the bounds (counted and logged if not); hashes sent
        as signed ints are made unsigned in place."""
        if isinstance(event, AllBlocksCleared):
            return True
        try:
            if isinstance(event, BlockStored):
                self._check_stored(event)
            else:
                event.block_hashes = self._check_hashes(event.block_hashes)
        except Invalid as exc:
            self.stats.problem("invalid_event", pod=pod, error=str(exc))
            return False
        return True

    def _check_hashes(self, hashes: list[int]) -> list[int]:
        if len(hashes) > self.limits.max_blocks_per_event:
            raise Invalid(f"{len(hashes)} blocks in one event")
        if not hashes:
            raise Invalid("no block hashes")
        if min(hashes) < 0:  # a signed int64 publisher: the same 64 bits
            return [value & MASK64 for value in hashes]
        return hashes

    def _check_stored(self, event: BlockStored) -> None:
        event.block_hashes = self._check_hashes(event.block_hashes)
        n = len(event.block_hashes)
        if not 1 <= event.block_size <= self.limits.max_block_size:
            raise Invalid(f"block_size {event.block_size}")
        if len(event.token_ids) != n * event.block_size:
            raise Invalid(f"{len(event.token_ids)} token ids for {n} blocks of {event.block_size}")
        if event.parent_block_hash is not None and event.parent_block_hash < 0:
            event.parent_block_hash &= MASK64
        extra = event.extra_keys
        if extra is not None and len(extra) != n:
            raise Invalid(f"{len(extra)} extra_keys for {n} blocks")


def _short(value: object, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."
