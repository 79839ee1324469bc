"""Baseline routers over the same simulated pods as the EPP.

- `RoundRobin`: pods in turn (Kubernetes Service / Envoy default).
- `RandomChoice`: a seeded uniform pick.
- `LeastOutstanding`: fewest requests in flight, counted by the router itself (Envoy
  least_request with a full scan; SGLang's fallback policy). Ties are broken at random.
- `ConsistentHash`: the prompt's leading blocks hashed onto a ring with virtual nodes, so
  one prefix group always lands on one pod, whatever the load (Envoy ring_hash on a
  prefix key).
- `Oracle`: perfect, instantaneous knowledge of every engine's KV cache. Each request goes
  to a pod that truly holds the longest cached prefix of its prompt at the moment it is
  routed; ties go to the least loaded pod (running + waiting), and pods whose queue would
  refuse the request are skipped. It is an upper bound of the *cache match visible at
  routing time* (what any index, approximate or precise, could know), per decision: it is
  greedy and load-blind beyond ties, so it is not an upper bound of latency, and not
  strictly of a whole run's hit rate (a request that waits in a queue can gain or lose
  blocks before it starts, and one placement changes what later requests can find).
"""

from __future__ import annotations

import random
from bisect import bisect_right
from dataclasses import dataclass, field

import xxhash

from epp_bench.virtual.types import (
    PreparedRequest,
    RouteChoice,
    VirtualPods,
    leading_cached_blocks,
    queue_would_refuse,
)

# Blocks hashed for the consistent-hash key: 64 tokens, llm-d's minimum prefix length; with
# chained hashes the last of them stands for all of them.
HASH_KEY_BLOCKS = 4
RING_VNODES = 100


class _Stateless:
    """tick/complete/stats for routers that keep no per-request state."""

    def tick(self, now: float) -> None:
        return None

    def complete(self, choice: RouteChoice, status: int) -> None:
        return None

    def release(self, now: float, final: bool = False) -> list[tuple[int, RouteChoice]]:
        return []  # nothing is ever held

    def stats(self) -> dict[str, object]:
        return {}


@dataclass(slots=True)
class RoundRobin(_Stateless):
    pods: int
    name: str = "round_robin"
    _next: int = 0

    def route(self, request: PreparedRequest, now: float) -> RouteChoice:
        pod = self._next
        self._next = (pod + 1) % self.pods
        return RouteChoice(pod)


@dataclass(slots=True)
class RandomChoice(_Stateless):
    pods: int
    seed: int = 0
    name: str = "random"
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def route(self, request: PreparedRequest, now: float) -> RouteChoice:
        return RouteChoice(self._rng.randrange(self.pods))


@dataclass(slots=True)
class LeastOutstanding:
    pods: int
    seed: int = 0
    name: str = "least_outstanding"
    in_flight: list[int] = field(init=False)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.in_flight = [0] * self.pods
        self._rng = random.Random(self.seed)

    def tick(self, now: float) -> None:
        return None

    def route(self, request: PreparedRequest, now: float) -> RouteChoice:
        counts = self.in_flight
        least = min(counts)
        tied = [i for i, count in enumerate(counts) if count == least]
        pod = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        counts[pod] += 1
        return RouteChoice(pod, ticket=pod)

    def complete(self, choice: RouteChoice, status: int) -> None:
        assert choice.pod is not None
        self.in_flight[choice.pod] -= 1

    def release(self, now: float, final: bool = False) -> list[tuple[int, RouteChoice]]:
        return []  # nothing is ever held

    def stats(self) -> dict[str, object]:
        return {}


def _ring_point(key: bytes) -> int:
    return xxhash.xxh64_intdigest(key)


@dataclass(slots=True)
class ConsistentHash(_Stateless):
    names: tuple[str, ...]
    vnodes: int = RING_VNODES
    name: str = "consistent_hash"
    _points: list[int] = field(init=False)
    _owners: list[int] = field(init=False)

    def __post_init__(self) -> None:
        ring = sorted(
            (_ring_point(f"{pod}#{v}".encode()), index)
            for index, pod in enumerate(self.names)
            for v in range(self.vnodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def key(self, request: PreparedRequest) -> int:
        """The ring position of a request: its first blocks' chained hash (uniform)."""
        if request.hashes:
            return request.hashes[min(HASH_KEY_BLOCKS, len(request.hashes)) - 1]
        return _ring_point(request.body)

    def route(self, request: PreparedRequest, now: float) -> RouteChoice:
        slot = bisect_right(self._points, self.key(request)) % len(self._points)
        return RouteChoice(self._owners[slot])


@dataclass(slots=True)
class Oracle(_Stateless):
    pods: VirtualPods
    name: str = "oracle"

    def route(self, request: PreparedRequest, now: float) -> RouteChoice:
        best: tuple[int, int, int] | None = None  # (-cached blocks, load, index): min wins
        for index, engine in enumerate(self.pods.engines):
            if queue_would_refuse(engine):
                continue
            cached = leading_cached_blocks(engine, request.hashes, now) if request.hashes else 0
            key = (-cached, engine.num_running + engine.num_waiting, index)
            if best is None or key < best:
                best = key
        if best is None:
            # Every queue is full: let the least loaded pod answer (it will refuse).
            loads = [e.num_running + e.num_waiting for e in self.pods.engines]
            return RouteChoice(loads.index(min(loads)))
        return RouteChoice(best[2])
