"""The contracts: what a filter, a scorer and a picker are, and what a decision holds.

Also the one contract for state that is not the data layer's: a scorer that keeps per-pod
state of its own (`PodStateScorer`) and learns what the router did through one hook.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, runtime_checkable

from epp.datalayer.endpoint import Endpoint
from epp.prefix.hashing import BlockHash


@dataclass(slots=True)
class SchedulingRequest:
    """One request as scheduling sees it. `prefix_match` is produced once, before scoring,
    by the prefix index (pod name -> leading blocks it holds); scorers only read it.
    `now` is the data layer's clock at routing time, passed in because scheduling has no
    clock of its own."""

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


@dataclass(frozen=True, slots=True)
class Dispatched:
    """The router sent `request` to `endpoint`: after the pick and the endpoint's
    reservation. `request.prefix_match` is the match the scorers saw (the prefix index
    records the prompt for the chosen pod only afterwards), `request.now` the time.
    `lane_limit`: a time that what this dispatch adds to per-pod queue models must not
    extend past (a peer replica's decision: its arrival + replicas.load_ttl_s, so that
    what peers claim fades); None: no limit (this replica's own dispatches)."""

    request: SchedulingRequest
    endpoint: Endpoint
    lane_limit: float | None = None


@dataclass(frozen=True, slots=True)
class Completed:
    """A request the router sent to `endpoint` ended with `status` (None: no response was
    seen, e.g. the client went away). `seconds` is its time from dispatch to completion on
    the data layer's clock, None when the data layer had already let the request go (the
    pod's page showed it over, or it expired): its duration is then unknown. A request
    served by a gateway fallback ends on its primary as a 503."""

    endpoint: Endpoint
    status: int | None
    seconds: float | None


@dataclass(frozen=True, slots=True)
class Removed:
    """The endpoint left the pool: forget what is kept for it."""

    endpoint: Endpoint


PodEvent: TypeAlias = Dispatched | Completed | Removed


@runtime_checkable
class PodStateScorer(Scorer, Protocol):
    """A scorer that keeps state of its own per pod (an optional extension of Scorer).

    The data layer's Endpoint holds what the data layer measures: scraped pages, the EPP's
    own count of what it sent where, health. A scorer that needs more, e.g. a model of each
    pod's queue built from what was sent there, keeps that state itself, in its own module:

    - per pod, keyed by the Endpoint object (a pod removed and added again is a new object
      and starts afresh); a pod it has no state for yet has the state's defaults;
    - changed only by `observe`, which the Router calls synchronously on the event loop's
      thread, never during `score`: `Dispatched` once per routed request, `Completed` at
      most once per dispatch (not at all when the request's end is never heard of), and
      `Removed` when the pod leaves the pool;
    - `observe` is cheap and does no I/O; an exception in it on dispatch fails that
      request (its reservation is released).

    The Scheduler passes each event to every scorer of its profile that has `observe`, so
    a scorer without a weight keeps no state at all.
    """

    def observe(self, event: PodEvent) -> None: ...


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
        # Best first, equal totals in candidate order (both are stable): only the rows shown
        # are ordered when there is a limit.
        indexes = range(len(self.candidates))
        key = self.totals.__getitem__
        if limit is None or limit < 0:
            order = sorted(indexes, key=key, reverse=True)[:limit]
        else:
            order = heapq.nlargest(limit, indexes, key=key)
        rows = []
        for i in order:
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
