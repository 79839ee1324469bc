"""One routing decision from end to end, independent of the transport.

prepare: parse body -> tokenize -> chained block hashes -> model, adapter and priority.
dispatch: prefix index lookup -> scheduler -> reserve the pod (its load figures include
the request at once) -> record (approximate mode: the chosen pod now holds the prompt's
blocks) -> metrics/log.
When scheduling finds every candidate saturated, `route` hands the request to admission
(scheduling/admission.py): refused if sheddable, else it waits and is dispatched as soon
as a pod has room. `complete` (by the request's token) releases the reservation.
Scorers with per-pod state of their own hear of each dispatch, completion and removed pod
through the scheduler (`Scheduler.observe`, the contract in scheduling/types.py).

The Router subscribes to nothing: the app connects the endpoint store's events to it
(`on_endpoint_change`) and to the prefix index (`epp.app.connect`). It does no I/O of
its own either: with peer replicas (epp/replicas) the app adds a `dispatch_listeners`
entry (each decision is shared), a `token_prefix` naming this replica in route tokens,
and `foreign_completion` (a response end seen here for a decision another replica made).
In precise mode (KV events) the app adds `record_listeners` (each decision on a precise
pod opens a stale-routing claim before its blocks are recorded) and
`completion_listeners` (the claim is checked after the response ended).

The ext_proc server awaits `route` and calls `complete`; the virtual-time benchmark and
tests call `route_now`, the same path without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import time
from array import array
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import structlog

from epp.config import EppConfig
from epp.datalayer.discovery.models import ModelTable
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.store import EndpointStore
from epp.observability.flow_metrics import FlowMetrics
from epp.observability.logs import TRACE, effective_level, trace
from epp.observability.metrics import EppMetrics
from epp.observability.upstream import (
    DISPATCHED,
    EVICTED_CANCELLED,
    EVICTED_TTL,
    NOT_YET_FINALIZED,
    REJECTED_CAPACITY,
    REJECTED_OTHER,
    RequestLabels,
)
from epp.prefix.blocks import PromptBlocks, prompt_blocks
from epp.prefix.hashing import BlockHash, block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import InferenceRequest, RequestRejected, parse_request, with_model
from epp.scheduling.admission import FlowQueue, Offer, Waiting, request_priority
from epp.scheduling.models import resolve_model
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import (
    Completed,
    Decision,
    Dispatched,
    Removed,
    SchedulingError,
    SchedulingRequest,
)
from epp.tokenization import TokenizerRegistry
from epp.tokenization.engine import EngineTokenizer
from epp.tokenize import Tokenizer

log = structlog.get_logger("epp.routing")

SATURATED = "rejected-saturated"

# The pods a waiting request may use (`Router._placement`): its base model, the subset hint.
Placement = tuple[str | None, frozenset[str] | None]
# (the dispatch as the scorers saw it, uncached prompt tokens reserved on the pod)
DispatchListener = Callable[[Dispatched, int], None]
# (route token, pod name, the prompt's block hashes, leading blocks the index matched on
# the pod, prompt tokens, store time): called before the blocks are recorded in the index
RecordListener = Callable[[str, str, Sequence[BlockHash], int, int, float], object]
# (route token, store time) of a decision of this Router whose response ended
CompletionListener = Callable[[str, float], None]
# (route token, status, served address) of a decision this Router did not make
ForeignCompletion = Callable[[str, int | None, str | None], None]


class Saturated(RequestRejected):
    """Every candidate pod is saturated: admission decides (wait or refuse)."""


@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    decision: Decision
    request: InferenceRequest
    prompt_tokens: int
    token: str = ""  # names this request in `complete`; unguessable
    dispatch: int = 0  # the endpoint's dispatch number, to release its reservation
    priority: int = 0
    waited_s: float = 0.0
    done: bool = False
    # The body to forward instead of the client's: set when the model table (an
    # InferenceModel's targetModels) serves the request as another model.
    body: bytes | None = None
    upstream: RequestLabels | None = None  # the upstream series' labels (observability)

    @property
    def endpoint(self) -> Endpoint:
        return self.decision.primary


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A parsed request and the models it resolved to, before tokenizing."""

    path: str
    request: InferenceRequest
    served: str | None  # the model the pod serves it as
    body: bytes | None  # the body naming `served`, when the model table rewrote it
    base: str | None
    adapter: str | None


