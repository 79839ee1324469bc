"""The max-score picker on its own: the best total wins, ties within the epsilon are broken
by the tiebreak key (lower wins) and then at random, fallbacks follow by score."""

from __future__ import annotations

import random

from epp.scheduling.picker import MaxScorePicker


def primaries(picker: MaxScorePicker, totals, tiebreak=None, runs: int = 200) -> set[int]:
    return {picker.pick(totals, 1, tiebreak)[0] for _ in range(runs)}


def test_the_highest_total_wins_whatever_its_position(kernels_used):
    picker = MaxScorePicker(random.Random(1), tie_epsilon=0.005)
    assert primaries(picker, [0.2, 0.9, 0.5]) == {1}
    assert picker.pick([], 3) == []


def test_without_a_tiebreak_equal_totals_share_the_traffic_at_random(kernels_used):
    # Two tied pods (not only three or more): the first in list order must not take it all.
    picker = MaxScorePicker(random.Random(5), tie_epsilon=0.005)
    assert primaries(picker, [0.5, 0.9, 0.9]) == {1, 2}
    assert primaries(picker, [0.9, 0.9]) == {0, 1}


def test_totals_exactly_the_epsilon_apart_are_a_tie(kernels_used):
    picker = MaxScorePicker(random.Random(2), tie_epsilon=0.25)  # 0.75 - 0.5 == 0.25 exactly
    assert primaries(picker, [0.5, 0.75]) == {0, 1}
    assert primaries(picker, [0.5, 0.75 + 2**-20]) == {1}


def test_a_zero_epsilon_still_ties_exactly_equal_totals(kernels_used):
    # scheduling.tie_epsilon accepts 0.0: then only identical totals are equal.
    picker = MaxScorePicker(random.Random(3), tie_epsilon=0.0)
    assert primaries(picker, [0.5, 0.5, 0.25]) == {0, 1}


def test_the_tiebreak_orders_tied_pods_only(kernels_used):
    picker = MaxScorePicker(random.Random(4), tie_epsilon=0.005)
    assert primaries(picker, [0.9, 0.9, 0.9], tiebreak=[2.0, 1.0, 1.0]) == {1, 2}
    # A clear winner wins whatever its tiebreak key.
    assert primaries(picker, [0.9, 0.5], tiebreak=[7.0, 0.0]) == {0}


def test_fallbacks_follow_by_score_equal_scores_in_candidate_order_bounded_by_the_pool(
    kernels_used,
):
    picker = MaxScorePicker(random.Random(6), tie_epsilon=0.005)
    assert picker.pick([0.1, 0.8, 0.4, 0.6], 3) == [1, 3, 2]
    assert picker.pick([0.1, 0.8, 0.4, 0.4], 3) == [1, 2, 3]
    assert picker.pick([0.1, 0.8], 5) == [1, 0]
    assert picker.pick([0.1, 0.8], 1) == [1]


def test_without_an_epsilon_only_float_noise_ties(kernels_used):
    picker = MaxScorePicker(random.Random(7))
    assert primaries(picker, [0.5, 0.6]) == {1}
    assert primaries(picker, [0.3, 0.1 + 0.2]) == {0, 1}  # 0.30000000000000004
