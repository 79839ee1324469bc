"""cache = leading blocks of the prompt the pod holds / blocks in the prompt (weight 0.60).

Reads the prefix match produced by the prefix index before scoring. A prompt shorter than
one block has nothing to match: every pod scores 0 and the other factors decide."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, truediv

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class CacheScorer:
    name: str = "cache"

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]:
        total = request.total_blocks
        if total == 0 or not request.prefix_match:
            return [0.0] * len(candidates)
        # [prefix_match.get(e.name, 0) / total for e in candidates] in C-level passes.
        names = map(attrgetter("name"), candidates)
        return list(map(truediv, map(request.prefix_match.get, names, repeat(0)), repeat(total)))
