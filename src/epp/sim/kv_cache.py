"""The simulated GPU KV cache: a fixed pool of blocks with prefix reuse and LRU eviction.

Modelled on vLLM v1's block pool, reduced to what routing can observe:

- Full prompt blocks are keyed by their chained hash (see `epp.prefix.hashing`), so one
  hash stands for the whole prefix up to and including its block, as in vLLM.
- A block is pinned (reference counted) while a running request uses it. Unpinned blocks
  stay cached and are evicted, least recently used first, only when space is needed.
- When a request releases its blocks, the tail ones are queued for eviction before the
  head ones (vLLM frees in reverse order), so a shared system prompt outlives the turns
  that followed it.
- Blocks that are not full prompt blocks (the partial last prompt block, the output
  tokens) are anonymous: they count against capacity while the request runs and are
  dropped when it finishes. vLLM also caches full output blocks; the simulator does not,
  because its filler output never reappears verbatim in a later prompt anyway.

No I/O and no clock: the owner decides when requests start and finish.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from epp.prefix.hashing import BlockHash


class PrefixBlockPool:
    """`num_blocks` KV blocks; hashed blocks are shared, anonymous ones are private."""

    __slots__ = ("_anonymous_in_use", "_evictable", "_refcounts", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        # Every cached hashed block and how many running requests hold it.
        self._refcounts: dict[BlockHash, int] = {}
        # The cached blocks nobody holds, oldest (first to evict) first.
        self._evictable: OrderedDict[BlockHash, None] = OrderedDict()
        self._anonymous_in_use = 0

    @property
    def cached_blocks(self) -> int:
        """Hashed blocks present, pinned or not."""
        return len(self._refcounts)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held by running requests: what vLLM reports as KV-cache usage."""
        return len(self._refcounts) - len(self._evictable) + self._anonymous_in_use

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all (evictable cached blocks not included)."""
        return self.num_blocks - len(self._refcounts) - self._anonymous_in_use

    def contains(self, block: BlockHash) -> bool:
        return block in self._refcounts

    def leading_hits(self, hashes: Sequence[BlockHash]) -> int:
        """How many blocks from the start of `hashes` are cached (the reusable prefix)."""
        refcounts = self._refcounts
        hits = 0
        for block in hashes:
            if block not in refcounts:
                break
            hits += 1
        return hits

    def try_pin(self, hashes: Sequence[BlockHash], anonymous: int) -> bool:
        """Pin `hashes` (reusing cached ones) plus `anonymous` private blocks, or do nothing.

        Evicts least recently used unpinned blocks only as far as needed. Returns False,
        with the pool unchanged, when the blocks cannot all fit.
        """
        refcounts = self._refcounts
        distinct = set(hashes)
        missing = {block for block in distinct if block not in refcounts}
        # Cached blocks this request is about to pin can no longer be evicted for it.
        reused_evictable = sum(1 for block in distinct if refcounts.get(block) == 0)
        room = self.free_blocks + len(self._evictable) - reused_evictable
        if len(missing) + anonymous > room:
            return False
        # Pin what is already cached first, so the evictions below cannot take it.
        for block in hashes:
            if block not in missing:
                count = refcounts[block]
                if count == 0:
                    del self._evictable[block]
                refcounts[block] = count + 1
        self._evict(len(missing) + anonymous - self.free_blocks)
        # A hash repeated within one request is pinned once per occurrence, which is what
        # `unpin` gives back.
        for block in hashes:
            if block in missing:
                refcounts[block] = refcounts.get(block, 0) + 1
        self._anonymous_in_use += anonymous
        return True

    def unpin(self, hashes: Sequence[BlockHash], anonymous: int) -> None:
        """Release what `try_pin` took; hashed blocks stay cached and become evictable."""
        refcounts = self._refcounts
        evictable = self._evictable
        # Reverse order: the tail of a prompt is queued for eviction before its head.
        for block in reversed(hashes):
            count = refcounts[block] - 1
            refcounts[block] = count
            if count == 0:
                evictable[block] = None
        self._anonymous_in_use -= anonymous

    def reset(self) -> int:
        """Drop every unpinned cached block (vLLM's /reset_prefix_cache); returns how many."""
        dropped = len(self._evictable)
        for block in self._evictable:
            del self._refcounts[block]
        self._evictable.clear()
        return dropped

    def _evict(self, count: int) -> None:
        evictable = self._evictable
        refcounts = self._refcounts
        for _ in range(count):
            block, _ = evictable.popitem(last=False)
            del refcounts[block]
