"""The block pool on its own: sharing, copies of a hash, LRU order of eviction, reset."""

from __future__ import annotations

import pytest

from vllm_sim.hashing import BlockHash
from vllm_sim.kv_cache import PrefixBlockPool


def blocks(*ids: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ids]


def serve(pool: PrefixBlockPool, hashes: list[BlockHash], anonymous: int = 0) -> None:
    """Allocate with every leading hit reused, then release at once."""
    table = pool.allocate(hashes, pool.leading_hits(hashes), anonymous)
    assert table is not None
    pool.release(table, anonymous)


def test_reused_blocks_are_shared_and_private_blocks_counted_each_time() -> None:
    pool = PrefixBlockPool(10)
    first = pool.allocate(blocks(1, 2, 3), 0, anonymous=2)
    second = pool.allocate(blocks(1, 2), 2, anonymous=1)  # shares 1 and 2
    assert first is not None and second is not None
    assert second == first[:2]
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 6, 4)
    pool.release(first, anonymous=2)
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 3, 6)
    pool.release(second, anonymous=1)
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 0, 7)


def test_leading_hits_stop_at_the_first_missing_block() -> None:
    pool = PrefixBlockPool(10)
    serve(pool, blocks(1, 2, 4))
    assert pool.leading_hits(blocks(1, 2, 3, 4)) == 2
    assert pool.leading_hits(blocks(9, 1, 2)) == 0
    assert pool.leading_hits([]) == 0


def test_a_hash_computed_again_is_cached_as_a_second_copy() -> None:
    # vLLM does not de-duplicate: the recomputed last block of a fully cached prompt (and
    # every block after a hole in the cached prefix) is a new block under the same hash.
    pool = PrefixBlockPool(10)
    serve(pool, blocks(1, 2))
    table = pool.allocate(blocks(1, 2), 1, anonymous=0)  # reuse 1, compute 2 again
    assert table is not None
    assert (pool.copies(BlockHash(1)), pool.copies(BlockHash(2))) == (1, 2)
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 2, 7)
    pool.release(table, anonymous=0)
    # A lookup still finds the hash; each copy is evicted on its own, oldest first.
    pool.removed = []
    assert pool.allocate(blocks(7, 8, 9, 10, 11, 12, 13, 14), 0, anonymous=0) is not None
    assert pool.removed == blocks(2)  # the first copy of 2 (released first: a tail)
    assert pool.copies(BlockHash(2)) == 1
    assert pool.allocate(blocks(15), 0, anonymous=0) is not None
    assert pool.removed == blocks(2, 2)
    assert not pool.contains(BlockHash(2))
    assert pool.contains(BlockHash(1))


def test_eviction_takes_least_recently_released_and_tail_blocks_first() -> None:
    pool = PrefixBlockPool(6)
    serve(pool, blocks(1, 2, 3))  # queued for eviction: 3, 2, 1
    serve(pool, blocks(7))  # queued after them: 3, 2, 1, 7
    assert pool.allocate(blocks(10, 11, 12), 0, anonymous=1) is not None  # 2 free: evict 2
    assert [pool.contains(b) for b in blocks(1, 2, 3, 7)] == [True, False, False, True]


def test_free_blocks_go_before_any_cached_one_is_evicted() -> None:
    # vLLM puts freed blocks without a hash at the front of its free queue, cached ones at
    # the back: a cached block is only evicted when nothing else is left.
    pool = PrefixBlockPool(6)
    pool.removed = []
    serve(pool, blocks(1, 2), anonymous=2)  # 2 cached, 4 free
    assert pool.allocate(blocks(3, 4, 5), 0, anonymous=1) is not None
    assert pool.removed == []
    assert pool.allocate(blocks(6), 0, anonymous=0) is not None
    assert pool.removed == blocks(2)


def test_pinned_blocks_are_never_evicted() -> None:
    pool = PrefixBlockPool(4)
    assert pool.allocate(blocks(1, 2), 0, anonymous=0) is not None
    serve(pool, blocks(3))
    # 1 free + 1 evictable: room for 2, not 3, whatever is pinned.
    assert pool.allocate(blocks(5, 6, 7), 0, anonymous=0) is None
    assert (pool.cached_blocks, pool.pinned_blocks) == (3, 2)  # unchanged by the failure
    assert pool.allocate(blocks(5, 6), 0, anonymous=0) is not None
    assert [pool.contains(b) for b in blocks(1, 2, 3, 5, 6)] == [True, True, False, True, True]


