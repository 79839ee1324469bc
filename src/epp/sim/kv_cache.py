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
- A reset forgets every block at once. Blocks that running requests still hold stay
  allocated but are detached from the cache (no later request can reuse them) and are
  freed silently when released, so that after an `AllBlocksCleared` event the pool holds
  nothing a subscriber does not know about.
- With `removed` set to a list, every eviction appends the evicted hash to it: the
  owner turns those into `BlockRemoved` events.

No I/O and no clock: the owner decides when requests start and finish.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from epp.prefix.hashing import BlockHash


class PrefixBlockPool:
    """`num_blocks` KV blocks; hashed blocks are shared, anonymous ones are private."""

    __slots__ = (
        "_anonymous_in_use",
        "_detached",
        "_epoch",
        "_evictable",
        "_refcounts",
        "num_blocks",
        "removed",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        # Every cached hashed block and how many running requests hold it.
        self._refcounts: dict[BlockHash, int] = {}
        # The cached blocks nobody holds, oldest (first to evict) first.
        self._evictable: OrderedDict[BlockHash, None] = OrderedDict()
        self._anonymous_in_use = 0
        # Blocks still held when a reset came, keyed by (epoch of the pin, hash): the same
        # hash may be cached again after the reset, as a different block.
        self._detached: dict[tuple[int, BlockHash], int] = {}
        self._epoch = 0
        self.removed: list[BlockHash] | None = None

    @property
    def cached_blocks(self) -> int:
        """Hashed blocks present, pinned or not."""
        return len(self._refcounts)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held by running requests: what vLLM reports as KV-cache usage."""
        return (
            len(self._refcounts)
            - len(self._evictable)
            + self._anonymous_in_use
            + len(self._detached)
        )

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all (evictable cached blocks not included)."""
        return self.num_blocks - len(self._refcounts) - self._anonymous_in_use - len(self._detached)

    @property
    def epoch(self) -> int:
        """How many resets so far; pass the value current at `try_pin` back to `unpin`."""
        return self._epoch

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

    def unpin(self, hashes: Sequence[BlockHash], anonymous: int, epoch: int | None = None) -> None:
        """Release what `try_pin` took; hashed blocks stay cached and become evictable.

        `epoch` is `self.epoch` as it was at `try_pin` (None: the current one). Blocks
        pinned before a reset are freed instead of cached.
        """
        if epoch is not None and epoch != self._epoch:
            self._unpin_detached(hashes, epoch)
            self._anonymous_in_use -= anonymous
            return
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
        """Forget every cached block (vLLM's /reset_prefix_cache); returns how many idle
        blocks were freed. Held blocks stay allocated, detached, until released."""
        dropped = len(self._evictable)
        for block in self._evictable:
            del self._refcounts[block]
        self._evictable.clear()
        epoch = self._epoch
        for block, count in self._refcounts.items():
            self._detached[(epoch, block)] = count
        self._refcounts.clear()
        self._epoch += 1
        return dropped

    def _unpin_detached(self, hashes: Sequence[BlockHash], epoch: int) -> None:
        detached = self._detached
        for block in hashes:
            key = (epoch, block)
            count = detached[key] - 1
            if count:
                detached[key] = count
            else:
                del detached[key]

    def _evict(self, count: int) -> None:
        evictable = self._evictable
        refcounts = self._refcounts
        removed = self.removed
        for _ in range(count):
            block, _ = evictable.popitem(last=False)
            del refcounts[block]
            if removed is not None:
                removed.append(block)
