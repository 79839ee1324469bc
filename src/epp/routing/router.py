"""The Router: one routing decision from end to end, independent of the transport.

It composes components with one job each:

    preparation (parse, tokenize, hash)  -> PreparedRequest
    flow control (wait while saturated)  -> dispatch (filter, score, pick, reserve)
                                             -> RoutedRequest
    accounting (reservations, completions, in-flight; the only writer of Endpoint state)
    observation (metrics and log lines of each decision)

The ext_proc server awaits `route` (a saturated pool: the request waits in flow control)
and calls `complete`; the virtual-time benchmark and tests call `prepare` / `dispatch` /
`route_now` and drive `flow_control` on their own clock. The Router subscribes to
nothing and does no I/O: the wiring (epp/wiring.py) delivers the endpoint store's events
to `on_endpoint_change` and connects `hooks` (precise mode, peer replicas).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from epp.config import EppConfig
from epp.datalayer.discovery.models import ModelTable
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.observability.upstream import (
    DISPATCHED,
    EVICTED_CANCELLED,
    EVICTED_TTL,
    NOT_YET_FINALIZED,
    REJECTED_CAPACITY,
    REJECTED_OTHER,
)
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest, RequestRejected
from epp.routing.accounting import Accounting
from epp.routing.dispatch import Dispatcher
from epp.routing.flow_control import FlowControl, Shed, Ticket
from epp.routing.observation import DecisionObserver
from epp.routing.preparation import Preparation
from epp.routing.types import (
    DecisionHooks,
    PreparedRequest,
    RoutedRequest,
    Saturated,
)
from epp.scheduling.admission import Waiting
from epp.scheduling.scheduler import Scheduler
from epp.tokenization import TokenizerRegistry
from epp.tokenization.engine import EngineTokenizer
from epp.tokenization.protocol import Tokenizer


@dataclass(slots=True)
class FutureTicket:
    """A request waiting in flow control for the ext_proc server: its answer is a future."""

    prepared: PreparedRequest
    future: asyncio.Future[RoutedRequest]

    def gone(self) -> bool:
        return self.future.done()

    def placed(self, routed: RoutedRequest) -> None:
        self.future.set_result(routed)

    def failed(self, exc: Exception) -> None:
        self.future.set_exception(exc)


class Router:
    def __init__(
        self,
        config: EppConfig,
        store: EndpointStore,
        index: PrefixIndex,
        scheduler: Scheduler,
        tokenizer: Tokenizer | TokenizerRegistry,
        metrics: EppMetrics,
        debug: bool = False,
    ) -> None:
        self._store = store
        self._index = index
        self._scheduler = scheduler
        self._metrics = metrics
        self.hooks = DecisionHooks()
        tokenizers = (
            tokenizer
            if isinstance(tokenizer, TokenizerRegistry)
            else TokenizerRegistry(fallback=tokenizer)
        )
        self.preparation = Preparation(config, store, tokenizers, metrics.upstream, debug)
        self.accounting = Accounting(store, scheduler, metrics, self.hooks)
        self.observer = DecisionObserver(metrics, index, config.scheduling.tie_epsilon)
        self.dispatcher = Dispatcher(
            store, index, scheduler, self.accounting, self.observer, metrics.upstream,
            self.hooks, config.prefix.block_size,
        )  # fmt: skip
        # Any Ticket: the server waits on futures here, the virtual benchmark on its clock.
        self.flow_control: FlowControl[Ticket] = FlowControl(
            config.flow_control, self.dispatcher.dispatch, metrics
        )
        self.flow_control.notify = self._release_soon
        # The upstream series (observability/upstream.py) read open requests at scrape time.
        metrics.upstream.configure(
            pool=config.discovery.pool_name,
            namespace=config.discovery.pool_namespace,
            flow_enabled=config.flow_control.enabled,
        )
        metrics.upstream.watch(
            open_requests=self.accounting.open_labels, prefix_size=lambda: index.nodes
        )

    # -- what the wiring connects --------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    @property
    def engine_tokenizer(self) -> EngineTokenizer | None:
        return self.preparation.engine_tokenizer

    @engine_tokenizer.setter
    def engine_tokenizer(self, engine: EngineTokenizer | None) -> None:
        self.preparation.engine_tokenizer = engine

    def set_model_table(self, table: ModelTable) -> None:
        self.preparation.set_model_table(table)

    # -- events ----------------------------------------------------------------------
    def on_endpoint_change(self, event: str, endpoint: Endpoint) -> None:
        """An endpoint store event: a removed pod's open requests and scorer state are
        forgotten; a pod with room may take waiting requests."""
        self._metrics.on_endpoint_change(event, endpoint)
        if event == "removed":
            self.accounting.pod_removed(endpoint)
        elif event in ("released", "updated", "added"):
            self.flow_control.room_may_have_returned(endpoint)

    def tick(self) -> None:
        """Time passed (the service's maintenance round, after the store re-derived
        health from the clock): room that the clock alone returns is retried, and the
        reservations the store dropped are forgotten."""
        self.flow_control.time_passed()
        self.accounting.forget_dropped()

    def _release_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: nobody waits (the benchmark runs `run_due` itself)
        loop.call_soon(self.flow_control.run_due)

    # -- the decision ------------------------------------------------------------------
    def prepare(self, request: IncomingRequest) -> PreparedRequest:
        """Parse, tokenize and hash one request (raises RequestRejected for bad input)."""
        return self.preparation.prepare(request)

    def dispatch(self, prepared: PreparedRequest) -> RoutedRequest:
        """Choose the pod now and reserve it. Raises Saturated when every candidate is
        saturated, RequestRejected for every other refusal."""
        return self.dispatcher.dispatch(prepared)

    def route_now(self, request: IncomingRequest) -> RoutedRequest:
        """Route without waiting: a saturated pool is a 429 (benchmarks, tests)."""
        prepared = self.prepare(request)
        try:
            return self.dispatcher.dispatch(prepared)
        except RequestRejected as exc:
            self.observer.rejected(prepared, exc)
            raise

    async def route(self, request: IncomingRequest) -> RoutedRequest:
        """Route one request, waiting in flow control while the pool is saturated."""
        prepared = await self.preparation.prepare_async(request)
        admitted = time.perf_counter()
        try:
            routed = self.flow_control.dispatch(prepared)
        except Saturated:
            return await self._wait(prepared)
        except RequestRejected as exc:
            self.observer.rejected(prepared, exc)
            raise
        self._metrics.upstream.admission(prepared.upstream, DISPATCHED, admitted)
        return routed

    # -- waiting (the ext_proc server's side of flow control) --------------------------
    async def _wait(self, prepared: PreparedRequest) -> RoutedRequest:
        upstream, labels, admitted = self._metrics.upstream, prepared.upstream, time.perf_counter()
        loop = asyncio.get_running_loop()
        ticket = FutureTicket(prepared, loop.create_future())
        try:
            waiting = self.flow_control.offer(ticket, loop.time())
        except Shed as exc:
            upstream.admission(labels, REJECTED_CAPACITY, admitted)
            self.observer.rejected(prepared, exc)
            raise
        upstream.admission(labels, NOT_YET_FINALIZED, admitted)
        upstream.waiting(labels, prepared.size, +1)
        outcome = REJECTED_OTHER
        try:
            routed = await self._answer(ticket.future)
            outcome = DISPATCHED
        except TimeoutError:
            outcome = EVICTED_TTL
            raise self._expired(prepared, waiting, loop) from None
        except asyncio.CancelledError:
            outcome = EVICTED_CANCELLED
            self.flow_control.flow_metrics.outcomes.labels("cancelled").inc()
            raise
        finally:
            self.flow_control.leave(waiting)
            if not ticket.future.done():
                ticket.future.cancel()
            upstream.waiting(labels, prepared.size, -1)
            upstream.finished(labels, outcome, admitted)
        routed.waited_s = loop.time() - waiting.enqueued_at
        flow_metrics = self.flow_control.flow_metrics
        flow_metrics.wait_seconds.observe(routed.waited_s)
        flow_metrics.outcomes.labels("dispatched").inc()
        return routed

    async def _answer(self, future: asyncio.Future[RoutedRequest]) -> RoutedRequest:
        """The waiting request's answer within its TTL (TimeoutError past it)."""
        try:
            try:
                return await asyncio.wait_for(
                    asyncio.shield(future), self.flow_control.config.ttl_s
                )
            except TimeoutError:
                if not future.done() or future.cancelled() or future.exception() is not None:
                    raise
                return future.result()  # dispatched at the very moment the TTL ran out
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.complete(future.result().token, None)  # routed, but nobody will send it
            raise

    def _expired(
        self,
        prepared: PreparedRequest,
        waiting: Waiting[Ticket],
        loop: asyncio.AbstractEventLoop,
    ) -> RequestRejected:
        flow = self.flow_control
        rejected = flow.expiry_refusal()
        flow.flow_metrics.wait_seconds.observe(loop.time() - waiting.enqueued_at)
        self.observer.rejected(prepared, rejected)
        return rejected

    @property
    def waiting(self) -> int:
        return len(self.flow_control)

    def release_waiting(self, min_priority: int | None = None) -> int:
        """One release pass now (FlowControl.release)."""
        return self.flow_control.release(min_priority)

    # -- completion --------------------------------------------------------------------
    def complete(
        self,
        token: str | RoutedRequest,
        status: int | None,
        served_address: str | None = None,
        first_byte_at: float | None = None,
        response_bytes: int | None = None,
    ) -> None:
        """The response finished (or the stream ended): release the reservation once.
        `first_byte_at` (time.perf_counter() at the response's first byte) and
        `response_bytes`, when the access log or the observer reported them, feed the
        upstream series."""
        if isinstance(token, RoutedRequest):
            token = token.token
        self.accounting.complete(token, status, served_address, first_byte_at, response_bytes)


def retry_after_header(seconds: float | None) -> str | None:
    """The Retry-After value (whole seconds, at least 1) for a refusal, if any."""
    if seconds is None:
        return None
    return str(max(1, math.ceil(seconds)))


__all__ = ["FutureTicket", "Router", "retry_after_header"]