def test_reusing_an_evictable_block_does_not_count_it_as_room() -> None:
    pool = PrefixBlockPool(3)
    serve(pool, blocks(1, 2, 3))
    # Reusing 1 and 2 takes them off the eviction list: only 3 is left for new blocks.
    assert pool.allocate(blocks(1, 2, 4, 5), 2, anonymous=0) is None
    assert pool.allocate(blocks(1, 2, 4), 2, anonymous=1) is None
    assert (pool.cached_blocks, pool.pinned_blocks) == (3, 0)
    assert pool.allocate(blocks(1, 2, 4), 2, anonymous=0) is not None
    assert not pool.contains(BlockHash(3))
    assert pool.pinned_blocks == 3
    # Nothing is evictable any more.
    assert pool.allocate(blocks(5), 0, anonymous=0) is None


def test_output_blocks_are_cached_from_the_anonymous_ones_and_released_tail_first() -> None:
    pool = PrefixBlockPool(8)
    table = pool.allocate(blocks(1), 0, anonymous=3)
    assert table is not None
    pool.cache_anonymous(table, blocks(2, 3))  # the output filled two of its three blocks
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 4, 4)
    with pytest.raises(ValueError):
        pool.cache_anonymous(table, blocks(4, 5))
    pool.release(table, anonymous=1)
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 0, 5)
    assert pool.leading_hits(blocks(1, 2, 3)) == 3
    pool.removed = []
    assert pool.allocate(blocks(9, 10, 11, 12, 13, 14), 0, anonymous=1) is not None
    assert pool.removed == blocks(3, 2)  # the output's tail first, the prompt block last


def test_reset_forgets_all_blocks_and_detaches_held_ones() -> None:
    pool = PrefixBlockPool(8)
    held = pool.allocate(blocks(1, 2), 0, anonymous=1)
    assert held is not None
    held_epoch = pool.epoch
    serve(pool, blocks(3, 4))
    assert pool.reset() == 2
    assert pool.epoch == held_epoch + 1
    assert [pool.contains(b) for b in blocks(1, 2, 3, 4)] == [False] * 4
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (0, 3, 5)
    # The same hashes cached again after the reset are new blocks.
    again = pool.allocate(blocks(1, 2), 0, anonymous=0)
    assert again is not None
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (2, 5, 3)
    pool.release(held, anonymous=1)  # the old copies: freed, not cached
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (2, 2, 6)
    pool.release(again, anonymous=0)
    assert pool.leading_hits(blocks(1, 2)) == 2
    assert pool.pinned_blocks == 0


def test_evictions_are_recorded_when_asked() -> None:
    pool = PrefixBlockPool(3)
    pool.removed = []
    serve(pool, blocks(1, 2, 3))
    assert pool.allocate(blocks(4, 5), 0, anonymous=0) is not None
    assert pool.removed == blocks(3, 2)  # tail first
    pool.reset()
    assert pool.removed == blocks(3, 2)  # a reset is not an eviction


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        PrefixBlockPool(0)


def test_blocks_not_computed_yet_are_reused_only_from_their_ready_time() -> None:
    pool = PrefixBlockPool(20)
    leader = pool.allocate(blocks(1, 2, 3), 0, anonymous=0)
    assert leader is not None
    pool.mark_ready_at(leader[1:], 5.0)  # block 1 is computed now, 2 and 3 at t=5
    assert pool.leading_hits(blocks(1, 2, 3)) == 3  # no time: every cached copy
    assert pool.leading_hits(blocks(1, 2, 3), at=4.0) == 1
    assert pool.leading_hits(blocks(1, 2, 3), at=5.0) == 3
    # A request looking up at t=4 reuses block 1 and stores its own copies of 2 and 3.
    early = pool.allocate(blocks(1, 2, 3), 1, anonymous=0, at=4.0)
    assert early is not None and early[0] == leader[0] and early[1:] != leader[1:]
    assert pool.copies(BlockHash(2)) == 2
    pool.mark_ready_at(early[1:], 6.0)  # computed after the leader's
    with pytest.raises(ValueError, match="computed"):
        pool.allocate(blocks(1, 2), 2, anonymous=0, at=4.0)
    # Once the clock passes t=5 the ready times are forgotten: everything is computed.
    pool.settle(5.0)
    assert pool.leading_hits(blocks(1, 2, 3), at=5.0) == 3
    late = pool.allocate(blocks(1, 2, 3), 3, anonymous=0, at=5.0)
    assert late == leader  # the oldest copies
