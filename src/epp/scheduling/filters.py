"""Filters: which pods may serve a request at all. Order matters: the first filter that
leaves nobody decides the answer (503 no endpoint, 429 saturated)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, lt

from epp.datalayer.endpoint import Endpoint
from epp.kernels import SCHEDULING as COMPILED
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class SubsetFilter:
    """Only the pods the proxy names in its subset hint (envoy.lb.subset_hint)."""

    name: str = "subset"
    reject_status: int = 503
    reject_reason: str = "rejected-subset-no-match"

    def filter(self, request: SchedulingRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        if request.subset is None:
            return candidates
        return [e for e in candidates if e.address in request.subset]


@dataclass(slots=True)
class ModelFilter:
    """Pods serving the request's base model (an adapter runs on its base model's pods).
    A pod whose model is not known yet is kept: better a 404 from it than no answer. No
    pod at all is a 404, as vLLM itself answers for a model it does not serve."""

    name: str = "model"
    reject_status: int = 404
    reject_reason: str = "model-not-found"

    def filter(self, request: SchedulingRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        wanted = request.base_model
        if wanted is None:
            return candidates
        if COMPILED is not None:
            return COMPILED.model_filter(candidates, wanted)
        return [e for e in candidates if e.model is None or e.model == wanted]  # the twin


@dataclass(slots=True)
class HealthFilter:
    """Pods the health model excludes receive no new traffic, unless their model is in
    panic (too few routable pods). `excluded` is the store's verdict (datalayer/health.py):
    health below scheduling.health_threshold with hysteresis, under the floor of the pod's
    model, so a pod below the threshold may stay routable (too many of its model's pods
    are out already)."""

    name: str = "health"
    reject_status: int = 503
    reject_reason: str = "rejected-no-healthy-endpoints"

    def filter(self, request: SchedulingRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        if COMPILED is not None:
            return COMPILED.health_filter(candidates)
        return [e for e in candidates if e.panic or not e.excluded]  # the twin


@dataclass(slots=True)
class SaturationFilter:
    """Pods whose queue reached maxQueue leave the pool: the queue score alone (0.10) could
    never outweigh a cache match (0.60), so a hot pod would keep drawing traffic."""

    max_queue: int = 20
    name: str = "saturation"
    reject_status: int = 429
    reject_reason: str = "rejected-saturated"

    def filter(self, request: SchedulingRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        # [e for e in candidates if e.queue_depth < max_queue] in C-level passes.
        depths = map(attrgetter("queue_depth"), candidates)
        return list(compress(candidates, map(lt, depths, repeat(self.max_queue))))


@dataclass(slots=True)
class BalanceFilter:
    """The imbalance guard: pods with both more than `abs_requests` more requests in flight
    from this EPP and more than `ratio` times as many as the least busy candidate leave the
    set. It never empties the set (the least busy pod always stays). It counts the EPP's
    own dispatches, which are exact and current, not the pods' gauges: those lag, and they
    already weigh in through the load and queue factors. See config.BalanceConfig."""

    abs_requests: float = 4.0
    ratio: float = 3.0
    name: str = "balance"
    reject_status: int = 429
    reject_reason: str = "rejected-saturated"

    def filter(self, request: SchedulingRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        if len(candidates) < 2:
            return candidates
        least = min(e.in_flight for e in candidates)
        limit = max(least + self.abs_requests, least * self.ratio)
        return [e for e in candidates if e.in_flight <= limit]
