from __future__ import annotations

import pytest

from epp.prefix.index import PrefixIndex


def test_match_counts_leading_blocks_without_gap():
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3, 4])
    index.record("b", [1, 2])
    index.record("c", [9, 2, 3])
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.match([7, 1, 2]) == {}
    assert index.match([]) == {}


def test_pod_that_drops_out_keeps_its_depth_and_others_continue():
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2, 3, 4, 5])
    assert index.match([1, 2, 3, 4, 5, 6]) == {"a": 3, "b": 5}


def test_lru_evicts_tail_first_and_respects_capacity():
    index = PrefixIndex(4, max_record_fraction=1.0)
    index.record("a", [1, 2, 3, 4])
    index.record("a", [10, 11])  # needs two slots: the oldest are the tail of the first prefix
    assert index.blocks("a") == 4
    assert index.match([1, 2, 3, 4]) == {"a": 2}
    assert index.match([10, 11]) == {"a": 2}


def test_recording_again_refreshes_recency():
    index = PrefixIndex(4, max_record_fraction=1.0)
    index.record("a", [1, 2])
    index.record("a", [5, 6])
    index.record("a", [1, 2])  # 1,2 most recent again
    index.record("a", [7, 8])  # evicts 5,6
    assert index.match([1, 2]) == {"a": 2}
    assert index.match([5, 6]) == {}


def test_capacity_from_pod_and_removal():
    index = PrefixIndex(100)
    index.record("a", list(range(10)))
    index.record("b", list(range(10)))
    index.set_capacity("a", 3)
    assert index.blocks("a") == 3 and index.capacity("a") == 3
    index.set_capacity("b", 10_000)  # never above the configured bound
    assert index.capacity("b") == 100
    index.remove_pod("b")
    assert index.match(list(range(10))) == {"a": 3}
    assert index.nodes == 3
    index.clear_pod("a")
    assert index.nodes == 0 and index.capacity("a") == 3


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(0)
