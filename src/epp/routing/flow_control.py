"""Flow control: the admission queue (scheduling/admission.FlowQueue) around dispatch.

A request that dispatch finds saturated is offered here (`offer`): a sheddable one
(priority < 0), or any when flow control is disabled or the queue is full (count or
bytes), is refused at once (`Shed`, 429 rejected-saturated); the others wait. Release
passes (`release`) then place as many waiting requests as the pods have room for, in the
queue's order; a request whose TTL passes leaves (`expire`, or its caller's own timer).

Passes are driven by events, never by polling: room may have returned when a request
completed or a page showed a pod less busy (the store's `released` / `updated`), a pod
appeared (`added`), or time alone changed what the filters read (`time_passed`: health
recovering, a stale page's gauges no longer counted). Each marks a pass due and calls
`notify` once; whoever drives flow control runs it with `run_due` (the server on its
event loop, the virtual benchmark at the end of the event). A newer request meanwhile
lets the due pass place the waiting requests of its rank or higher first (`dispatch`).

Invariant (the queue's, scheduling/admission.py): a waiting request is never overtaken
on a pod it may use, and never held back by one it does not share pods with. `_full`
holds the placements known to have no room since room last returned; every waiting
request's placement is in it unless a pass is due, so a newer request whose placement
is in it waits without a scheduling attempt.

No clock, no event loop, no I/O: times are the caller's (`now`), and a waiting request's
way back to its caller is its Ticket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar, cast

from epp.config import FlowControlConfig
from epp.datalayer.endpoint import Endpoint
from epp.observability.flow_metrics import FlowMetrics
from epp.observability.metrics import EppMetrics
from epp.request import RequestRejected
from epp.routing.types import (
    SATURATED,
    Placement,
    PreparedRequest,
    RoutedRequest,
    Saturated,
    placement,
)
from epp.scheduling.admission import FlowQueue, Offer, Waiting

EXPIRED = "rejected-ttl-expired"


class Ticket(Protocol):
    """A waiting request, as flow control sees it: the request, and its caller."""

    @property
    def prepared(self) -> PreparedRequest: ...

    def gone(self) -> bool:
        """The caller stopped waiting (answered, timed out or cancelled)."""
        ...

    def placed(self, routed: RoutedRequest) -> None: ...

    def failed(self, exc: Exception) -> None:
        """Its dispatch raised something other than Saturated: that is its answer."""
        ...


TicketT = TypeVar("TicketT", bound=Ticket)


class Shed(RequestRejected):
    """Refused instead of waiting (429 rejected-saturated)."""


class FlowControl(Generic[TicketT]):
    def __init__(
        self,
        config: FlowControlConfig,
        dispatch: Callable[[PreparedRequest], RoutedRequest],
        metrics: EppMetrics,
    ) -> None:
        self.config = config
        self._dispatch = dispatch
        self._metrics = metrics
        self.flow_metrics = FlowMetrics(metrics.registry)
        self._queue: FlowQueue[TicketT] = FlowQueue(config.max_requests, config.max_bytes)
        self._full: set[Hashable] = set()
        self._due = False
        self.notify: Callable[[], None] = lambda: None  # a pass became due

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def bytes(self) -> int:
        return self._queue.bytes

    # -- a new request ---------------------------------------------------------------
    def dispatch(self, prepared: PreparedRequest) -> RoutedRequest:
        """Dispatch a new request now, unless it must wait (raises Saturated): waiting
        requests of its rank or higher choose first (the module's invariant)."""
        key = placement(prepared)
        if self._queue.ranks_at_least(prepared.priority):
            if self._due:
                self.release(min_priority=prepared.priority)
            if key in self._full:
                raise Saturated(429, "requests are waiting for capacity", reason=SATURATED)
        try:
            return self._dispatch(prepared)
        except Saturated:
            self._full.add(key)
            raise

    def offer(self, ticket: TicketT, now: float) -> Waiting[TicketT]:
        """Queue a request that found every pod saturated, until `now + ttl_s`; raises
        Shed when it may not wait."""
        prepared = ticket.prepared
        if not self.config.enabled or prepared.priority < 0:
            raise self._shed("every endpoint is saturated; retry later")
        waiting = Waiting(
            ticket,
            prepared.priority,
            prepared.request.model or "",
            # What the wait holds: the body, and the copy naming a target model if any.
            prepared.size + len(prepared.body or b""),
            now,
            now + self.config.ttl_s,
            placement=placement(prepared),
        )
        if not self._queue.push(waiting):
            raise self._shed("every endpoint is saturated and the EPP's queue is full")
        self._update_gauges()
        return waiting

    def _shed(self, message: str) -> Shed:
        self.flow_metrics.outcomes.labels(SATURATED).inc()
        return Shed(429, message, reason=SATURATED, retry_after_s=self.config.retry_after_s)

    def expiry_refusal(self) -> RequestRejected:
        """The answer of a request whose TTL passed while it waited (429)."""
        self.flow_metrics.outcomes.labels(EXPIRED).inc()
        return RequestRejected(
            429,
            f"no endpoint had capacity within {self.config.ttl_s:g} s; retry later",
            reason=EXPIRED,
            retry_after_s=self.config.retry_after_s,
        )

    def leave(self, waiting: Waiting[TicketT]) -> None:
        """Take a request out of the queue (placed, expired, or given up)."""
        self._queue.remove(waiting)
        self._update_gauges()

    def expire(self, now: float) -> list[Waiting[TicketT]]:
        """Take out the requests whose TTL passed by `now`; returns them."""
        expired = self._queue.expired(now)
        for waiting in expired:
            self._queue.remove(waiting)
        if expired:
            self._update_gauges()
        return expired

    def waiting(self) -> list[Waiting[TicketT]]:
        """Every waiting request, in service order."""
        return list(self._queue.in_order())

    # -- release passes ----------------------------------------------------------------
    def release(self, min_priority: int | None = None) -> int:
        """One release pass (FlowQueue.release): dispatch waiting requests, as many as
        pods have room for; returns how many went. With `min_priority`, only those of
        that priority or higher (a newer request's turn comes after them), and the full
        pass stays due. A request whose dispatch raised gets that exception; the pass
        goes on with the others."""
        if min_priority is None:
            self._due = False
        cycle_start = time.perf_counter()
        released = self._queue.release(self._offer, self._full, min_priority)
        self._update_gauges()
        if len(self._queue) or released:
            self._metrics.upstream.dispatch_cycle(time.perf_counter() - cycle_start)
        return released

    def run_due(self) -> None:
        """Run the due pass, if any (a loop callback: failures are counted, not raised)."""
        if not self._due:
            return
        try:
            self.release()
        except Exception as exc:
            self._metrics.background.failed("queue-release", exc)

    def _offer(self, waiting: Waiting[TicketT]) -> Offer:
        ticket = waiting.item
        if ticket.gone():
            return Offer.LEFT
        try:
            routed = self._dispatch(ticket.prepared)
        except Saturated:
            return Offer.NO_ROOM
        except Exception as exc:  # a refusal, or a bug (a scorer's): this request's answer
            self.flow_metrics.outcomes.labels("failed").inc()
            ticket.failed(exc)
            return Offer.LEFT
        ticket.placed(routed)
        return Offer.PLACED

    # -- events ------------------------------------------------------------------------
    def room_may_have_returned(self, endpoint: Endpoint) -> None:
        """A pod completed a request, showed a page, or appeared. Room on a pod returns
        to its model's placements only: what the filters read is the pod's own state,
        except the health floor, which is per model (one pod excluded can let another of
        its model back in)."""
        if self._full:
            model = endpoint.model
            if model is None:
                self._full.clear()  # a pod of unknown model is a candidate for every model
            else:
                self._full = {k for k in self._full if cast(Placement, k)[0] not in (None, model)}
        if len(self._queue):
            self._pass_due()

    def time_passed(self) -> None:
        """Time alone may have returned room (health recovering, a stale page's gauges
        no longer counted), which no store event announces: every placement is retried
        now."""
        self._full.clear()
        if len(self._queue):
            self.release()

    def _pass_due(self) -> None:
        if self._due:
            return
        self._due = True
        self.notify()

    def _update_gauges(self) -> None:
        size = len(self._queue)
        self.flow_metrics.queue_size.set(size)
        self.flow_metrics.queue_bytes.set(self._queue.bytes)
        self.flow_metrics.saturated.set(1 if size else 0)
