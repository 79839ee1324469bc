"""The simulated GPU KV cache: a fixed pool of blocks with prefix reuse and LRU eviction.

Modelled on vLLM v1's block pool (`vllm/v1/core/block_pool.py`), reduced to what routing
can observe:

- A cached block is a physical block holding a full block of tokens, keyed by its chained
  hash (see `vllm_sim.hashing`), so one hash stands for the whole prefix up to and
  including its block, as in vLLM.
- vLLM does not de-duplicate: a block computed anew is cached even when another block
  already holds the same hash, so a hash can have several copies. That happens when a
  fully cached prompt recomputes its last block (the last prompt token is never a hit),
  when a request's cached prefix has a hole (every block after it is computed again), and
  when identical output blocks are generated twice. A lookup uses the oldest copy; each
  copy is evicted on its own (one `BlockRemoved` each).
- A block is pinned (reference counted) while a running request uses it. Unpinned cached
  blocks stay cached and are evicted, least recently released first, only when the blocks
  holding nothing run out: vLLM puts freed blocks without a hash at the front of its free
  queue and cached ones at the back.
- When a request releases its blocks, the tail ones are queued for eviction before the
  head ones (vLLM frees in reverse order), so a shared system prompt outlives the turns
  that followed it.
- Blocks that hold no full block of known tokens (the partial last block, the room for
  output) are anonymous: they count against capacity while the request runs. When a
  request's output fills some of them, `cache_anonymous` turns those into cached blocks
  (vLLM caches every full block of prompt + output tokens); the rest are freed on release.
- A reset forgets every block at once. Blocks that running requests still hold stay
  allocated but are detached from the cache (no later request can reuse them) and are
  freed silently when released, so that after an `AllBlocksCleared` event the pool holds
  nothing a subscriber does not know about. (vLLM refuses a reset while blocks are in
  use; the simulator resets anyway and detaches them.)
- With `removed` set to a list, every eviction appends the evicted hash to it: the
  owner turns those into `BlockRemoved` events.
- A block can be cached before its KV is computed (the owner allocates a request's blocks
  when it starts, and computes them during its prefill): `mark_ready_at` records when
  it will be. Lookups given a time (`leading_hits(hashes, at)`) reuse only copies ready
  by then; lookups without one see every cached copy.

No I/O and no clock: the owner decides when requests start and finish.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from vllm_sim.hashing import BlockHash

BlockTable = list[int]
"""The physical blocks a request holds, in order (ids private to one pool)."""


class PrefixBlockPool:
    """`num_blocks` KV blocks; cached blocks are shared, anonymous ones are private."""

    __slots__ = (
        "_anonymous_in_use",
        "_copies",
        "_epoch",
        "_evictable",
        "_hash_of",
        "_next_id",
        "_pending",
        "_ready_at",
        "_refs",
        "num_blocks",
        "removed",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        self.num_blocks = num_blocks
        # Every cached hash and the blocks holding it, oldest (the one lookups use) first.
        self._copies: dict[BlockHash, list[int]] = {}
        # Every cached block's hash.
        self._hash_of: dict[int, BlockHash] = {}
        # Every allocated block that is not anonymous (cached, or detached by a reset) and
        # how many running requests hold it.
        self._refs: dict[int, int] = {}
        # The cached blocks nobody holds, oldest (first to evict) first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._anonymous_in_use = 0
        # Cached blocks whose KV is not computed yet -> the time it will be; and the same
        # as a heap, to forget them once the owner's clock passes that time.
        self._ready_at: dict[int, float] = {}
        self._pending: list[tuple[float, int]] = []
        self._next_id = 0
        self._epoch = 0
        self.removed: list[BlockHash] | None = None

    @property
    def cached_blocks(self) -> int:
        """Cached blocks present, pinned or not (copies of one hash count each)."""
        return len(self._hash_of)

    @property
    def pinned_blocks(self) -> int:
        """Blocks held by running requests: what vLLM reports as KV-cache usage."""
        return len(self._refs) - len(self._evictable) + self._anonymous_in_use

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing at all (evictable cached blocks not included)."""
        return self.num_blocks - len(self._refs) - self._anonymous_in_use

    @property
    def epoch(self) -> int:
        """How many resets so far (a request pinned in an older epoch holds detached blocks)."""
        return self._epoch

    def cached_hashes(self) -> list[BlockHash]:
        """Every cached hash once (however many copies), for debugging views."""
        return list(self._copies)

    def contains(self, block: BlockHash) -> bool:
        return block in self._copies

    def copies(self, block: BlockHash) -> int:
        """How many cached blocks hold `block`."""
        return len(self._copies.get(block, ()))

    def leading_hits(self, hashes: Sequence[BlockHash], at: float | None = None) -> int:
        """How many blocks from the start of `hashes` are cached (the reusable prefix);
        with `at`, only copies whose KV is computed by then count."""
        copies = self._copies
        hits = 0
        if at is None or not self._ready_at:
            for block in hashes:
                if block not in copies:
                    break
                hits += 1
            return hits
        for block in hashes:
            holders = copies.get(block)
            if holders is None or self._ready_copy(holders, at) is None:
                break
            hits += 1
        return hits

    def _ready_copy(self, holders: list[int], at: float | None) -> int | None:
        """The oldest of `holders` computed by `at` (any copy when `at` is None)."""
        ready_at = self._ready_at
        if at is None or not ready_at:
            return holders[0]
        for block in holders:
            ready = ready_at.get(block)
            if ready is None or ready <= at:
                return block
        return None

    def mark_ready_at(self, blocks: Sequence[int], at: float) -> None:
        """The KV of these (newly allocated, cached) blocks is computed at time `at`."""
        for block in blocks:
            self._ready_at[block] = at
            heapq.heappush(self._pending, (at, block))

    def settle(self, now: float) -> None:
        """Forget the ready times that `now` has passed (the owner's clock never goes back)."""
        pending = self._pending
        ready_at = self._ready_at
        while pending and pending[0][0] <= now:
            at, block = heapq.heappop(pending)
            if ready_at.get(block) == at:
                del ready_at[block]

    def allocate(
        self,
        hashes: Sequence[BlockHash],
        hits: int,
        anonymous: int,
        at: float | None = None,
    ) -> BlockTable | None:
        """Blocks for a request, or None (pool unchanged) when they cannot all fit.

        The first `hits` hashes reuse their cached blocks (they must be cached: at most
        `leading_hits(hashes, at)`, and the copy reused is the oldest one computed by
        `at`); every later hash gets a new block, cached at once under its hash (vLLM
        caches a request's full prompt blocks when it schedules them), even when another
        copy exists; `anonymous` more blocks are reserved. Evicts least recently released
        blocks only as far as needed. Returns the block table (reused and new blocks, in
        `hashes` order) to give back to `release`.
        """
        copies = self._copies
        refs = self._refs
        table: list[int] = []
        for block_hash in hashes[:hits]:
            block = self._ready_copy(copies[block_hash], at)
            if block is None:
                raise ValueError("a reused block must be cached and computed by `at`")
            table.append(block)
        new = len(hashes) - hits + anonymous
        # Cached blocks this request is about to pin can no longer be evicted for it.
        reused_evictable = sum(1 for block in set(table) if refs[block] == 0)
        if new > self.free_blocks + len(self._evictable) - reused_evictable:
            return None
        # Pin what is reused first, so that the evictions below cannot take it.
        evictable = self._evictable
        for block in table:
            count = refs[block]
            if count == 0:
                del evictable[block]
            refs[block] = count + 1
        shortfall = new - self.free_blocks
        if shortfall > 0:
            self._evict(shortfall)
        for block_hash in hashes[hits:]:
            table.append(self._new_cached(block_hash))
        self._anonymous_in_use += anonymous
        return table

    def cache_anonymous(self, table: BlockTable, hashes: Sequence[BlockHash]) -> None:
        """Turn `len(hashes)` of the anonymous blocks a request holds into cached blocks
        under `hashes` (its output filled them), appended to its `table`; the request
        then gives back that many fewer anonymous blocks to `release`."""
        if len(hashes) > self._anonymous_in_use:
            raise ValueError("more blocks to cache than anonymous blocks in use")
        self._anonymous_in_use -= len(hashes)
        for block_hash in hashes:
            table.append(self._new_cached(block_hash))

    def release(self, table: BlockTable, anonymous: int) -> None:
        """Give back what `allocate` (and `cache_anonymous`) took.

        Cached blocks stay cached and become evictable, the table's tail first; blocks
        detached by a reset since are freed, as are the anonymous ones.
        """
        refs = self._refs
        hash_of = self._hash_of
        evictable = self._evictable
        # Reverse order: the tail of a request is queued for eviction before its head.
        for block in reversed(table):
            count = refs[block] - 1
            if count:
                refs[block] = count
            elif block in hash_of:
                refs[block] = 0
                evictable[block] = None
            else:
                del refs[block]
                self._ready_at.pop(block, None)
        self._anonymous_in_use -= anonymous

    def reset(self) -> int:
        """Forget every cached block (vLLM's /reset_prefix_cache); returns how many idle
        blocks were freed. Held blocks stay allocated, detached, until released."""
        dropped = len(self._evictable)
        refs = self._refs
        for block in self._evictable:
            del refs[block]
        self._evictable.clear()
        self._hash_of.clear()
        self._copies.clear()
        # Detached blocks are never looked up again: their ready times do not matter.
        self._ready_at.clear()
        self._pending.clear()
        self._epoch += 1
        return dropped

    def _new_cached(self, block_hash: BlockHash) -> int:
        block = self._next_id
        self._next_id = block + 1
        self._refs[block] = 1
        self._hash_of[block] = block_hash
        holders = self._copies.get(block_hash)
        if holders is None:
            self._copies[block_hash] = [block]
        else:
            holders.append(block)
        return block

    def _evict(self, count: int) -> None:
        evictable = self._evictable
        refs = self._refs
        hash_of = self._hash_of
        copies = self._copies
        removed = self.removed
        for _ in range(count):
            block, _ = evictable.popitem(last=False)
            del refs[block]
            self._ready_at.pop(block, None)
            block_hash = hash_of.pop(block)
            holders = copies[block_hash]
            if len(holders) == 1:
                del copies[block_hash]
            else:
                holders.remove(block)
            if removed is not None:
                removed.append(block_hash)
