"""The contracts: what a filter, a scorer and a picker are, and what a decision holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from epp.datalayer.endpoint import Endpoint
from epp.prefix.hashing import BlockHash


@dataclass(slots=True)
class SchedulingRequest:
    """One request as scheduling sees it. `prefix_match` is produced once, before scoring,
    by the prefix index (pod name -> leading blocks it holds); scorers only read it.
    `now` is the data layer's clock at routing time, passed in because scheduling has no
    clock of its own; the Router sets it only while the `prefill` scorer is on (else 0.0)."""

    request_id: str
    model: str | None = None
    base_model: str | None = None
    adapter: str | None = None
    block_hashes: Sequence[BlockHash] = ()
    prefix_match: dict[str, int] = field(default_factory=dict)
    subset: frozenset[str] | None = None  # addresses the proxy allows, None = all
    prompt_tokens: int = 0
    block_size: int = 16  # tokens per block of `block_hashes`: turns a match into tokens
    now: float = 0.0

    @property
    def total_blocks(self) -> int:
        return len(self.block_hashes)


class Filter(Protocol):
    name: str
    # HTTP status and reason when this filter leaves no candidate.
    reject_status: int
    reject_reason: str

    def filter(self, request: SchedulingRequest, candidates: list[Endpoint]) -> list[Endpoint]: ...


class Scorer(Protocol):
    """Rates every candidate in [0, 1] (higher is better). It never sees its weight."""

    name: str

    def score(self, request: SchedulingRequest, candidates: Sequence[Endpoint]) -> list[float]: ...


class Picker(Protocol):
    def pick(
        self, totals: Sequence[float], count: int, tiebreak: Sequence[float] | None = None
    ) -> list[int]:
        """Indexes of the chosen candidate and its fallbacks, best first."""
        ...


@dataclass(slots=True)
class Decision:
    request_id: str
    endpoints: list[Endpoint]  # primary first, then fallbacks
    candidates: list[Endpoint]  # after filtering, in scoring order
    totals: list[float]  # composite score per candidate
    factors: dict[str, list[float]]  # scorer name -> score per candidate (before weights)
    weights: dict[str, float]
    chosen_index: int
    filtered_out: dict[str, int] = field(default_factory=dict)  # filter -> pods removed

    @property
    def primary(self) -> Endpoint:
        return self.endpoints[0]

    @property
    def score(self) -> float:
        return self.totals[self.chosen_index]

    def factor(self, name: str) -> float | None:
        values = self.factors.get(name)
        return None if values is None else values[self.chosen_index]

    def breakdown(self, limit: int | None = None) -> list[dict[str, object]]:
        """Per-candidate factor scores, best first (for DEBUG logs and tests)."""
        order = sorted(range(len(self.candidates)), key=lambda i: -self.totals[i])
        rows = []
        for i in order[:limit]:
            row: dict[str, object] = {
                "pod": self.candidates[i].name,
                "score": round(self.totals[i], 4),
            }
            row.update({name: round(v[i], 4) for name, v in self.factors.items()})
            rows.append(row)
        return rows


class SchedulingError(Exception):
    """No endpoint can take the request; status and reason go back to the client."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
