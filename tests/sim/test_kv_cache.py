"""The block pool on its own: pinning, sharing, LRU order of eviction, reset."""

from __future__ import annotations

import pytest

from epp.prefix.hashing import BlockHash
from epp.sim.kv_cache import PrefixBlockPool


def blocks(*ids: int) -> list[BlockHash]:
    return [BlockHash(i) for i in ids]


def test_pin_counts_shared_blocks_once_and_private_blocks_each_time() -> None:
    pool = PrefixBlockPool(10)
    assert pool.try_pin(blocks(1, 2, 3), anonymous=2)
    assert pool.try_pin(blocks(1, 2), anonymous=1)  # shares 1 and 2
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 6, 4)
    pool.unpin(blocks(1, 2, 3), anonymous=2)
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 3, 6)
    pool.unpin(blocks(1, 2), anonymous=1)
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (3, 0, 7)


def test_leading_hits_stop_at_the_first_missing_block() -> None:
    pool = PrefixBlockPool(10)
    pool.try_pin(blocks(1, 2, 4), anonymous=0)
    assert pool.leading_hits(blocks(1, 2, 3, 4)) == 2
    assert pool.leading_hits(blocks(9, 1, 2)) == 0
    assert pool.leading_hits([]) == 0


def test_eviction_takes_least_recently_released_and_tail_blocks_first() -> None:
    pool = PrefixBlockPool(6)
    pool.try_pin(blocks(1, 2, 3), anonymous=0)
    pool.unpin(blocks(1, 2, 3), anonymous=0)  # queued for eviction: 3, 2, 1
    pool.try_pin(blocks(7), anonymous=0)
    pool.unpin(blocks(7), anonymous=0)  # queued after them: 3, 2, 1, 7
    assert pool.try_pin(blocks(10, 11, 12), anonymous=1)  # 2 free, must evict 2
    assert [pool.contains(b) for b in blocks(1, 2, 3, 7)] == [True, False, False, True]


def test_pinned_blocks_are_never_evicted() -> None:
    pool = PrefixBlockPool(4)
    assert pool.try_pin(blocks(1, 2), anonymous=0)
    pool.try_pin(blocks(3), anonymous=0)
    pool.unpin(blocks(3), anonymous=0)
    # 1 free + 1 evictable: room for 2, not 3, whatever is pinned.
    assert not pool.try_pin(blocks(5, 6, 7), anonymous=0)
    assert (pool.cached_blocks, pool.pinned_blocks) == (3, 2)  # unchanged by the failure
    assert pool.try_pin(blocks(5, 6), anonymous=0)
    assert [pool.contains(b) for b in blocks(1, 2, 3, 5, 6)] == [True, True, False, True, True]


def test_reusing_an_evictable_block_does_not_count_it_as_room() -> None:
    pool = PrefixBlockPool(3)
    pool.try_pin(blocks(1, 2, 3), anonymous=0)
    pool.unpin(blocks(1, 2, 3), anonymous=0)
    # Reusing 1 and 2 takes them off the eviction list: only 3 is left for new blocks.
    assert not pool.try_pin(blocks(1, 2, 4, 5), anonymous=0)
    assert not pool.try_pin(blocks(1, 2, 4), anonymous=1)
    assert pool.cached_blocks == 3
    assert pool.pinned_blocks == 0
    assert pool.try_pin(blocks(1, 2, 4), anonymous=0)
    assert not pool.contains(BlockHash(3))
    assert pool.pinned_blocks == 3
    # Nothing is evictable any more.
    assert not pool.try_pin(blocks(5), anonymous=0)


def test_a_hash_repeated_in_one_request_is_pinned_and_released_symmetrically() -> None:
    pool = PrefixBlockPool(4)
    assert pool.try_pin(blocks(1, 1), anonymous=0)
    assert pool.cached_blocks == 1
    pool.unpin(blocks(1, 1), anonymous=0)
    assert pool.pinned_blocks == 0
    assert pool.try_pin(blocks(2, 3, 4, 5), anonymous=0)  # block 1 was evictable again


def test_reset_forgets_all_blocks_and_detaches_held_ones() -> None:
    pool = PrefixBlockPool(8)
    pool.try_pin(blocks(1, 2), anonymous=1)
    held_epoch = pool.epoch
    pool.try_pin(blocks(3, 4), anonymous=0)
    pool.unpin(blocks(3, 4), anonymous=0)
    assert pool.reset() == 2
    assert pool.epoch == held_epoch + 1
    assert [pool.contains(b) for b in blocks(1, 2, 3, 4)] == [False] * 4
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (0, 3, 5)
    # The same hashes cached again after the reset are new blocks.
    assert pool.try_pin(blocks(1, 2), anonymous=0)
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (2, 5, 3)
    pool.unpin(blocks(1, 2), anonymous=1, epoch=held_epoch)  # the old copy: freed
    assert (pool.cached_blocks, pool.pinned_blocks, pool.free_blocks) == (2, 2, 6)
    pool.unpin(blocks(1, 2), anonymous=0)
    assert pool.leading_hits(blocks(1, 2)) == 2
    assert pool.pinned_blocks == 0


def test_evictions_are_recorded_when_asked() -> None:
    pool = PrefixBlockPool(3)
    pool.removed = []
    pool.try_pin(blocks(1, 2, 3), anonymous=0)
    pool.unpin(blocks(1, 2, 3), anonymous=0)
    pool.try_pin(blocks(4, 5), anonymous=0)
    assert pool.removed == blocks(3, 2)  # tail first
    pool.reset()
    assert pool.removed == blocks(3, 2)  # a reset is not an eviction


def test_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        PrefixBlockPool(0)
