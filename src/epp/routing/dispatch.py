"""Dispatch: filter, score and pick a pod for a prepared request now, and reserve it.

`dispatch(prepared) -> RoutedRequest`; raises Saturated when every candidate pod is
saturated (flow control decides: wait or refuse) and RequestRejected for every other
refusal. In order: the prefix index's match -> the scheduler's decision -> the
reservation (accounting) -> the prompt's blocks recorded on the chosen pod (approximate
mode: it now holds them) -> the scorers' own state (`Scheduler.observe`) -> observation
-> the decision shared (hooks). Once reserved, a failure before the request is routed
releases the reservation; a failure after it (metrics, logs, a hook) never fails it.
"""

from __future__ import annotations

import contextlib
import time

import structlog

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.store import EndpointStore
from epp.observability.upstream import UpstreamMetrics
from epp.prefix.index import PrefixIndex
from epp.request import RequestRejected
from epp.routing.accounting import Accounting
from epp.routing.observation import DecisionObserver, best_match
from epp.routing.types import SATURATED, DecisionHooks, PreparedRequest, RoutedRequest, Saturated
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Decision, Dispatched, SchedulingError, SchedulingRequest

log = structlog.get_logger("epp.routing")


class Dispatcher:
    def __init__(
        self,
        store: EndpointStore,
        index: PrefixIndex,
        scheduler: Scheduler,
        accounting: Accounting,
        observer: DecisionObserver,
        upstream: UpstreamMetrics,
        hooks: DecisionHooks,
        block_size: int,
    ) -> None:
        self._store = store  # read: the candidates and the clock
        self._index = index
        self._scheduler = scheduler
        self._accounting = accounting
        self._observer = observer
        self._upstream = upstream
        self._hooks = hooks
        self._block_size = block_size

    def dispatch(self, prepared: PreparedRequest) -> RoutedRequest:
        """Choose the pod now and reserve it (module docstring)."""
        sched = self._scheduling_request(prepared)
        schedule_start = time.perf_counter()
        decision = self._schedule(prepared, sched)
        chosen = decision.primary
        matched = sched.prefix_match.get(chosen.name, 0)
        uncached = max(0, prepared.prompt_tokens - matched * self._block_size)
        seq = self._accounting.reserve(chosen, uncached)
        try:
            routed, event = self._commit(prepared, sched, decision, seq, matched)
        except BaseException:
            self._accounting.release(chosen, seq)  # nothing may leak a reservation
            raise
        try:
            self._observe(prepared, sched, decision, seq, uncached, schedule_start)
        except Exception:  # metrics or logging must never cost a routed request
            with contextlib.suppress(Exception):
                log.exception("observe_failed", request_id=prepared.request_id)
        self._share(event, uncached, prepared.request_id)
        return routed

    def _scheduling_request(self, prepared: PreparedRequest) -> SchedulingRequest:
        hashes = prepared.hashes
        return SchedulingRequest(
            request_id=prepared.request_id,
            model=prepared.served_model,
            base_model=prepared.base_model,
            adapter=prepared.adapter,
            block_hashes=hashes,
            prefix_match=self._index.match(hashes) if hashes else {},
            subset=prepared.subset,
            prompt_tokens=prepared.prompt_tokens,
            block_size=self._block_size,
            now=self._store.now(),
        )

    def _schedule(self, prepared: PreparedRequest, sched: SchedulingRequest) -> Decision:
        try:
            return self._scheduler.schedule(sched, self._store.all())
        except SchedulingError as exc:
            self._upstream.schedule_failed(prepared.upstream)
            kind = Saturated if exc.reason == SATURATED else RequestRejected
            raise kind(
                exc.status,
                exc.message,
                reason=exc.reason,
                param="model" if exc.status == 404 else None,
            ) from None

    def _commit(
        self,
        prepared: PreparedRequest,
        sched: SchedulingRequest,
        decision: Decision,
        seq: int,
        matched: int,
    ) -> tuple[RoutedRequest, Dispatched]:
        """Everything that makes the reserved decision the routed one."""
        chosen = decision.primary
        token = self._accounting.new_token()
        if prepared.hashes:
            self._record(token, chosen, sched, matched)
        # Scorer state: `prefix_match` is still the match the scorers saw.
        event = Dispatched(sched, chosen)
        self._scheduler.observe(event)
        routed = RoutedRequest(
            prepared.request_id, decision, prepared.request, prepared.prompt_tokens, token,
            seq, prepared.priority, body=prepared.body, upstream=prepared.upstream,
        )  # fmt: skip
        self._accounting.opened(routed)
        return routed, event

    def _record(self, token: str, chosen: Endpoint, sched: SchedulingRequest, matched: int) -> None:
        """The chosen pod now holds the prompt's blocks (the index's prediction)."""
        hooks = self._hooks
        for listener in hooks.before_record:
            try:
                listener(token, chosen.name, sched.block_hashes, matched, sched.prompt_tokens,
                         sched.now)  # fmt: skip
            except Exception:  # never costs the request
                with contextlib.suppress(Exception):
                    log.exception("record_listener_failed", request_id=sched.request_id)
        # A precise pod's predicted entries live while the request is in flight: its end
        # reaches the index through the completion hooks.
        live = token if hooks.completed else None
        self._index.record(chosen.name, sched.block_hashes, token=live)

    def _observe(
        self,
        prepared: PreparedRequest,
        sched: SchedulingRequest,
        decision: Decision,
        seq: int,
        uncached: int,
        schedule_start: float,
    ) -> None:
        now = time.perf_counter()
        self._observer.routed(prepared, sched, decision, (now - prepared.started) * 1e6, seq)
        self._upstream.routed(
            prepared.upstream, decision.primary, size=prepared.size,
            prompt_tokens=prepared.prompt_tokens, uncached_tokens=uncached,
            schedule_s=now - schedule_start, best_match=best_match(sched),
        )  # fmt: skip

    def _share(self, event: Dispatched, uncached: int, request_id: str) -> None:
        for listener in self._hooks.shared:
            try:
                listener(event, uncached)
            except Exception:  # nor may sharing it with peer replicas
                with contextlib.suppress(Exception):
                    log.exception("dispatch_listener_failed", request_id=request_id)
