"""Accounting: the reservations of routed requests, from dispatch to completion.

The only module of the routing package that changes Endpoint state. It does so through
the endpoint store's request-lifecycle methods, which own the arithmetic:
`EndpointStore.dispatched` (a reservation: in_flight, in_flight_tokens, the open
dispatch), `EndpointStore.completed` (its release) and `EndpointStore.record_status`
(the error rate a fallback's answer feeds). The other routing components read
endpoints and hand their writes here.

Invariants:
- every reservation is released exactly once: by `complete` (the response ended), by
  `release` (the dispatch failed after reserving), or by the store itself (a page
  showed the request over, or its in-flight TTL passed; `forget_dropped` then drops the
  route token);
- a route token names one open request of this router; a token with another replica's
  prefix goes to `hooks.foreign_completion`;
- an open request keeps only what its completion needs (`OpenRequest`: a few hundred
  bytes), never its decision (a list of scores per scorer, O(pods)) nor the parsed request;
- the open requests are indexed by pod, each pod's in dispatch order: the store drops a
  pod's reservations oldest first (`ledger.reconcile`, `ledger.expire`), so the dropped
  ones are a prefix of that order, and the maintenance round visits each pod with open
  requests once plus what was dropped; a removed pod's requests are found without the
  others'.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass

import structlog

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.observability.upstream import RequestLabels
from epp.routing.types import DecisionHooks, RoutedRequest
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Completed, Removed

log = structlog.get_logger("epp.routing")


@dataclass(slots=True)
class OpenRequest:
    """A routed request not yet ended: what its completion reads (the reservation to
    release, the upstream series' labels, the request id for a listener's failure)."""

    request_id: str
    endpoint: Endpoint
    dispatch: int  # the endpoint's dispatch number
    upstream: RequestLabels | None


class RandomHex:
    """12 random bytes (24 hex digits) a call, as `secrets.token_hex(12)` gives them, read
    from the OS 256 tokens at a time: one getrandom call instead of one a request. The
    buffer belongs to the process that filled it (a forked child refills its own)."""

    __slots__ = ("_at", "_digits", "_pid")

    TOKEN_BYTES = 12
    BATCH = 256

    def __init__(self) -> None:
        self._digits = ""
        self._at = 0
        self._pid = 0

    def take(self) -> str:
        at = self._at
        if at >= len(self._digits) or self._pid != os.getpid():
            self._digits = secrets.token_hex(self.TOKEN_BYTES * self.BATCH)
            self._pid = os.getpid()
            at = 0
        end = at + 2 * self.TOKEN_BYTES
        self._at = end
        return self._digits[at:end]


class Accounting:
    def __init__(
        self,
        store: EndpointStore,
        scheduler: Scheduler,
        metrics: EppMetrics,
        hooks: DecisionHooks,
    ) -> None:
        self._store = store
        self._scheduler = scheduler
        self._metrics = metrics
        self._hooks = hooks
        self._random = RandomHex()
        self._open: dict[str, OpenRequest] = {}  # route token -> routed, not yet ended
        # pod -> dispatch number -> route token of its open requests, oldest first
        self._by_pod: dict[Endpoint, dict[int, str]] = {}

    # -- dispatch ----------------------------------------------------------------------
    def reserve(self, endpoint: Endpoint, uncached_tokens: int) -> int:
        """Count a request on the pod at once (its load figures include it for the very
        next decision); returns the dispatch number that releases it."""
        return self._store.dispatched(endpoint, uncached_tokens)

    def release(self, endpoint: Endpoint, dispatch: int) -> None:
        """Undo a reservation whose dispatch failed before the request was routed."""
        self._store.completed(endpoint, None, dispatch)

    def new_token(self) -> str:
        """An unguessable route token, prefixed with this replica's name (if any)."""
        return self._hooks.token_prefix + self._random.take()

    def opened(self, routed: RoutedRequest) -> None:
        endpoint, dispatch = routed.endpoint, routed.dispatch
        self._open[routed.token] = OpenRequest(
            routed.request_id, endpoint, dispatch, routed.upstream
        )
        pod = self._by_pod.get(endpoint)
        if pod is None:
            pod = self._by_pod[endpoint] = {}
        pod[dispatch] = routed.token  # dispatch numbers grow: the dict stays oldest first

    # -- completion --------------------------------------------------------------------
    def complete(
        self,
        token: str,
        status: int | None,
        served_address: str | None = None,
        first_byte_at: float | None = None,
        response_bytes: int | None = None,
    ) -> None:
        """The response ended (or its stream did): release the reservation once."""
        routed = self._open.pop(token, None)
        hooks = self._hooks
        if routed is None:
            if hooks.foreign_completion is not None and not token.startswith(hooks.token_prefix):
                # The report of a response end (an access-log stream pinned to one replica,
                # or an observer stream balanced apart from the routing stream) may reach
                # another replica: this end belongs to the replica named in the token.
                hooks.foreign_completion(token, status, served_address)
            return
        pod = self._by_pod.get(routed.endpoint)
        if pod is not None:
            pod.pop(routed.dispatch, None)
            if not pod:
                del self._by_pod[routed.endpoint]
        with contextlib.suppress(Exception):  # metrics never cost the bookkeeping
            self._metrics.upstream.completed(routed.upstream, status, first_byte_at, response_bytes)
        if hooks.completed:
            self._tell_completed(token, routed.request_id)
        self._settle(routed, status, served_address)

    def _tell_completed(self, token: str, request_id: str) -> None:
        now = self._store.now()
        for listener in self._hooks.completed:
            try:
                listener(token, now)
            except Exception:
                with contextlib.suppress(Exception):
                    log.exception("completion_listener_failed", request_id=request_id)

    def _settle(self, routed: OpenRequest, status: int | None, served: str | None) -> None:
        endpoint = routed.endpoint
        if served and served != endpoint.address:
            # The gateway retried on a fallback: the primary refused, the fallback served.
            self._metrics.fallback_served.inc()
            took = self._store.completed(endpoint, 503, routed.dispatch)
            self._scheduler.observe(Completed(endpoint, 503, took))
            fallback = self._store.by_address(served)
            if fallback is not None:
                self._store.record_status(fallback, status)
            return
        took = self._store.completed(endpoint, status, routed.dispatch)
        self._scheduler.observe(Completed(endpoint, status, took))

    # -- pods and time -----------------------------------------------------------------
    def pod_removed(self, endpoint: Endpoint) -> None:
        """A removed pod's open requests and scorer state are forgotten."""
        for token in self._by_pod.pop(endpoint, {}).values():
            self._open.pop(token, None)
        self._scheduler.observe(Removed(endpoint))

    def forget_dropped(self) -> None:
        """Forget the route tokens whose reservation the store dropped (a page showed the
        request over, or its in-flight TTL passed): their completion changes nothing.
        Visits each pod with open requests once, plus the dropped ones: the store drops a
        pod's reservations oldest first, so they lead the pod's dispatch order."""
        emptied: list[Endpoint] = []
        for endpoint, pod in self._by_pod.items():
            still_open = endpoint.open
            dropped: list[int] = []
            for dispatch in pod:
                if dispatch in still_open:
                    break
                dropped.append(dispatch)
            if not dropped:
                continue
            for dispatch in dropped:
                self._open.pop(pod.pop(dispatch), None)
            if not pod:
                emptied.append(endpoint)
        for endpoint in emptied:
            del self._by_pod[endpoint]

    def open_labels(self) -> list[RequestLabels]:
        """The upstream labels of the requests routed and not yet ended (scrape time)."""
        return [r.upstream for r in self._open.values() if r.upstream is not None]
