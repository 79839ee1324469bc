"""EngineMap: a precise pod's engine hash -> key(s), packed as 16-byte records."""

from __future__ import annotations

import random

from epp.prefix.engine_map import EngineMap
from epp.prefix.hashing import BlockHash


def test_add_get_pop_and_the_hashes_held():
    rng = random.Random(1)
    pairs = {rng.getrandbits(64): BlockHash(rng.getrandbits(64)) for _ in range(5000)}
    engine = EngineMap(1000)
    for h, key in pairs.items():
        assert engine.add(h, key)
    assert len(engine) == 5000
    assert sorted(engine.hashes()) == sorted(pairs)
    assert all(engine.get(h) == key for h, key in pairs.items())
    assert sorted(engine.values()) == sorted(pairs.values())
    gone = list(pairs)[:2500]
    assert engine.pop_many([*gone, 12345]) == [pairs[h] for h in gone]
    assert len(engine) == 2500
    assert engine.get(gone[0]) is None and engine.pop(gone[0]) is None
    assert sorted(engine.hashes()) == sorted(list(pairs)[2500:])


def test_the_same_block_again_is_a_copy_not_a_second_record():
    engine = EngineMap(100)
    assert engine.add(7, BlockHash(70))
    assert not engine.add(7, BlockHash(70))
    assert len(engine) == 1


def test_a_key_or_two_records_joined_never_pass_for_a_hash():
    engine = EngineMap(32)  # one bucket: every record side by side
    assert engine.add(1, BlockHash(0x11223344_55667788))
    assert engine.add(0xAABBCCDD, BlockHash(2))
    # A key's bytes are not a hash held...
    assert engine.get(0x11223344_55667788) is None
    # ...nor are the last half of one record's key and the first half of the next hash.
    straddle = 0xAABBCCDD_11223344
    assert engine.get(straddle) is None and engine.pop(straddle) is None
    assert engine.add(straddle, BlockHash(3))
    assert engine.get(straddle) == 3
    assert engine.pop(0x11223344_55667788) is None
    assert engine.pop(1) == 0x11223344_55667788
    assert sorted(engine.hashes()) == sorted([0xAABBCCDD, straddle])


def test_what_a_record_cannot_hold_is_kept_aside():
    engine = EngineMap(100)
    groups = {
        -5: BlockHash(1),  # a signed engine hash
        2**64 + 3: BlockHash(2),  # too wide
        9: (BlockHash(3), BlockHash(4)),  # an engine block of two of ours
        10: (),  # keys unknown
        11: BlockHash(-1),  # a key a record cannot hold
    }
    for h, keys in groups.items():
        assert engine.add(h, keys)
        assert not engine.add(h, keys)
    assert all(engine.get(h) == keys for h, keys in groups.items())
    assert sorted(engine.hashes()) == sorted(groups)
    assert engine.pop(9) == (3, 4)
    assert engine.pop_many([-5, 2**64 + 3, 10, 11]) == [1, 2, (), -1]
    assert len(engine) == 0


def test_the_capacity_bound_takes_the_oldest_of_each_bucket_in_turn():
    engine = EngineMap(64)  # two buckets: even and odd hashes
    for h in range(1, 11):
        engine.add(h, BlockHash(100 + h))
    engine.add(-1, BlockHash(99))  # aside: goes first
    assert sorted(engine.pop_oldest(3)) == [99, 101, 102]  # then 2 (even), 1 (odd)
    assert sorted(engine.pop_oldest(2)) == [103, 104]
    assert len(engine) == 6


def test_resizing_keeps_every_block():
    rng = random.Random(2)
    pairs = {rng.getrandbits(64): BlockHash(rng.getrandbits(64)) for _ in range(3000)}
    engine = EngineMap(32)
    for h, key in pairs.items():
        engine.add(h, key)
    engine.resize(100_000)
    assert len(engine) == 3000
    assert all(engine.get(h) == key for h, key in pairs.items())
    engine.resize(10)
    assert sorted(engine.hashes()) == sorted(pairs)


def test_a_full_map_costs_under_24_bytes_a_block():
    rng = random.Random(3)
    n = 31_250
    engine = EngineMap(n)
    engine.add_new(
        [rng.getrandbits(64) for _ in range(n)], [BlockHash(rng.getrandbits(64)) for _ in range(n)]
    )
    assert len(engine) == n
    # A dict of int -> int costs ~78 bytes a block here (slot + the hash's int object).
    assert engine.nbytes() / n < 24


def test_a_used_block_gets_a_second_chance_and_a_cold_one_goes():
    """CLOCK: `used` (the index's mark, cleared when read) sends a block to the back of
    its bucket once; without use since, it goes at its next turn."""
    engine = EngineMap(32)  # one bucket: the oldest first
    for h in range(1, 6):
        engine.add(h, BlockHash(100 + h))
    engine.add(9, (BlockHash(7), BlockHash(8)))  # aside (two keys): second chance too
    marks = {101, 8}

    def used(keys: object) -> bool:
        hit = bool(marks & ({keys} if isinstance(keys, int) else set(keys)))  # type: ignore[arg-type]
        marks.difference_update({keys} if isinstance(keys, int) else set(keys))  # type: ignore[arg-type]
        return hit

    assert engine.pop_oldest(2, used) == [102, 103]  # 9 (aside) and 101 were used
    assert engine.pop_oldest(1, used) == [(7, 8)]  # its mark was spent: its turn now
    assert engine.pop_oldest(3, used) == [104, 105, 101]
    assert len(engine) == 0
    # Everything used: one turn clears the marks, then the oldest goes (it terminates).
    for h in range(1, 4):
        engine.add(h, BlockHash(100 + h))
    marks = {101, 102, 103}
    assert engine.pop_oldest(1, used) == [101]
