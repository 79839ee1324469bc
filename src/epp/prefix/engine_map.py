"""A precise pod's engine blocks: engine hash -> the router's key(s), in about 19 bytes each.

Removals (vLLM's `BlockRemoved`) name engine hashes, so the index must find our key for
each one. A dict of int -> int costs about 78 bytes an entry here: a dict slot (30-60 B,
with the table's slack) plus the engine hash's own int object (36 B for 64 bits), the
biggest part of a precise entry (docs/benchmarks/index.md). The pairs are instead packed as
16-byte records (engine hash, key: two little-endian uint64) in small bytearrays, one per
bucket of the engine hash's low bits, about 32 records each at the pod's capacity. A lookup
is one `bytearray.find` over a few hundred bytes (C, no object per record) plus a check
that the match is a record's hash field, not a key or a straddle. Each bucket is a CLOCK
queue: records keep the order they were stored in, and the capacity bound takes the front
record of each bucket in turn unless the index says it was used since (a routed hit), in
which case it goes to the back once. The "used" mark costs nothing here: it is the pod's
mark bit in the index (`PrefixIndex`), unused otherwise in precise mode.

What does not fit a record (a hash or key outside 0..2**64-1, several keys for one engine
block, unknown keys) goes to a plain dict beside the buckets.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice

from epp.prefix.hashing import BlockHash

EngineKeys = BlockHash | tuple[BlockHash, ...]
"""The router's key(s) for one engine block: one key when both use the same block size, a
tuple when an engine block spans several of ours; () when the block's keys are unknown (its
parent was never seen): it is kept so that its eviction and its children are recognised,
but it matches nothing."""

_RECORD = 16
_HASH = struct.Struct("<Q")
_PAIR = struct.Struct("<QQ")
_pack_hash = _HASH.pack
_pack_pair = _PAIR.pack
_unpack_key = _HASH.unpack_from
_PER_BUCKET = 32  # records a bucket holds on average at the pod's capacity


def _find(buf: bytearray, packed: bytes) -> int:
    """The offset of the record starting with `packed`, or -1."""
    pos = buf.find(packed)
    while pos > 0 and pos % _RECORD:  # inside a key, or across two records
        pos = buf.find(packed, pos + 1)
    return pos


class EngineMap:
    __slots__ = ("_buckets", "_cursor", "_mask", "_other", "_records")

    def __init__(self, capacity: int) -> None:
        self._other: dict[int, EngineKeys] = {}
        self._records = 0
        self._cursor = 0
        self._mask = 0
        self._buckets: list[bytearray | None] = [None]
        self.resize(capacity)

    def __len__(self) -> int:
        return self._records + len(self._other)

    def resize(self, capacity: int) -> None:
        """Size the buckets for about `capacity` blocks (their contents are kept)."""
        want = 1
        while want * _PER_BUCKET < capacity:
            want <<= 1
        if want == self._mask + 1:
            return
        old = self._buckets
        self._buckets = [None] * want
        self._mask = want - 1
        self._records = 0
        for buf in old:
            if buf:
                for engine_hash, key in _PAIR.iter_unpack(buf):
                    self.add(engine_hash, key)

    def get(self, engine_hash: int) -> EngineKeys | None:
        other = self._other
        if other:
            keys = other.get(engine_hash)
            if keys is not None:
                return keys
        try:
            packed = _pack_hash(engine_hash)
        except (struct.error, TypeError):
            return None
        buf = self._buckets[engine_hash & self._mask]
        if buf:
            pos = _find(buf, packed)
            if pos >= 0:
                return _unpack_key(buf, pos + 8)[0]
        return None

    def add(self, engine_hash: int, keys: EngineKeys) -> bool:
        """Keep the block; False (nothing done) if it is held already."""
        other = self._other
        if other and engine_hash in other:
            return False
        try:
            record = _pack_pair(engine_hash, keys)
        except (struct.error, TypeError):  # out of range, or not one key: kept aside
            if self.get(engine_hash) is not None:
                return False
            other[engine_hash] = keys
            return True
        slot = engine_hash & self._mask
        buf = self._buckets[slot]
        if buf is None:
            self._buckets[slot] = bytearray(record)
        else:
            # The same record again (a hash names its content, so its key too): a copy.
            pos = buf.find(record)
            if pos >= 0 and (pos % _RECORD == 0 or _find(buf, record) >= 0):
                return False
            buf += record
        self._records += 1
        return True

    def pop(self, engine_hash: int) -> EngineKeys | None:
        """Forget the block; its key(s), or None if it was not held."""
        try:
            packed = _pack_hash(engine_hash)
        except (struct.error, TypeError):
            return self._other.pop(engine_hash, None) if self._other else None
        slot = engine_hash & self._mask
        buf = self._buckets[slot]
        if buf:
            pos = buf.find(packed)
            if pos > 0 and pos % _RECORD:
                pos = _find(buf, packed)
            if pos >= 0:
                key: BlockHash = _unpack_key(buf, pos + 8)[0]
                del buf[pos : pos + _RECORD]
                if not buf:
                    self._buckets[slot] = None
                self._records -= 1
                return key
        return self._other.pop(engine_hash, None) if self._other else None

    def add_new(self, engine_hashes: Sequence[int], keys: Sequence[BlockHash]) -> None:
        """`add` of engine blocks the caller knows are not held (their keys are not held by
        the pod): no search for a copy. One loop here rather than a call per block:
        ingest's hot path."""
        buckets = self._buckets
        mask = self._mask
        added = 0
        for engine_hash, key in zip(engine_hashes, keys, strict=False):
            try:
                record = _pack_pair(engine_hash, key)
            except (struct.error, TypeError):
                self.add(engine_hash, key)
                continue
            slot = engine_hash & mask
            buf = buckets[slot]
            if buf is None:
                buckets[slot] = bytearray(record)
            else:
                buf += record
            added += 1
        self._records += added

    def pop_many(self, engine_hashes: Iterable[int]) -> list[EngineKeys]:
        """`pop` of each: the keys of those that were held."""
        found: list[EngineKeys] = []
        append = found.append
        aside = 0  # of those found, kept aside (not records)
        buckets = self._buckets
        mask = self._mask
        other = self._other
        for engine_hash in engine_hashes:
            try:
                packed = _pack_hash(engine_hash)
            except (struct.error, TypeError):
                packed = b""
            if packed:
                slot = engine_hash & mask
                buf = buckets[slot]
                if buf:
                    pos = buf.find(packed)
                    if pos & 15:  # not a record's start (-1 included): look further
                        pos = _find(buf, packed)
                    if pos >= 0:
                        append(_unpack_key(buf, pos + 8)[0])
                        del buf[pos : pos + _RECORD]
                        if not buf:
                            buckets[slot] = None  # an empty bytearray still costs 57 B
                        continue
            if other:
                keys = other.pop(engine_hash, None)
                if keys is not None:
                    append(keys)
                    aside += 1
        self._records -= len(found) - aside
        return found

    def pop_oldest(
        self, n: int, used: Callable[[EngineKeys], bool] | None = None
    ) -> list[EngineKeys]:
        """Forget about `n` blocks, the least recently used first: CLOCK (second chance)
        over the blocks aside, then over each bucket in turn. `used(keys)` says whether a
        block was used since its last turn and clears that mark (the index keeps it in the
        pod's mark bit of the key: no byte here); a used block goes to the back of its
        queue instead, once. Without `used`, the oldest first. Their keys.

        Bounded: at most `max(2 * n, 2048)` second chances a call (about 2 us each), then
        the oldest go whatever their use, so one call never stalls the loop however many
        blocks are marked (the capacity stays a hard bound); a block aside gets its second
        chance at most once a call. Hot blocks, marked again between turns, stay while
        cold ones go."""
        out: list[EngineKeys] = []
        chances = max(2 * n, 2048) if used is not None else 0
        chances = self._pop_aside(out, n, used, chances)
        self._pop_records(out, n, used, chances)
        return out

    def _pop_aside(
        self, out: list[EngineKeys], n: int, used: Callable[[EngineKeys], bool] | None, chances: int
    ) -> int:
        """CLOCK over the blocks aside, each looked at once at most, until `out` holds `n`.
        The second chances left."""
        other = self._other
        visits = len(other)
        while visits and len(out) < n:
            # The front in chunks: a dict walked from its start skips what was deleted.
            chunk = list(islice(other, min(visits, n - len(out))))
            visits -= len(chunk)
            for engine_hash in chunk:
                keys = other.pop(engine_hash)
                if chances and used(keys):  # type: ignore[misc]
                    chances -= 1
                    other[engine_hash] = keys  # to the back
                else:
                    out.append(keys)
        return chances

    def _pop_records(
        self, out: list[EngineKeys], n: int, used: Callable[[EngineKeys], bool] | None, chances: int
    ) -> None:
        """CLOCK over the buckets' records, one bucket's front in turn from the cursor,
        until `out` holds `n`."""
        buckets = self._buckets
        cursor = self._cursor
        while len(out) < n and self._records:
            slot = cursor
            buf = buckets[slot]
            cursor = (cursor + 1) & self._mask
            if buf:
                key = _unpack_key(buf, 8)[0]
                if chances and used(key):  # type: ignore[misc]
                    chances -= 1
                    if len(buf) > _RECORD:
                        record = buf[:_RECORD]
                        del buf[:_RECORD]
                        buf += record  # a second chance: the back of its bucket
                    continue
                out.append(key)
                del buf[:_RECORD]
                if not buf:
                    buckets[slot] = None
                self._records -= 1
        self._cursor = cursor

    def nbytes(self) -> int:
        """Bytes the map allocates (its records, buckets and what is aside)."""
        total = sys.getsizeof(self._buckets) + sys.getsizeof(self._other)
        return total + sum(sys.getsizeof(buf) for buf in self._buckets if buf is not None)

    def hashes(self) -> list[int]:
        out = [h for buf in self._buckets if buf for h, _ in _PAIR.iter_unpack(buf)]
        out.extend(self._other)
        return out

    def hash_slices(self, records: int = 4096) -> Iterator[list[int]]:
        """The engine hashes in slices of about `records` (whole buckets), so that a reader
        can yield to the event loop between slices. Each bucket is read in one go; the map
        may change between slices (a slice is its buckets as they were when it was read)."""
        yield list(self._other)
        buckets = self._buckets  # a resize replaces the list; this one stays as it was
        out: list[int] = []
        for buf in buckets:
            if buf:
                out += [h for h, _ in _PAIR.iter_unpack(buf)]
                if len(out) >= records:
                    yield out
                    out = []
        yield out

    def values(self) -> Iterator[EngineKeys]:
        for buf in self._buckets:
            if buf:
                for _, key in _PAIR.iter_unpack(buf):
                    yield key
        yield from self._other.values()
