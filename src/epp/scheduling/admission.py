"""Admission when the pool is saturated: priorities and the bounded waiting queue.

Pure bookkeeping, no clock and no I/O, so the live Router and the virtual-time benchmark
drive the same code. The Router offers a request here only when scheduling found every
candidate saturated:

- sheddable requests (priority < 0) are refused at once (429 `rejected-saturated`);
- the others wait, bounded in count and bytes (429 when full), ordered by priority, then
  fair across models within a priority (one request per model in turn), then by arrival;
- a waiting request whose TTL passes is refused (429 `rejected-ttl-expired`).
The Router runs a release pass (`FlowQueue.release`) whenever capacity may have returned
(a completion, a scrape, a tick): it offers every waiting request a pod in that order and
places as many as the pods have room for.

The rule that orders them, the queue's invariant: **a waiting request is never overtaken
on a pod it may use, and never held back by one it does not share pods with.** Requests
are offered a pod in service order; one that finds no room marks its *placement* (the
pods it may use: for the Router its base model and subset hint) full for the rest of the
pass, and the requests after it are still offered a pod. They can only get one outside
that placement: a pass only adds load, so every pod the earlier request may use stays
full until the pass ends. Where requests compete for the same pods, the higher ranked is
served first (priority, then the models' turn, then arrival); where they do not (a subset
hint naming a saturated pod, another model), nobody waits for an unrelated request.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from itertools import zip_longest
from typing import Generic, TypeVar

from epp.config import FlowControlConfig

T = TypeVar("T")


def request_priority(
    model: str | None, headers: Mapping[str, str], config: FlowControlConfig
) -> int:
    """The request's priority: the trusted header if configured and valid, else per model."""
    if config.priority_header:
        raw = headers.get(config.priority_header.lower())
        if raw is not None:
            try:
                return max(-1000, min(1000, int(raw.strip())))
            except ValueError:
                pass  # a malformed value is ignored, not trusted
    if model is not None and model in config.priorities:
        return config.priorities[model]
    return config.default_priority


@dataclass(slots=True, eq=False)
class Waiting(Generic[T]):
    item: T
    priority: int
    model: str
    size: int
    enqueued_at: float
    deadline: float
    done: bool = False  # out of the queue (placed, refused, expired or given up)
    # Requests with equal placements may use exactly the same pods, so when one finds no
    # room none of the others can in the same pass. None: its model's pods.
    placement: Hashable = None

    @property
    def placement_key(self) -> Hashable:
        return self.model if self.placement is None else self.placement


class Offer(Enum):
    """What became of a waiting request offered a pod in a release pass."""

    PLACED = "placed"  # dispatched: it leaves the queue
    NO_ROOM = "no-room"  # every pod it may use is full: it keeps its place
    LEFT = "left"  # it leaves without a pod (refused, failed, or already answered)


@dataclass(slots=True)
class _Band(Generic[T]):
    # model -> its waiting requests in arrival order; the OrderedDict's order is the turn.
    by_model: OrderedDict[str, deque[Waiting[T]]] = field(default_factory=OrderedDict)
    # placement key -> how many of the band's requests have it
    placements: Counter[Hashable] = field(default_factory=Counter)


class FlowQueue(Generic[T]):
    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._bands: dict[int, _Band[T]] = {}
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._bytes

    def push(self, waiting: Waiting[T]) -> bool:
        """Queue it; False if the queue is full (count or bytes)."""
        if self._count + 1 > self.max_requests or self._bytes + waiting.size > self.max_bytes:
            return False
        band = self._bands.get(waiting.priority)
        if band is None:
            band = self._bands[waiting.priority] = _Band()
        queue = band.by_model.get(waiting.model)
        if queue is None:
            queue = band.by_model[waiting.model] = deque()
        queue.append(waiting)
        band.placements[waiting.placement_key] += 1
        self._count += 1
        self._bytes += waiting.size
        return True

    def candidates(self) -> Iterator[Waiting[T]]:
        """Heads of the queue in service order: highest priority first; within it, one
        head per model, the model whose turn it is first."""
        for priority in sorted(self._bands, reverse=True):
            for queue in list(self._bands[priority].by_model.values()):
                if queue:
                    yield queue[0]

    def in_order(self, min_priority: int | None = None) -> Iterator[Waiting[T]]:
        """Every waiting request (of priority >= min_priority) in service order: highest
        priority first; within a priority the models take turns, one request each, the
        model whose turn it is first; each model's in arrival order. Each band is read
        when reached, so taking requests out meanwhile is safe."""
        for priority in sorted(self._bands, reverse=True):
            if min_priority is not None and priority < min_priority:
                return
            band = self._bands.get(priority)
            if band is None:
                continue
            for turn in zip_longest(*[list(q) for q in band.by_model.values()]):
                for waiting in turn:
                    if waiting is not None and not waiting.done:
                        yield waiting

    def ranks_at_least(self, priority: int) -> bool:
        """Some request of this priority or higher waits."""
        return any(p >= priority for p in self._bands)

    def placements(self, min_priority: int | None = None) -> set[Hashable]:
        """The placement keys of the waiting requests (of priority >= min_priority)."""
        keys: set[Hashable] = set()
        for priority, band in self._bands.items():
            if min_priority is None or priority >= min_priority:
                keys.update(band.placements)
        return keys

    def release(
        self,
        offer: Callable[[Waiting[T]], Offer],
        full: set[Hashable],
        min_priority: int | None = None,
    ) -> int:
        """One release pass: offer waiting requests (of priority >= min_priority) a pod in
        service order, placing as many as there is room for; returns how many were placed.

        `full` holds the placements known to have no room (the caller keeps it between
        passes and clears it when room may have returned); a placement that finds none
        is added. A request whose placement is full is not offered: it could not be
        placed (the same pods, and a pass only adds load). That is the module's
        invariant: it keeps its place without holding back the requests after it, which
        can only be placed on pods it may not use. The pass ends once every waiting
        request's placement is full."""
        if self.placements(min_priority) <= full:
            return 0
        placed = 0
        for waiting in self.in_order(min_priority):
            key = waiting.placement_key
            if key in full:
                continue
            outcome = offer(waiting)
            if outcome is Offer.NO_ROOM:
                full.add(key)
                if self.placements(min_priority) <= full:
                    break
                continue
            self.remove(waiting)
            placed += outcome is Offer.PLACED
        return placed

    def remove(self, waiting: Waiting[T]) -> None:
        """Take a request out (served, expired, or given up by its client)."""
        band = self._bands.get(waiting.priority)
        if band is None:
            return
        queue = band.by_model.get(waiting.model)
        if queue is None:
            return
        try:
            queue.remove(waiting)
        except ValueError:
            return
        waiting.done = True
        key = waiting.placement_key
        band.placements[key] -= 1
        if not band.placements[key]:
            del band.placements[key]
        self._count -= 1
        self._bytes -= waiting.size
        if queue:
            # This model was served: it goes to the back of its band's turn.
            band.by_model.move_to_end(waiting.model)
        else:
            del band.by_model[waiting.model]
            if not band.by_model:
                del self._bands[waiting.priority]

    def expired(self, now: float) -> list[Waiting[T]]:
        return [
            w
            for band in self._bands.values()
            for queue in band.by_model.values()
            for w in queue
            if w.deadline <= now
        ]
