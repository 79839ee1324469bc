"""Token ids of rendered-text prefixes, so that turn N of a conversation re-encodes only
what turn N-1 did not have.

Keys are chained hashes of the rendered text cut at special-token boundaries:
key(b) = xxh3_64(text between the previous boundary and b, seed = key(previous)), so a key
stands for the whole text before its boundary. An entry holds the ids added since its
parent entry (a boundary stored earlier in the same text), which makes the cache a trie:
conversations that share a system prompt share its entry, and a conversation's entries
share their history instead of each holding a copy of it.

Why special-token boundaries are safe to cut at: HF `tokenizers` splits the input on
added tokens before anything else (normalizer, pre-tokenizer, model), and encodes the text
between them independently. So the ids of a text that ends with a special token are a
prefix of the ids of any longer text that starts with it (hf.py verifies the rest with an
anchor: the suffix is encoded after the boundary's special token, which it must come out
as).

Bounded memory: entries are evicted least recently used first once their estimated size
(4 bytes per id plus a fixed overhead per entry) passes `max_bytes`. Reading an entry
touches its ancestors after it, so a parent is always more recently used than its
children and is evicted after them; a child whose parent is gone anyway (never while the
order holds) is treated as a miss. Single-threaded: the router's event loop owns it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

# Per entry beyond its ids: the dict slot, the key int, the tuple and the array header
# (about 150 bytes in CPython), rounded up so the bound errs on the safe side.
ENTRY_OVERHEAD_BYTES = 160


@dataclass(frozen=True, slots=True)
class CacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int


class PrefixTokenCache:
    """key -> (parent key or None, ids since the parent), LRU by estimated bytes."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[int | None, array]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    @property
    def bytes(self) -> int:
        return self._bytes

    def stats(self) -> CacheStats:
        return CacheStats(len(self._entries), self._bytes, self.hits, self.misses, self.evictions)

    def get(self, key: int) -> array | None:
        """The full ids of the text before the key's boundary, or None."""
        chain: list[int] = []
        segments: list[array] = []
        current: int | None = key
        while current is not None:
            entry = self._entries.get(current)
            if entry is None:
                self.misses += 1
                return None
            chain.append(current)
            segments.append(entry[1])
            current = entry[0]
        # Leaf first, root last: the root ends most recently used.
        move = self._entries.move_to_end
        for k in chain:
            move(k)
        self.hits += 1
        if len(segments) == 1:
            return array("I", segments[0])
        ids = array("I")
        for segment in reversed(segments):
            ids.extend(segment)
        return ids

    def put(self, key: int, parent: int | None, ids: array) -> None:
        """Store the ids added since `parent` (which must be stored, or None)."""
        if self.max_bytes == 0 or key in self._entries:
            return
        if parent is not None and parent not in self._entries:
            return
        size = ENTRY_OVERHEAD_BYTES + ids.itemsize * len(ids)
        if size > self.max_bytes:
            return
        self._entries[key] = (parent, ids)  # most recently used
        self._bytes += size
        if parent is not None:
            # Keep ancestors more recent than the new child.
            current: int | None = parent
            chain = []
            while current is not None and current in self._entries:
                chain.append(current)
                current = self._entries[current][0]
            for k in chain:
                self._entries.move_to_end(k)
        self._evict()

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._entries:
            _, (_, ids) = self._entries.popitem(last=False)
            self._bytes -= ENTRY_OVERHEAD_BYTES + ids.itemsize * len(ids)
            self.evictions += 1
