"""Max-score picker: the best composite score wins; exact ties are broken at random, so
equal pods share traffic instead of the first in list order taking all of it."""

from __future__ import annotations

import random
from collections.abc import Sequence


class MaxScorePicker:
    def __init__(self, rng: random.Random | None = None, tie_epsilon: float = 1e-9) -> None:
        self._rng = rng or random.Random()
        self._eps = tie_epsilon

    def pick(self, totals: Sequence[float], count: int) -> list[int]:
        if not totals:
            return []
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if best - t <= self._eps]
        primary = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        if count <= 1:
            return [primary]
        # Fallbacks: the next best, with a random order inside each group of equals.
        keys = [(-t, self._rng.random()) for t in totals]
        rest = sorted((i for i in range(len(totals)) if i != primary), key=keys.__getitem__)
        return [primary, *rest[: count - 1]]
