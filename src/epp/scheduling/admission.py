"""Admission when the pool is saturated: priorities and the bounded waiting queue.

Pure bookkeeping, no clock and no I/O, so the live Router and the virtual-time benchmark
drive the same code. The Router offers a request here only when scheduling found every
candidate saturated:

- sheddable requests (priority < 0) are refused at once (429 `rejected-saturated`);
- the others wait, bounded in count and bytes (429 when full), ordered by priority, then
  fair across models within a priority (one request per model in turn), then by arrival;
- a waiting request whose TTL passes is refused (429 `rejected-ttl-expired`).
The Router retries the queue's head whenever capacity may have returned (a completion, a
scrape, a tick) and takes requests out in `next_candidates()` order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
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
    done: bool = False


@dataclass(slots=True)
class _Band(Generic[T]):
    # model -> its waiting requests in arrival order; the OrderedDict's order is the turn.
    by_model: OrderedDict[str, deque[Waiting[T]]] = field(default_factory=OrderedDict)


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
