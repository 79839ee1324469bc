"""Approximate mode: the router assumes a pod holds what it sent there, bounded by CLOCK.

The pod's blocks are bounded by a capacity (its real KV size when known), so the index
cannot grow without bound and forgets what the pod must have evicted too. CLOCK (second
chance) is the classic close approximation of LRU: blocks queue in the order they were
first recorded; a block recorded again is marked, and when its turn to go comes, a marked
block loses its mark and goes to the back instead. A prompt's blocks are queued tail first,
as an engine evicts a sequence's tail before its head.

The queue is an array of 8-byte hashes per pod (no object per block, no linked list);
whether a block is held and marked is read from the pod's bits (`epp.prefix.holders`).
Each held block is queued exactly once.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

from epp.kernels import PREFIX as COMPILED
from epp.prefix.hashing import BlockHash
from epp.prefix.pod_blocks import PodBlocks


def record(bits: dict[BlockHash, int], slot: PodBlocks, hashes: Sequence[BlockHash]) -> None:
    """The pod holds these blocks: new ones are queued (tail first), held ones marked;
    then the pod is brought back within its capacity."""
    log = slot.log
    if COMPILED is not None and type(log) is array:
        # None: a hash that is not a 64-bit unsigned int; nothing changed, the twin runs.
        added = COMPILED.record_new(bits, hashes, slot.hold, slot.mark, slot.both)
        if added is not None:
            log.frombytes(added)
            slot.count += len(added) >> 3
            evict(bits, slot)
            return
    python_record(bits, slot, hashes)


def python_record(bits: dict[BlockHash, int], slot: PodBlocks, hashes: Sequence[BlockHash]) -> None:
    """`record` in pure Python (the twin of the compiled `record_new` and `evict`,
    epp.kernels)."""
    holders_of = bits.get
    hold, mark, both = slot.hold, slot.mark, slot.both
    append = slot.log.append
    added = 0
    for block in reversed(hashes):
        mask = holders_of(block)
        if mask is None:
            bits[block] = hold
        elif mask == both:  # held by this pod alone, marked: the common re-record
            continue
        elif mask == hold:
            bits[block] = both
            continue
        elif mask & hold:
            if not mask & mark:
                bits[block] = mask | mark
            continue
        else:
            bits[block] = mask | hold
        try:
            append(block)
        except OverflowError:  # not a 64-bit unsigned hash (see _append_slow)
            append = _append_slow(slot, block)
        added += 1
    slot.count += added
    python_evict(bits, slot)


def _append_slow(slot: PodBlocks, block: BlockHash) -> Callable[[BlockHash], None]:
    # The router's hashes are xxh64 digests (0..2**64-1: an array of 8-byte values);
    # anything else (tests use Python's signed hash()) moves the queue to a list.
    if isinstance(slot.log, array):
        slot.log = list(slot.log)
    slot.log.append(block)
    return slot.log.append


def evict(bits: dict[BlockHash, int], slot: PodBlocks) -> None:
    """CLOCK: from the front of the queue, a marked block loses its mark and goes to the
    back; an unmarked one is evicted; until the pod is within its capacity."""
    excess = slot.count - slot.capacity
    if excess <= 0:
        return
    log = slot.log
    if COMPILED is not None and type(log) is array:
        pos, requeued = COMPILED.evict(
            bits, log, slot.log_pos, excess, slot.hold, slot.mark, slot.both
        )
        log.frombytes(requeued)
        _settle(slot, pos)
        return
    python_evict(bits, slot)


def python_evict(bits: dict[BlockHash, int], slot: PodBlocks) -> None:
    """`evict` in pure Python (the twin of the compiled one)."""
    excess = slot.count - slot.capacity
    if excess <= 0:
        return
    holders_of = bits.get
    hold, mark = slot.hold, slot.mark
    log = slot.log
    pos = slot.log_pos
    while excess > 0:
        block = log[pos]
        pos += 1
        mask = holders_of(block)
        if mask is None or not mask & hold:
            continue  # not held (cannot happen: each held block is queued once)
        if mask & mark:
            mask ^= mark
            bits[block] = hold if mask == hold else mask
            log.append(block)  # a second chance: to the back
            continue
        mask ^= hold
        if mask:
            bits[block] = mask
        else:
            del bits[block]
        excess -= 1
    _settle(slot, pos)


def _settle(slot: PodBlocks, pos: int) -> None:
    """After eviction: the pod at its capacity, its queue starting at `pos`."""
    slot.count = slot.capacity
    log = slot.log
    if pos > 1024 and pos * 2 > len(log):
        del log[:pos]  # the consumed front: memmove of the rest, once per half turn
        pos = 0
    slot.log_pos = pos
