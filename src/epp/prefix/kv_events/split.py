"""Cutting a batch's events into slices of bounded work, so that applying one slice to the
index is bounded however large the batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec

from epp.prefix.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


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
    """`event` cut into pieces of at most `size` blocks; every field but the blocks' own
    (hashes, parent, token ids, extra keys) is the whole event's."""
    if isinstance(event, AllBlocksCleared):
        yield event
        return
    hashes = event.block_hashes
    if isinstance(event, BlockRemoved):
        for start in range(0, len(hashes), size):
            yield msgspec.structs.replace(event, block_hashes=hashes[start : start + size])
        return
    yield from _stored_pieces(event, size)


def _stored_pieces(event: BlockStored, size: int) -> Iterator[BlockStored]:
    hashes = event.block_hashes
    bs = event.block_size
    extra = event.extra_keys
    for start in range(0, len(hashes), size):
        end = min(start + size, len(hashes))
        yield msgspec.structs.replace(
            event,
            block_hashes=hashes[start:end],
            parent_block_hash=event.parent_block_hash if start == 0 else hashes[start - 1],
            token_ids=event.token_ids[start * bs : end * bs],
            extra_keys=None if extra is None else extra[start:end],
        )