@dataclass(slots=True)
class PreparedRequest:
    """A parsed, hashed request ready to be scheduled (now, or after waiting)."""

    request_id: str
    request: InferenceRequest
    base_model: str | None
    adapter: str | None
    hashes: list[BlockHash]
    prompt_tokens: int
    subset: frozenset[str] | None
    priority: int
    size: int
    started: float = field(default_factory=time.perf_counter)
    # The model the pod serves it as (a target of the model table), and the body naming it.
    served_model: str | None = None
    body: bytes | None = None
    log_level: int = logging.INFO  # decided once per request, in prepare
    upstream: RequestLabels | None = None  # the upstream series' labels (observability)


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
        self._config = config
        # The log level is decided once per request (prepare): at INFO one line, nothing
        # per endpoint; the breakdown (DEBUG) and block detail (TRACE) are not even built
        # otherwise. `debug` forces DEBUG detail whatever the logger's level.
        self._debug = debug
        self._tie = config.scheduling.tie_epsilon
        self._store = store
        self._index = index
        self._scheduler = scheduler
        # One tokenizer per base model (config `tokenizers:`), the fallback for the others.
        self._tokenizers = (
            tokenizer
            if isinstance(tokenizer, TokenizerRegistry)
            else TokenizerRegistry(fallback=tokenizer)
        )
        self._metrics = metrics
        self._flow_metrics = FlowMetrics(metrics.registry)
        self._block_size = config.prefix.block_size
        self._max_blocks = config.prefix.max_blocks_per_request
        flow = config.flow_control
        self._flow = flow
        self._waiting: FlowQueue[tuple[PreparedRequest, asyncio.Future[RoutedRequest]]] = FlowQueue(
            flow.max_requests, flow.max_bytes
        )
        self._open: dict[str, RoutedRequest] = {}
        # A release pass is due (room may have returned since the last one).
        self._release_pending = False
        # Placements (`_placement`) known to have no room since room last returned. Every
        # waiting request's placement is in it unless a release pass is due: a request
        # whose placement is in it may wait at once, without a scheduling attempt.
        self._full: set[Hashable] = set()
        self._models = ModelTable()
        self._rng = random.Random()
        # Connected by the app for peer replicas (module docstring); no I/O may happen in
        # a listener (it runs on the routing path), and its failure never fails a request.
        self.dispatch_listeners: list[DispatchListener] = []
        # Connected by the app in precise mode (stale routing checked from KV events): the
        # same rules as dispatch_listeners.
        self.record_listeners: list[RecordListener] = []
        self.completion_listeners: list[CompletionListener] = []
        self.token_prefix = ""
        self.foreign_completion: ForeignCompletion | None = None
        # Set by the app when a model's tokenizer is the engine (`tokenizers:` with
        # `source: engine`): `route` then asks a pod for those models' ids. route_now
        # (benchmarks, tests) keeps the local path.
        self.engine_tokenizer: EngineTokenizer | None = None
        # The upstream series (observability/upstream.py) read open requests at scrape time.
        metrics.upstream.configure(
            pool=config.discovery.pool_name,
            namespace=config.discovery.pool_namespace,
            flow_enabled=flow.enabled,
        )
        metrics.upstream.watch(open_requests=self._open_labels, prefix_size=lambda: index.nodes)

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def set_model_table(self, table: ModelTable) -> None:
        """Models from InferenceModel / InferenceObjective / InferenceModelRewrite objects
        (Kubernetes discovery): priorities, and target models chosen by weight. Replaces
        the previous table."""
        for problem in table.problems:
            log.warning("model_table_problem", problem=problem)
        self._models = table
        log.info("model_table", models=len(table.models), objectives=len(table.objectives))

    # -- data-layer events (connected by the app) -----------------------------------
    def on_endpoint_change(self, event: str, endpoint: Endpoint) -> None:
        """An endpoint store event (EndpointStore.on_change): a removed pod's open requests
        and scorer state are forgotten; a pod with room may take waiting requests."""
        self._metrics.on_endpoint_change(event, endpoint)
        if event == "removed":
            for token in [t for t, r in self._open.items() if r.endpoint is endpoint]:
                del self._open[token]
            self._scheduler.observe(Removed(endpoint))
        elif event in ("released", "updated", "added"):
            self._room_may_have_returned(endpoint)
            if len(self._waiting):
                self._schedule_release()

    def _room_may_have_returned(self, endpoint: Endpoint) -> None:
        """Forget that the placements of this pod's model were full. Room on a pod returns
        to its model's placements only: what the filters read is the pod's own state,
        except the health floor, which is per model (one pod excluded can let another of
        its model back in)."""
        if not self._full:
            return
        model = endpoint.model
        if model is None:
            self._full.clear()  # a pod of unknown model is a candidate for every model
            return
        self._full = {key for key in self._full if cast(Placement, key)[0] not in (None, model)}

    # -- the decision -------------------------------------------------------------
    def prepare(
        self,
        *,
        path: str,
        body: bytes,
        request_id: str,
        subset: frozenset[str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> PreparedRequest:
        """Parse, tokenize and hash one request (raises RequestRejected for bad input)."""
        started = time.perf_counter()
        parsed = self._parse(path, body, headers)
        return self._prepared(parsed, body, request_id, subset, headers, started)

    def _parse(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> _Parsed:
        request = parse_request(
            path, body, self._config.adapters, max_prompt_tokens=self._max_blocks * self._block_size
        )
        served, rewritten = request.model, None
        if request.model is not None:
            # InferenceModelRewrite / InferenceModel targets / the rewrite header
            # (ModelTable.target): the body's model is rewritten before Envoy forwards it.
            served = self._models.target(request.model, self._rng.random(), headers)
            if served != request.model:
                rewritten = with_model(body, served)
        base, adapter = resolve_model(served, self._config.adapters, self._store.all())
        return _Parsed(path, request, served, rewritten, base, adapter)

    def _prepared(
        self,
        parsed: _Parsed,
        body: bytes,
        request_id: str,
        subset: frozenset[str] | None,
        headers: Mapping[str, str] | None,
        started: float,
        engine_ids: array | None = None,
    ) -> PreparedRequest:
        path, request, served, rewritten = parsed.path, parsed.request, parsed.served, parsed.body
        base, adapter = parsed.base, parsed.adapter
        seed = chain_seed(served or "", adapter, request.cache_salt)
        # Bounded work: at most prefix.max_blocks_per_request blocks are tokenized, hashed,
        # looked up and recorded, whatever the prompt's size (prefix/blocks.py).
        if engine_ids is not None:
            # The engine tokenized the prompt (tokenization/engine.py): its ids, its count,
            # plus what the parser left out of a very long conversation (estimated).
            blocks = PromptBlocks(
                len(engine_ids) + request.prompt.omitted_tokens,
                block_hashes(engine_ids, self._block_size, seed, self._max_blocks),
                self._block_size,
                request.prompt.omitted_tokens == 0,
            )
        else:
            tokenizer = self._tokenizers.for_model(base or served)
            blocks = prompt_blocks(
                request.prompt, tokenizer, self._block_size, seed, self._max_blocks
            )
        flow = self._flow
        priority = self._models.priority(
            request.model,
            headers or {},
            own=flow.priorities.get(request.model) if request.model is not None else None,
            may_raise=flow.objective_may_raise,
        )
        if priority is None:
            priority = request_priority(request.model, headers or {}, self._flow)
        level = effective_level(log)
        if self._debug and level > logging.DEBUG:
            level = logging.DEBUG
        if level <= logging.DEBUG:
            log.debug(
                "request_received",
                request_id=request_id,
                path=path,
                model=_short(request.model),
                adapter=_short(adapter),
                input_tokens=blocks.prompt_tokens,
                blocks=len(blocks.hashes),
                priority=priority,
                body_bytes=len(body),
            )
        prepared = PreparedRequest(
            request_id, request, base, adapter, blocks.hashes, blocks.prompt_tokens, subset,
            priority, len(body), started, served, rewritten, level,
        )  # fmt: skip
        prepared.upstream = self._metrics.upstream.request(
            request.model, served, priority, headers or {}, request.stream, started
        )
        return prepared

    def dispatch(self, prepared: PreparedRequest) -> RoutedRequest:
        """Choose the pod now and reserve it. Raises Saturated when every candidate is
        saturated, RequestRejected for every other refusal."""
        request = prepared.request
        hashes = prepared.hashes
        sched_request = SchedulingRequest(
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
        schedule_start = time.perf_counter()
        try:
            decision = self._scheduler.schedule(sched_request, self._store.all())
        except SchedulingError as exc:
            self._metrics.upstream.schedule_failed(prepared.upstream)
            kind = Saturated if exc.reason == SATURATED else RequestRejected
            raise kind(
                exc.status,
                exc.message,
                reason=exc.reason,
                param="model" if exc.status == 404 else None,
            ) from None
        chosen = decision.primary
        matched = sched_request.prefix_match.get(chosen.name, 0)
        uncached = max(0, prepared.prompt_tokens - matched * self._block_size)
        seq = self._store.dispatched(chosen, uncached)
        try:
            token = self.token_prefix + secrets.token_hex(12)
            if hashes:
                if self.record_listeners:
                    self._before_record(token, chosen.name, sched_request, matched)
                # A precise pod's predicted entries live while the request is in flight:
                # its end reaches the index through the completion listeners.
                live = token if self.completion_listeners else None
                self._index.record(chosen.name, hashes, token=live)
            # Scorer state: `prefix_match` is still the match the scorers saw.
            event = Dispatched(sched_request, chosen)
            self._scheduler.observe(event)
            routed = RoutedRequest(
                prepared.request_id, decision, request, prepared.prompt_tokens, token, seq,
                prepared.priority, body=prepared.body, upstream=prepared.upstream,
            )  # fmt: skip
            self._open[token] = routed
        except BaseException:
            self._store.completed(chosen, None, seq)  # nothing may leak a reservation
            raise
        try:
            now = time.perf_counter()
            elapsed_us = (now - prepared.started) * 1e6
            self._observe(prepared, sched_request, decision, elapsed_us, seq)
            self._metrics.upstream.routed(
                prepared.upstream, chosen, size=prepared.size,
                prompt_tokens=prepared.prompt_tokens, uncached_tokens=uncached,
                schedule_s=now - schedule_start, best_match=self._best_match(sched_request),
            )  # fmt: skip
        except Exception:  # metrics or logging must never cost a routed request
            with contextlib.suppress(Exception):
                log.exception("observe_failed", request_id=prepared.request_id)
        for listener in self.dispatch_listeners:
            try:
                listener(event, uncached)
            except Exception:  # nor may sharing it with peer replicas
                with contextlib.suppress(Exception):
                    log.exception("dispatch_listener_failed", request_id=prepared.request_id)
        return routed

    def _before_record(self, token: str, pod: str, sched: SchedulingRequest, matched: int) -> None:
        for listener in self.record_listeners:
            try:
                listener(token, pod, sched.block_hashes, matched, sched.prompt_tokens, sched.now)
            except Exception:  # never costs the request
                with contextlib.suppress(Exception):
                    log.exception("record_listener_failed", request_id=sched.request_id)

    def route_now(
        self,
        *,
        path: str,
        body: bytes,
        request_id: str,
        subset: frozenset[str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> RoutedRequest:
        """Route without waiting: a saturated pool is a 429 (benchmarks, tests)."""
        prepared = self.prepare(
            path=path, body=body, request_id=request_id, subset=subset, headers=headers
        )
        try:
            return self.dispatch(prepared)
        except RequestRejected as exc:
            self._count_rejection(prepared, exc)
            raise

    async def route(
        self,
        *,
        path: str,
        body: bytes,
        request_id: str,
        subset: frozenset[str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> RoutedRequest:
        """Route one request, waiting in admission while the pool is saturated."""
        engine = self.engine_tokenizer
        if engine is None:
            prepared = self.prepare(
                path=path, body=body, request_id=request_id, subset=subset, headers=headers
            )
        else:
            prepared = await self._prepare_with_engine(
                engine, path, body, request_id, subset, headers
            )
        admitted = time.perf_counter()
        try:
            if self._waiting.ranks_at_least(prepared.priority):
                # Waiting requests of this rank or higher choose first (the queue's
                # invariant, scheduling/admission.py): no overtaking them on a pod they
                # may use, and no waiting behind one whose pods this one does not need.
                if self._release_pending:
                    self.release_waiting(min_priority=prepared.priority)
                if self._placement(prepared) in self._full:
                    raise Saturated(429, "requests are waiting for capacity", reason=SATURATED)
            routed = self._dispatch_or_mark_full(prepared)
            self._metrics.upstream.admission(prepared.upstream, DISPATCHED, admitted)
            return routed
        except Saturated as exc:
            return await self._admit(prepared, exc)
        except RequestRejected as exc:
            self._count_rejection(prepared, exc)
            raise

    async def _prepare_with_engine(
        self,
        engine: EngineTokenizer,
        path: str,
        body: bytes,
        request_id: str,
        subset: frozenset[str] | None,
        headers: Mapping[str, str] | None,
    ) -> PreparedRequest:
        """`prepare`, with the prompt's ids asked of a pod first when the model's
        tokenizer is the engine (`source: engine`); the local path if that fails."""
        started = time.perf_counter()
        parsed = self._parse(path, body, headers)
        model = parsed.base or parsed.served
        ids = None
        if model is not None and engine.wants(model):
            ids = await engine.tokenize(model, parsed.served or model, parsed.request.prompt)
        return self._prepared(parsed, body, request_id, subset, headers, started, ids)

    # -- admission ------------------------------------------------------------------
    @staticmethod
    def _placement(prepared: PreparedRequest) -> Placement:
        """The pods a request may use, as a key: what the scheduler's filters read of the
        request (model filter: base model; subset filter: the proxy's hint). The other
        filters (health, saturation) read only the pods."""
        return (prepared.base_model, prepared.subset)

    def _dispatch_or_mark_full(self, prepared: PreparedRequest) -> RoutedRequest:
        try:
            return self.dispatch(prepared)
        except Saturated:
            self._full.add(self._placement(prepared))
            raise

    def _refuse(self, prepared: PreparedRequest, message: str, reason: str) -> RequestRejected:
        retry = self._flow.retry_after_s
        rejected = RequestRejected(429, message, reason=reason, retry_after_s=retry)
        self._count_rejection(prepared, rejected)
        return rejected

    async def _admit(self, prepared: PreparedRequest, saturated: Saturated) -> RoutedRequest:
        flow = self._flow
        outcomes = self._flow_metrics.outcomes
        upstream, labels, admitted = self._metrics.upstream, prepared.upstream, time.perf_counter()
        if not flow.enabled or prepared.priority < 0:
            outcomes.labels("rejected-saturated").inc()
            upstream.admission(labels, REJECTED_CAPACITY, admitted)
            raise self._refuse(
                prepared, "every endpoint is saturated; retry later", SATURATED
            ) from None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RoutedRequest] = loop.create_future()
        now = loop.time()
        waiting = Waiting(
            (prepared, future),
            prepared.priority,
            prepared.request.model or "",
            # What the wait holds: the body, and the copy naming a target model if any.
            prepared.size + len(prepared.body or b""),
            now,
            now + flow.ttl_s,
            placement=self._placement(prepared),
        )
        if not self._waiting.push(waiting):
            outcomes.labels("rejected-saturated").inc()
            upstream.admission(labels, REJECTED_CAPACITY, admitted)
            raise self._refuse(
                prepared, "every endpoint is saturated and the EPP's queue is full", SATURATED
            ) from None
        upstream.admission(labels, NOT_YET_FINALIZED, admitted)
        upstream.waiting(labels, prepared.size, +1)
        self._update_queue_gauges()
        outcome = REJECTED_OTHER
        try:
            try:
                routed = await asyncio.wait_for(asyncio.shield(future), flow.ttl_s)
            except TimeoutError:
                if not future.done() or future.cancelled() or future.exception() is not None:
                    raise
                routed = future.result()  # dispatched at the very moment the TTL ran out
        except TimeoutError:
            outcome = EVICTED_TTL
            outcomes.labels("rejected-ttl-expired").inc()
            self._flow_metrics.wait_seconds.observe(loop.time() - now)
            raise self._refuse(
                prepared,
                f"no endpoint had capacity within {flow.ttl_s:g} s; retry later",
                "rejected-ttl-expired",
            ) from None
        except asyncio.CancelledError:
            outcome = EVICTED_CANCELLED
            outcomes.labels("cancelled").inc()
            if future.done() and not future.cancelled() and future.exception() is None:
                self.complete(future.result().token, None)  # routed, but nobody will send it
            raise
        else:
            outcome = DISPATCHED
        finally:
            self._waiting.remove(waiting)
            if not future.done():
                future.cancel()
            self._update_queue_gauges()
            upstream.waiting(labels, prepared.size, -1)
            upstream.finished(labels, outcome, admitted)
        routed.waited_s = loop.time() - now
        self._flow_metrics.wait_seconds.observe(routed.waited_s)
        outcomes.labels("dispatched").inc()
        return routed

    def _schedule_release(self) -> None:
        if self._release_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a test driving the store directly): nobody can be waiting
        self._release_pending = True
        loop.call_soon(self._release_soon)

    def _release_soon(self) -> None:
        # A loop callback: an exception here would reach only asyncio's handler.
        try:
            self.release_waiting()
        except Exception as exc:
            self._metrics.background.failed("queue-release", exc)

    def release_waiting(self, min_priority: int | None = None) -> int:
        """One release pass (FlowQueue.release): dispatch waiting requests, as many as
        pods have room for; returns how many went. With `min_priority`, only those of
        that priority or higher (a newer request's turn comes after them), and the full
        pass stays due. A request whose dispatch raised gets that exception (its stream
        answers 500 internal-error); the pass goes on with the others."""
        if min_priority is None:
            self._release_pending = False
        cycle_start = time.perf_counter()
        released = self._waiting.release(self._offer, self._full, min_priority)
        self._update_queue_gauges()
        if len(self._waiting) or released:
            self._metrics.upstream.dispatch_cycle(time.perf_counter() - cycle_start)
        return released

    def _offer(
        self, waiting: Waiting[tuple[PreparedRequest, asyncio.Future[RoutedRequest]]]
    ) -> Offer:
        prepared, future = waiting.item
        if future.done():
            return Offer.LEFT  # given up (its `_admit` takes it out too)
        try:
            routed = self.dispatch(prepared)
        except Saturated:
            return Offer.NO_ROOM
        except Exception as exc:  # a refusal, or a bug (a scorer's): this request's answer
            self._flow_metrics.outcomes.labels("failed").inc()
            future.set_exception(exc)
            return Offer.LEFT
        future.set_result(routed)
        return Offer.PLACED

    def _update_queue_gauges(self) -> None:
        size = len(self._waiting)
        self._flow_metrics.queue_size.set(size)
        self._flow_metrics.queue_bytes.set(self._waiting.bytes)
        self._flow_metrics.saturated.set(1 if size else 0)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _open_labels(self) -> list[RequestLabels]:
        """The upstream labels of the requests routed and not yet ended (scrape time)."""
        return [r.upstream for r in self._open.values() if r.upstream is not None]

    def tick(self) -> None:
        """Periodic upkeep: retry the queue, forget reservations the store dropped. Room
        that the clock alone returns (health recovering, stale gauges no longer counted)
        raises no store event: the tick is when it is noticed."""
        self._full.clear()
        if len(self._waiting):
            self.release_waiting()
        stale = [t for t, r in self._open.items() if r.dispatch not in r.endpoint.open]
        for token in stale:
            self._open.pop(token, None)

    # -- completion -----------------------------------------------------------------
    def complete(
        self,
        token: str | RoutedRequest,
        status: int | None,
        served_address: str | None = None,
        first_byte_at: float | None = None,
        response_bytes: int | None = None,
    ) -> None:
        """The response finished (or the stream ended): release the reservation once.
        `first_byte_at` (time.perf_counter() at the response headers) and `response_bytes`
        (its content-length), when the observer saw them, feed the upstream series."""
        if isinstance(token, RoutedRequest):
            token = token.token
        routed = self._open.pop(token, None)
        if routed is None and self.foreign_completion is not None:
            if not token.startswith(self.token_prefix):
                # Envoy balances the observer stream apart from the routing stream: this
                # response end belongs to the replica named in the token.
                self.foreign_completion(token, status, served_address)
            return
        if routed is None or routed.done:
            return
        routed.done = True
        endpoint = routed.endpoint
        with contextlib.suppress(Exception):  # metrics never cost the bookkeeping
            self._metrics.upstream.completed(routed.upstream, status, first_byte_at, response_bytes)
        if self.completion_listeners:
            now = self._store.now()
            for listener in self.completion_listeners:
                try:
                    listener(token, now)
                except Exception:
                    with contextlib.suppress(Exception):
                        log.exception("completion_listener_failed", request_id=routed.request_id)
        if served_address and served_address != endpoint.address:
            # The gateway retried on a fallback: the primary refused, the fallback served.
            self._metrics.fallback_served.inc()
            took = self._store.completed(endpoint, 503, routed.dispatch)
            self._scheduler.observe(Completed(endpoint, 503, took))
            fallback = self._store.by_address(served_address)
            if fallback is not None:
                self._store.record_status(fallback, status)
            return
        took = self._store.completed(endpoint, status, routed.dispatch)
        self._scheduler.observe(Completed(endpoint, status, took))

    # -- observation -----------------------------------------------------------------
    def _count_rejection(self, prepared: PreparedRequest, exc: RequestRejected) -> None:
        self._metrics.decisions.labels(self._model_label(prepared), exc.reason).inc()
        # The ext_proc server counts the answer; the request's model labels go with it.
        self._metrics.upstream.tag(exc, prepared.upstream)
        if prepared.log_level > logging.DEBUG:
            return  # the ext_proc server logs every answer at INFO (request_answered)
        log.debug(
            "request_rejected",
            request_id=prepared.request_id,
            model=_short(prepared.request.model),
            status=exc.status,
            reason=exc.reason,
        )

    @staticmethod
    def _best_match(sched: SchedulingRequest) -> float:
        """The longest prefix any pod holds, over the prompt's blocks."""
        if not sched.total_blocks:
            return 0.0
        return max(sched.prefix_match.values(), default=0) / sched.total_blocks

    @staticmethod
    def _model_label(prepared: PreparedRequest) -> str:
        # The metric bounds the label itself (observability/labels.py): clients choose it.
        return prepared.request.model or ""

    def _observe(
        self,
        prepared: PreparedRequest,
        sched: SchedulingRequest,
        decision: Decision,
        elapsed_us: float,
        seq: int = 0,
    ) -> None:
        m = self._metrics
        request = prepared.request
        chosen = decision.primary
        block_size = sched.block_size
        matched = sched.prefix_match.get(chosen.name, 0)
        if not self._index.is_precise(chosen.name):
            # Checked later against the pod's own hit counter (observability/stale); one
            # predicting no hit still counts in the pod's token ratio there. A precise
            # pod's decisions are checked from its KV events (prefix/precise_stale).
            m.stale.dispatched(chosen, seq, matched * block_size, sched.prompt_tokens, block_size)
        cache = decision.factor("cache")
        best = (
            max(sched.prefix_match.values(), default=0) / sched.total_blocks
            if sched.total_blocks
            else 0.0
        )
        m.decisions.labels(self._model_label(prepared), "routed").inc()
        m.latency_us.observe(elapsed_us)
        m.composite.observe(decision.score)
        m.candidates.observe(len(decision.candidates))
        m.prefix_nodes.set(self._index.nodes)
        if cache is not None:
            m.cache_match.observe(cache)
        m.best_possible_match.observe(best)
        adapter = prepared.adapter
        if adapter and not decision.primary.has_adapter(adapter):
            m.adapter_loads.labels(adapter).inc()
        level = prepared.log_level
        if level > logging.INFO:
            return
        if level <= TRACE:
            # Block-level detail: how many leading blocks of this prompt each pod holds.
            trace(
                log,
                "prefix_match",
                request_id=decision.request_id,
                blocks=sched.total_blocks,
                block_size=block_size,
                matched_blocks=dict(sched.prefix_match),
                first_block=f"{sched.block_hashes[0]:016x}" if sched.block_hashes else None,
            )
        if level <= logging.DEBUG:
            log.debug(
                "scoring_complete",
                request_id=decision.request_id,
                candidates=len(decision.candidates),
                filtered_out=decision.filtered_out,
                weights=decision.weights,
                top=_top_with_chosen(decision, 3),
                latency_us=round(elapsed_us, 1),
            )
        reason, margin = _selection_reason(decision, self._tie)
        log.info(
            "request_routed",
            request_id=decision.request_id,
            model=_short(request.model),
            adapter=_short(adapter),
            priority=prepared.priority,
            input_tokens=sched.prompt_tokens,
            pod=chosen.name,
            address=chosen.address,
            reason=reason,
            margin=round(margin, 4),
            score=round(decision.score, 4),
            cache_match=None if cache is None else round(cache, 4),
            candidates=len(decision.candidates),
            fallbacks=[e.name for e in decision.endpoints[1:]],
            latency_us=round(elapsed_us, 1),
        )


def _top_with_chosen(decision: Decision, limit: int) -> list[dict[str, object]]:
    """The per-factor breakdown of the best `limit` candidates, plus the chosen pod (marked
    `selected`) when it is not among them."""
    top = decision.breakdown(limit)
    chosen = decision.primary.name
    if any(row["pod"] == chosen for row in top):
        return top
    i = decision.chosen_index
    row: dict[str, object] = {"pod": chosen, "score": round(decision.totals[i], 4)}
    row.update({name: round(values[i], 4) for name, values in decision.factors.items()})
    row["selected"] = True
    return [*top, row]


def _selection_reason(decision: Decision, tie_epsilon: float) -> tuple[str, float]:
    """Why the chosen pod won, and its score margin over the runner-up; cheap (a few
    C-level passes, no Python loop over endpoints):
    - `only-candidate`;
    - `tie`: within the tie epsilon, so fewest in flight, then least work, then chance;
    - else the factor with the largest weighted lead over the runner-up (`cache`,
      `load`, `queue`, `prefill`, ...)."""
    totals = decision.totals
    if len(totals) < 2:
        return "only-candidate", 0.0
    i = decision.chosen_index
    others = totals[:i] + totals[i + 1 :]
    second = max(others)
    margin = totals[i] - second
    if margin <= tie_epsilon:
        return "tie", margin
    j = others.index(second)
    j += j >= i  # back to an index of `totals`
    weights = decision.weights
    best_factor, best_lead = "score", 0.0
    for name, values in decision.factors.items():
        lead = weights.get(name, 0.0) * (values[i] - values[j])
        if lead > best_lead:
            best_factor, best_lead = name, lead
    return best_factor, margin


def _short(value: str | None, limit: int = 128) -> str | None:
    """A client-chosen string as logged: bounded, so a huge model name costs nothing."""
    if value is None or len(value) <= limit:
        return value
    return value[:limit] + f"...(+{len(value) - limit})"


def retry_after_header(seconds: float | None) -> str | None:
    """The Retry-After value (whole seconds, at least 1) for a refusal, if any."""
    if seconds is None:
        return None
    return str(max(1, math.ceil(seconds)))


__all__ = [
    "PreparedRequest",
    "RoutedRequest",
    "Router",
    "Saturated",
    "retry_after_header",
]
