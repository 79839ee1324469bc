"""Max-score picker: the best composite score wins.

Among pods whose scores are equal (within `scheduling.tie_epsilon`, 0.005: real gauges
never tie exactly), the one with the fewest requests in flight from this EPP wins, then
the one this EPP has given the fewest uncached prompt tokens so far, and only then chance.
The second key places new prefix groups evenly: between conversation turns both pods of
a pool are often idle, and by chance alone four groups land 3:1 or 4:0 more often than
not (seen on two real vLLM servers: 48/16 splits). Scraped metrics lag by up to one
interval, so two idle pods can look identical while one of them has just been given a
cold prefill; the EPP's own in-flight count sees that at once. Without this a cold-start burst can stack two
prefix groups on one pod and leave another idle (seen in the demo). Pure ties are broken
at random, so equal pods share traffic instead of the first in list order taking it all.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from itertools import compress, repeat
from operator import le, sub

from epp.kernels import SCHEDULING as COMPILED


class MaxScorePicker:
    def __init__(self, rng: random.Random | None = None, tie_epsilon: float = 1e-9) -> None:
        self._rng = rng or random.Random()
        self._eps = tie_epsilon

    def pick(
        self, totals: Sequence[float], count: int, tiebreak: Sequence[float] | None = None
    ) -> list[int]:
        """Indexes of the primary and up to count-1 fallbacks, best first; `tiebreak`
        (lower wins) orders candidates whose scores are equal."""
        if not totals:
            return []
        if COMPILED is not None and type(totals) is list:
            tied = COMPILED.tied(totals, self._eps)
        else:
            tied = python_tied(totals, self._eps)
        if tiebreak is not None and len(tied) > 1:
            least = min(tiebreak[i] for i in tied)
            tied = [i for i in tied if tiebreak[i] == least]
        primary = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        if count <= 1:
            return [primary]
        # Fallbacks: the next best by score (a C-level key: this runs on every request).
        # Among exactly equal scores they come in candidate order.
        rest = [i for i in range(len(totals)) if i != primary]
        return [primary, *heapq.nlargest(count - 1, rest, key=totals.__getitem__)]


def python_tied(totals: Sequence[float], eps: float) -> list[int]:
    """The indexes within `eps` of the best total, in order (the pure-Python twin of the
    compiled `tied`, epp.kernels): [i for i, t in enumerate(totals) if max - t <= eps]
    as C-level passes."""
    best = max(totals)
    gaps = map(sub, repeat(best), totals)
    return list(compress(range(len(totals)), map(le, gaps, repeat(eps))))
