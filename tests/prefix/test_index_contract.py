"""PrefixIndex's public contract, case by case: construction and its one-line errors, the
precise-mode calls (store, remove, relearn, copies, open predictions, slices), the capacity
bounds of both modes, and pods that share blocks never losing each other's. Pod names and
hashes are small made-up values; the clock is the test's."""

from __future__ import annotations

import sys
from array import array

import pytest

from epp.config import PrefixConfig
from epp.prefix.hashing import BlockHash, block_hashes, chain_seed
from epp.prefix.index import PrefixIndex


def keys(*values: int) -> list[BlockHash]:
    return [BlockHash(v) for v in values]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def precise(*pods: str, capacity: int = 1000, **kwargs) -> tuple[PrefixIndex, Clock]:
    clock = Clock()
    index = PrefixIndex(capacity, clock=clock, **kwargs)
    for pod in pods:
        index.set_precise(pod, True)
    return index, clock


# -- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_per_pod": 0}, r"^capacity_per_pod must be at least 1$"),
        ({"max_record_fraction": 0.0}, r"^max_record_fraction must be in \(0, 1\]$"),
        ({"max_record_fraction": 1.5}, r"^max_record_fraction must be in \(0, 1\]$"),
        ({"predicted_ttl_s": 0.0}, r"^predicted_ttl_s must be > 0$"),
        ({"predicted_ttl_s": 5.0, "predicted_max_s": 4.9}, r"^predicted_max_s must be >= pre"),
    ],
)
def test_bad_settings_are_refused_in_one_line_naming_the_setting(kwargs, message):
    kwargs = {"capacity_per_pod": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        PrefixIndex(**kwargs)


def test_the_boundary_settings_are_accepted():
    index = PrefixIndex(1, max_record_fraction=1.0, predicted_ttl_s=3.0, predicted_max_s=3.0)
    index.record("a", keys(1, 2))
    assert index.match(keys(1, 2)) == {"a": 1}  # one block of capacity, all of it per record


def test_from_config_carries_the_record_fraction_and_the_prediction_times():
    config = PrefixConfig(capacity_per_pod=100, max_record_fraction=1.0)
    index = PrefixIndex.from_config(config, predicted_ttl_s=5.0, predicted_max_s=50.0)
    assert index.record_limit("a") == 100
    assert (index.predicted_ttl_s, index.predicted_max_s) == (5.0, 50.0)
    index.record("a", keys(*range(1, 101)))
    assert index.match(keys(*range(1, 101))) == {"a": 100}


def test_every_block_of_a_record_is_kept_whichever_the_pod_holds_already():
    index = PrefixIndex(100)
    index.record("a", keys(1))
    index.record("a", keys(1))  # held and marked
    index.record("b", keys(2))
    index.record("a", keys(2))  # shared with b
    index.record("a", keys(7, 8, 2))
    index.record("a", keys(9, 1))
    assert index.match(keys(7, 8, 2)) == {"a": 3}
    assert index.match(keys(9, 1)) == {"a": 2}
    assert index.blocks("a") == 5


def test_switching_a_pod_to_the_mode_it_has_keeps_its_blocks():
    index = PrefixIndex(100)
    index.record("a", keys(1, 2))
    index.set_precise("a", False)
    assert index.match(keys(1, 2)) == {"a": 2}
    index.set_precise("b", False)  # an unknown pod stays unknown
    assert index.pods() == ["a"]
    index.set_precise("a", True)
    index.store_engine_blocks("a", [10], keys(1), 1)
    index.set_precise("a", True)
    assert index.match(keys(1, 2)) == {"a": 1} and index.is_precise("a")
    # Back to approximate: no engine blocks left to list.
    index.set_precise("a", False)
    count, slices = index.engine_block_slices("a")
    assert (count, list(slices), index.engine_blocks("a")) == (0, [], [])


# -- unknown and approximate pods answer the precise calls with nothing ----------------------


def test_precise_calls_on_an_unknown_or_approximate_pod_do_nothing():
    index = PrefixIndex(100)
    index.record("approx", keys(1, 2))
    for pod in ("nobody", "approx"):
        assert index.engine_block(pod, 1) is None
        assert index.engine_blocks(pod) == []
        count, slices = index.engine_block_slices(pod)
        assert count == 0 and list(slices) == []
        assert index.store_engine_blocks(pod, [7], keys(3), 1) is False
        assert index.remove_engine_blocks(pod, [7]) == 0
        assert index.relearn_engine_block(pod, 7, keys(3)) is False
        assert list(index.open_predictions(pod)) == []
        assert index.reported(pod, BlockHash(1)) is False
    assert index.match(keys(3)) == {}
    assert index.match(keys(1, 2)) == {"approx": 2}


# -- precise pods: engine blocks --------------------------------------------------------------


def test_engine_block_slices_list_every_engine_block_once():
    index, _ = precise("a")
    engine = list(range(1, 301))
    index.store_engine_blocks("a", engine, keys(*(h + 1000 for h in engine)), 1)
    index.store_engine_blocks("a", [2**70], keys(5000), 1)  # outside 64 bits: kept aside
    count, slices = index.engine_block_slices("a")
    seen = [h for part in slices for h in part]
    assert count == 301 and sorted(seen) == [*engine, 2**70]
    assert sorted(index.engine_blocks("a")) == sorted(seen)


def test_a_store_mixing_known_and_new_keys_keeps_every_engine_block():
    index, _ = precise("a")
    index.store_engine_blocks("a", [10], keys(1), 1)
    # The engine stores block 11 under a key the pod holds already (another engine hash for
    # the same prefix), and 12 under a new key: both are held.
    assert index.store_engine_blocks("a", [11, 12], keys(1, 2), 1)
    assert sorted(index.engine_blocks("a")) == [10, 11, 12]
    assert (index.engine_block("a", 11), index.engine_block("a", 12)) == (1, 2)
    assert index.match(keys(1, 2)) == {"a": 2}
    # Each engine block's removal is recognised.
    assert index.remove_engine_blocks("a", [12]) == 1
    assert index.match(keys(1, 2)) == {"a": 1}
    assert index.remove_engine_blocks("a", [10, 11]) == 2
    assert index.match(keys(1)) == {}
    assert index.nodes == 0 and index.engine_blocks("a") == []


def test_an_engine_block_of_several_of_ours_holds_its_own_keys():
    index, _ = precise("a", "b")
    index.record("c", keys(1, 2, 3, 4))  # an approximate pod shares the prefix
    index.set_precise("c", False)
    assert index.store_engine_blocks("a", [100, 200], keys(1, 2, 3, 4), 2)
    assert index.engine_block("a", 100) == (1, 2)
    assert index.engine_block("a", 200) == (3, 4)
    assert index.match(keys(1, 2, 3, 4)) == {"a": 4, "c": 4}
    # The same engine block again (a copy), then a new one after it: the new one is kept.
    assert index.store_engine_blocks("a", [100, 300], keys(1, 2, 5, 6), 2)
    assert index.match(keys(1, 2, 5, 6)) == {"a": 4, "c": 2}
    assert index.remove_engine_blocks("a", [200]) == 1
    assert index.match(keys(1, 2, 3, 4)) == {"a": 2, "c": 4}


def test_a_block_the_engine_stored_four_times_goes_with_its_fourth_removal():
    index, _ = precise("a")
    for _ in range(4):
        index.store_engine_blocks("a", [10], keys(1), 1)
    index.store_engine_blocks("a", [20, 30], keys(2, 3), 1)
    # Other blocks of the pod go at once, all of them, while copies are being tracked.
    assert index.remove_engine_blocks("a", [20, 30]) == 2
    assert index.match(keys(2)) == {} and index.match(keys(3)) == {}
    for left in (3, 2, 1):
        assert index.remove_engine_blocks("a", [10]) == 1
        assert index.match(keys(1)) == {"a": 1}, left
    assert index.remove_engine_blocks("a", [10]) == 1
    assert index.match(keys(1)) == {}
    assert index.engine_blocks("a") == []
    assert index.remove_engine_blocks("a", [10]) == 0


def test_removing_a_precise_pods_block_keeps_the_other_pods_holding_its_key():
    index, _ = precise("a")
    index.record("b", keys(1, 2))
    index.record("c", keys(9))  # a third pod, holding none of them
    index.store_engine_blocks("a", [10, 20], keys(1, 2), 1)
    assert index.match(keys(1, 2)) == {"a": 2, "b": 2}
    assert index.remove_engine_blocks("a", [10, 20]) == 2
    assert index.match(keys(1, 2)) == {"b": 2}


def test_two_engine_blocks_under_one_key_are_both_removed_cleanly():
    index, _ = precise("a")
    index.store_engine_blocks("a", [10], keys(1), 1)
    index.store_engine_blocks("a", [11], keys(1), 1)
    assert index.remove_engine_blocks("a", [10, 11]) == 2
    assert index.match(keys(1)) == {} and index.nodes == 0


@pytest.mark.parametrize("first", [10, 11])
def test_a_key_two_engine_blocks_carry_is_held_until_the_last_of_them_goes(first):
    index, _ = precise("a")
    index.store_engine_blocks("a", [10], keys(1), 1)
    index.store_engine_blocks("a", [11], keys(1), 1)
    assert index.remove_engine_blocks("a", [first]) == 1
    assert index.match(keys(1)) == {"a": 1}
    assert index.reported("a", BlockHash(1))
    assert index.remove_engine_blocks("a", [21 - first]) == 1
    assert index.match(keys(1)) == {} and index.nodes == 0


def test_a_key_shared_by_engine_blocks_of_several_keys_is_held_until_the_last_goes():
    index, _ = precise("a")
    index.store_engine_blocks("a", [10, 11], keys(1, 2, 1, 3), 2)  # key 1 in both
    index.store_engine_blocks("a", [12, 13], keys(1, 1), 1)  # and in two more, in one call
    assert index.remove_engine_blocks("a", [10, 12]) == 2
    assert index.match(keys(1)) == {"a": 1}
    assert index.remove_engine_blocks("a", [11]) == 1
    assert index.match(keys(1)) == {"a": 1}  # engine block 13 still carries it
    assert index.remove_engine_blocks("a", [13]) == 1
    assert index.match(keys(1)) == {}


def test_a_copy_of_one_engine_block_is_not_a_second_carrier_of_its_key():
    index, _ = precise("a")
    index.store_engine_blocks("a", [10], keys(1), 1)
    index.store_engine_blocks("a", [10], keys(1), 1)  # the same block again: a copy
    index.store_engine_blocks("a", [11], keys(1), 1)
    assert index.remove_engine_blocks("a", [10, 10]) == 2
    assert index.match(keys(1)) == {"a": 1}
    assert index.remove_engine_blocks("a", [11]) == 1
    assert index.match(keys(1)) == {} and index.nodes == 0


def test_clearing_a_pod_forgets_which_keys_several_engine_blocks_carried():
    index, _ = precise("a")
    index.store_engine_blocks("a", [10, 11], keys(1, 1), 1)
    index.clear_pod("a")
    index.store_engine_blocks("a", [12], keys(1), 1)
    assert index.remove_engine_blocks("a", [12]) == 1
    assert index.match(keys(1)) == {} and index.nodes == 0


def test_reported_is_this_pods_engine_word_only():
    index, _ = precise("a", "b")
    index.store_engine_blocks("b", [10], keys(1), 1)
    index.record("a", keys(2))  # predicted, not reported
    assert index.reported("b", BlockHash(1))
    assert not index.reported("a", BlockHash(1))  # another pod's block
    assert not index.reported("a", BlockHash(2))
    assert not index.reported("a", BlockHash(3))


# -- relearning a block the engine holds out of sight -----------------------------------------


def test_a_relearnt_engine_block_holds_the_prefix_keys_its_events_had_not_reported():
    index, _ = precise("a")
    index.store_engine_blocks("a", [10], keys(1), 1)  # reported
    index.record("a", keys(1, 2), token="r1")  # 2 predicted
    assert index.relearn_engine_block("a", 99, keys(1, 2, 3, 4))
    assert index.engine_block("a", 99) == (2, 3, 4)  # not 1: its own engine block has it
    assert all(index.reported("a", k) for k in keys(1, 2, 3, 4))
    assert index.match(keys(1, 2, 3, 4)) == {"a": 4}
    # Known with keys: nothing to relearn.
    assert not index.relearn_engine_block("a", 99, keys(7))
    assert not index.relearn_engine_block("a", 10, keys(7))
    assert not index.relearn_engine_block("a", 98, [])
    # Its removal drops what it holds; the block reported on its own stays.
    assert index.remove_engine_blocks("a", [99]) == 1
    assert index.match(keys(1, 2, 3, 4)) == {"a": 1}


def test_a_block_stored_with_unknown_keys_is_relearnt_in_place():
    index, _ = precise("a")
    index.store_engine_blocks("a", [50], [], 1)  # a child of a parent we never saw
    assert index.engine_block("a", 50) == ()
    assert index.match(keys(5)) == {}
    assert index.relearn_engine_block("a", 50, keys(5))
    assert index.engine_blocks("a") == [50]
    assert index.engine_block("a", 50) == 5
    assert index.match(keys(5)) == {"a": 1}
    assert index.remove_engine_blocks("a", [50]) == 1
    assert index.match(keys(5)) == {} and index.blocks("a") == 0


# -- predictions -----------------------------------------------------------------------------


def test_open_predictions_are_the_pods_own():
    index, _ = precise("a", "b")
    index.record("a", keys(1, 2), token="ra")
    index.record("b", keys(3), token="rb")
    index.record("a", keys(4))  # no token: in its TTL
    index.record("b", keys(5))
    assert list(index.open_predictions("a")) == [keys(1, 2), keys(4)]
    assert list(index.open_predictions("b")) == [keys(3), keys(5)]


def test_a_block_another_pod_holds_is_still_predicted_for_this_one():
    index, clock = precise("a")
    index.record("b", keys(1, 2))  # approximate pod b holds the prefix
    index.record("a", keys(1, 2), token="r1")
    assert index.match(keys(1, 2)) == {"a": 2, "b": 2}
    assert list(index.open_predictions("a")) == [keys(1, 2)]
    index.completed("r1", 0.0)
    clock.now = 10.0
    assert index.match(keys(1, 2)) == {"b": 2}


def test_a_routed_hit_on_reported_blocks_never_takes_them_from_other_pods():
    index, _ = precise("a", capacity=64)
    index.record("b", keys(1, 2))
    index.store_engine_blocks("a", [10, 20], keys(1, 2), 1)
    index.record("a", keys(1, 2), token="hit")  # marks them used for a's bound
    assert index.match(keys(1, 2)) == {"a": 2, "b": 2}
    # a's capacity bound turns over every block: b keeps its own throughout.
    for n in range(300):
        index.store_engine_blocks("a", [1000 + n], keys(5000 + n), 1)
    assert index.match(keys(1, 2)).get("b") == 2


def test_a_token_recorded_twice_ends_its_first_prediction():
    index, clock = precise("a", predicted_ttl_s=2.0, predicted_max_s=100.0)
    index.record("a", keys(1), token="t", now=0.0)
    index.record("a", keys(2), token="t", now=1.0)  # the first one ended at 1.0
    clock.now = 3.0
    assert index.match(keys(1)) == {}
    assert index.match(keys(2)) == {"a": 1}
    index.completed("t", 3.0)
    clock.now = 5.0
    assert index.match(keys(2)) == {}


def test_a_block_predicted_by_three_requests_lives_until_the_last_one_ends():
    index, clock = precise("a")
    for token in ("r1", "r2", "r3"):
        index.record("a", keys(1, 2), token=token)
    index.completed("r1", 0.0)
    index.completed("r2", 0.0)
    clock.now = 10.0
    assert index.match(keys(1, 2)) == {"a": 2}
    index.completed("r3", 10.0)
    clock.now = 20.0
    assert index.match(keys(1, 2)) == {}


def test_expire_counts_the_entries_it_dropped_and_each_capped_prediction():
    index, _ = precise("a", predicted_ttl_s=1.0, predicted_max_s=10.0)
    index.record("a", keys(1, 2), now=0.0)  # TTL: released at 1
    index.record("a", keys(3), now=0.0)
    index.record("a", keys(4, 5), token="lost1", now=0.0)  # capped at 10
    index.record("a", keys(6), token="lost2", now=0.0)
    assert index.expire(1.0) == 3
    assert index.expire(10.0) == 3
    assert index.predictions_capped == 2
    assert index.blocks("a") == 0


def test_completions_past_the_cap_leave_the_entries_to_the_cap():
    index, clock = precise("a", capacity=100_000, predicted_ttl_s=1.0, predicted_max_s=1.0)
    for n in range(1100):
        index.record("a", keys(n), token=f"r{n}", now=0.0)
    for n in range(1100):
        index.completed(f"r{n}", 0.5)  # 0.5 + TTL is past the cap at 1.0
    clock.now = 0.99
    assert index.match(keys(0)) == {"a": 1} and index.predictions == 0
    clock.now = 1.0
    assert index.match(keys(1099)) == {} and index.blocks("a") == 0
    assert index.predictions_capped == 0


def test_a_lost_completion_is_still_capped_after_the_in_flight_queue_is_compacted():
    index, clock = precise("a", capacity=100_000, predicted_ttl_s=1.0, predicted_max_s=3600.0)
    index.record("a", keys(1), token="lost", now=0.0)
    # Many short requests, each completed: their released entries are compacted away.
    for n in range(3000):
        clock.now = n * 0.01
        index.record("a", keys(10_000 + n), token=f"r{n}")
        index.completed(f"r{n}", clock.now)
        assert index.match(keys(1)) == {"a": 1}
    clock.now = 3599.0
    assert index.match(keys(1)) == {"a": 1}
    clock.now = 3600.0
    assert index.match(keys(1)) == {}
    assert index.predictions_capped == 1


def test_predicted_entries_beyond_the_capacity_drop_the_oldest():
    index, _ = precise("a", capacity=5, max_record_fraction=1.0)
    index.record("a", keys(1, 2, 3), token="r1")
    index.record("a", keys(4, 5, 6), token="r2")
    assert index.blocks("a") == 5
    assert index.match(keys(1, 2, 3)) == {}
    assert index.match(keys(2, 3)) == {"a": 2}
    assert index.match(keys(4, 5, 6)) == {"a": 3}


# -- capacity bounds -------------------------------------------------------------------------


def test_a_smaller_capacity_bounds_a_precise_pods_engine_blocks_and_predictions():
    index, _ = precise("a", capacity=1000)
    index.store_engine_blocks("a", list(range(1, 201)), keys(*range(1001, 1201)), 1)
    index.record("a", keys(*range(5001, 5101)), token="r1")
    assert index.blocks("a") == 300
    index.set_capacity("a", 64)
    assert len(index.engine_blocks("a")) <= 64
    assert index.blocks("a") <= 128  # engine blocks and predictions, each within 64
    assert index.match(keys(*range(5001, 5101))) == {}  # the oldest predictions went


def test_a_precise_pods_engine_map_shrinks_with_its_capacity():
    index, _ = precise("a", "b", capacity=100_000)
    index.store_engine_blocks("a", list(range(1, 65)), keys(*range(101, 165)), 1)
    index.store_engine_blocks("b", list(range(1, 65)), keys(*range(101, 165)), 1)
    index.set_capacity("b", 64)  # b reports a small KV cache: its map is sized for it
    assert index.match(keys(*range(101, 165))) == {"a": 64, "b": 64}
    small, large = index._pods["b"].engine, index._pods["a"].engine
    assert small is not None and large is not None
    assert small.nbytes() * 10 < large.nbytes()


def test_the_engine_bound_drops_the_excess_and_a_slack_of_a_32nd():
    index, _ = precise("a", capacity=64)
    index.store_engine_blocks("a", list(range(1, 65)), keys(*range(101, 165)), 1)
    index.set_capacity("a", 64)  # at the bound, not over it: nothing goes
    assert len(index.engine_blocks("a")) == 64 and index.precise_capacity_evictions == 0
    index.store_engine_blocks("a", [65], keys(165), 1)  # one over: it and 2 more go
    assert len(index.engine_blocks("a")) == 62
    assert index.precise_capacity_evictions == 3
    index.store_engine_blocks("a", list(range(66, 166)), keys(*range(166, 266)), 1)
    assert len(index.engine_blocks("a")) == 62
    assert index.precise_capacity_evictions == 3 + 100


@pytest.mark.parametrize("per_block", [1, 2])
def test_a_hit_engine_block_outlives_cold_ones_through_the_bound(per_block):
    index, clock = precise("a", capacity=64)
    hot = keys(1, 2)
    index.record("b", hot)  # another pod shares it: its bits are never touched
    index.store_engine_blocks("a", [10, 20][: 2 // per_block], hot, per_block)
    for n in range(400):
        clock.now = float(n)
        index.record("a", hot, token=f"r{n}")  # a routed hit each time
        index.completed(f"r{n}", clock.now)
        new = keys(1000 + 2 * n, 1001 + 2 * n)
        index.store_engine_blocks(
            "a", [5000 + 2 * n, 5001 + 2 * n][: 2 // per_block], new, per_block
        )
    clock.now = 1000.0  # no prediction left: the engine's word only
    assert index.match(hot) == {"a": 2, "b": 2}
    assert index.reported("a", BlockHash(1)) and index.reported("a", BlockHash(2))
    assert index.precise_capacity_evictions > 300


def test_a_hit_on_the_first_key_of_an_engine_block_keeps_the_whole_block():
    # An engine block of two of our keys; every request shares only its first key (a hit
    # on part of the block is still a use of it).
    index, clock = precise("a", capacity=64)
    index.store_engine_blocks("a", [10], keys(1, 2), 2)
    for n in range(400):
        clock.now = float(n)
        index.record("a", [BlockHash(1), BlockHash(50_000 + n)], token=f"r{n}")
        index.completed(f"r{n}", clock.now)
        new = keys(1000 + 2 * n, 1001 + 2 * n)
        index.store_engine_blocks("a", [5000 + n], new, 2)
    clock.now = 1000.0
    assert index.engine_block("a", 10) == (1, 2)
    assert index.match(keys(1, 2)) == {"a": 2}
    assert index.precise_capacity_evictions > 300


@pytest.mark.parametrize("per_block", [1, 2])
def test_a_cold_engine_block_goes_at_its_turn(per_block):
    index, _ = precise("a", capacity=64)
    index.store_engine_blocks("a", [10, 20][: 2 // per_block], keys(1, 2), per_block)
    index.record("a", keys(1, 2), token="once")  # one hit, then never again
    for n in range(400):
        new = keys(1000 + 2 * n, 1001 + 2 * n)
        index.store_engine_blocks(
            "a", [5000 + 2 * n, 5001 + 2 * n][: 2 // per_block], new, per_block
        )
    assert index.match(keys(1, 2)) == {}


@pytest.mark.parametrize("per_block", [1, 2])
def test_blocks_a_decision_only_passed_through_after_a_miss_are_not_kept_as_hits(per_block):
    # Every request starts with a block the pod lacks: a miss from its first block, so the
    # pod's blocks later in the prompt are not reused and get no second chance.
    index, _ = precise("a", capacity=64)
    index.store_engine_blocks("a", [10, 20][: 2 // per_block], keys(1, 2), per_block)
    for n in range(400):
        index.record("a", [BlockHash(90_000 + n), *keys(1, 2)], token=f"r{n}")
        index.completed(f"r{n}", 0.0)
        new = keys(1000 + 2 * n, 1001 + 2 * n)
        engine = [5000 + 2 * n, 5001 + 2 * n][: 2 // per_block]
        index.store_engine_blocks("a", engine, new, per_block)
    assert index.engine_block("a", 10) is None
    assert index.reported("a", BlockHash(1)) is False


# -- memory: what churns is given back (docs/benchmarks/index.md; internals read here) -------


def test_a_churned_predicted_table_is_right_sized_again():
    index, clock = precise("a", capacity=1_000_000, predicted_ttl_s=2.0)
    for n in range(90):  # 90,000 predicted entries released at 2.0
        index.record("a", keys(*range(n * 1000, (n + 1) * 1000)), now=0.0)
    for n in range(90, 100):  # 10,000 that stay until 3.0
        index.record("a", keys(*range(n * 1000, (n + 1) * 1000)), now=1.0)
    assert index.expire(2.0) == 90_000
    assert index.blocks("a") == 10_000
    table = index._pods["a"].predicted
    # Not the table of 100,000 it was (about 16 times more): within a resize or two of fresh.
    assert sys.getsizeof(table) <= 4 * sys.getsizeof(dict(table))
    clock.now = 2.5
    assert index.match(keys(*range(90_000, 91_000))) == {"a": 1000}


def test_releasing_every_prediction_after_heavy_churn_leaves_an_empty_table():
    index, _ = precise("a", capacity=100_000, predicted_ttl_s=1.0)
    for n in range(5):
        index.record("a", keys(*range(n * 1000, (n + 1) * 1000)), now=0.0)
    assert index.expire(1.0) == 5000
    assert index.blocks("a") == 0 and index.nodes == 0
    index.record("a", keys(1, 2), now=1.0)
    assert index.match(keys(1, 2)) == {"a": 2}


def test_an_approximate_pods_queue_holds_real_hashes_in_8_bytes_each():
    index = PrefixIndex(1000)
    hashes = block_hashes(array("I", range(16 * 64)), 16, chain_seed("m"))
    assert max(hashes) >= 2**63  # xxh64 digests use the whole unsigned range
    index.record("a", hashes)
    log = index._pods["a"].log
    assert isinstance(log, array) and log.itemsize == 8
    assert index.match(hashes) == {"a": 64}


def test_an_approximate_pods_queue_stays_bounded_over_many_turns():
    index = PrefixIndex(10, max_record_fraction=1.0)
    for n in range(100_000):
        index.record("a", keys(n))
    assert index.blocks("a") == 10
    assert len(index._pods["a"].log) <= 2 * 1024 + 10
    assert index.match(keys(99_999)) == {"a": 1} and index.match(keys(99_989)) == {}
