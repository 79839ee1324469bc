"""One routing decision from end to end, independent of the transport.

parse body -> tokenize -> chained block hashes -> prefix index lookup -> scheduler ->
record (approximate mode: the chosen pod now holds the prompt's blocks; with the
`prefill` scorer on, the chosen pod's prefill lane grows by this prompt's estimated
prefill) -> metrics/log.
The ext_proc server calls `route` and `complete`; the simulators and tests can too.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

import structlog

from epp.config import EppConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import InferenceRequest, Prompt, RequestRejected, parse_request
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.scorers.prefill import PrefillCost
from epp.scheduling.types import Decision, SchedulingError, SchedulingRequest
from epp.tokenize import Tokenizer

log = structlog.get_logger("epp.routing")


@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    decision: Decision
    request: InferenceRequest
    prompt_tokens: int
    dispatch: int = 0  # the endpoint's dispatch number, to settle its queue estimate
    done: bool = False

    @property
    def endpoint(self) -> Endpoint:
        return self.decision.primary


def _tokens(prompt: Prompt, tokenizer: Tokenizer) -> array:
    if prompt.token_ids is not None:
        return prompt.token_ids
    if prompt.messages is not None:
        return tokenizer.encode_chat(prompt.messages)
    if prompt.text is not None:
        return tokenizer.encode(prompt.text)
    return array("I")


class Router:
    def __init__(
        self,
        config: EppConfig,
        store: EndpointStore,
        index: PrefixIndex,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        metrics: EppMetrics,
        debug: bool = False,
    ) -> None:
        self._config = config
        self._debug = debug  # decided once: the breakdown is not even built otherwise
        self._store = store
        self._index = index
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._block_size = config.prefix.block_size
        # The prefill lanes cost a clock read and an estimate per request: kept only while
        # the `prefill` scorer, their only reader, has a weight.
        self._prefill: PrefillCost | None = (
            PrefillCost.from_config(scheduler.config.prefill_estimate)
            if "prefill" in scheduler.weights
            else None
        )
        store.on_change(self._on_endpoint_change)

    def _on_endpoint_change(self, event: str, endpoint: Endpoint) -> None:
        if event == "removed":
            self._index.remove_pod(endpoint.name)
        elif event == "reset":
            self._index.clear_pod(endpoint.name)
            log.info("pod_cache_reset", pod=endpoint.name)
        elif event == "updated" and self._config.prefix.use_reported_capacity:
            metrics = endpoint.metrics
            if metrics is not None and metrics.num_gpu_blocks and metrics.block_size:
                # The pod's blocks may differ in size from ours: convert to our blocks.
                ours = metrics.num_gpu_blocks * metrics.block_size // self._block_size
                self._index.set_capacity(endpoint.name, ours)

    def route(
        self,
        *,
        path: str,
        body: bytes,
        request_id: str,
        subset: frozenset[str] | None = None,
    ) -> RoutedRequest:
        """Choose pods for one request. Raises RequestRejected with the answer otherwise."""
        started = time.perf_counter()
        request = parse_request(path, body, self._config.adapters)
        tokens = _tokens(request.prompt, self._tokenizer)
        seed = chain_seed(request.model or "", request.adapter, request.cache_salt)
        hashes = block_hashes(tokens, self._block_size, seed)
        prefill = self._prefill
        now = self._store.now() if prefill is not None else 0.0
        sched_request = SchedulingRequest(
            request_id=request_id,
            model=request.model,
            base_model=request.base_model,
            adapter=request.adapter,
            block_hashes=hashes,
            prefix_match=self._index.match(hashes) if hashes else {},
            subset=subset,
            prompt_tokens=len(tokens),
            block_size=self._block_size,
            now=now,
        )
        try:
            decision = self._scheduler.schedule(sched_request, self._store.all())
        except SchedulingError as exc:
            self._metrics.decisions.labels(request.model or "", exc.reason).inc()
            log.info(
                "request_rejected",
                request_id=request_id,
                model=request.model,
                status=exc.status,
                reason=exc.reason,
            )
            raise RequestRejected(exc.status, exc.message, reason=exc.reason) from None
        chosen = decision.primary
        if hashes:
            self._index.record(chosen.name, hashes)
        dispatch = self._store.dispatched(chosen)
        if prefill is not None:
            # The match the scorer saw (taken before `record`), not the one just recorded.
            matched = sched_request.prefix_match.get(chosen.name, 0)
            own = prefill.seconds(len(tokens), matched, self._block_size)
            self._store.prefill_dispatched(chosen, own, now)
        elapsed_us = (time.perf_counter() - started) * 1e6
        self._observe(request, sched_request, decision, elapsed_us)
        return RoutedRequest(request_id, decision, request, len(tokens), dispatch)

    def complete(
        self, routed: RoutedRequest, status: int | None, served_address: str | None = None
    ) -> None:
        """The response finished (or the stream ended): release the in-flight slot once."""
        if routed.done:
            return
        routed.done = True
        endpoint = routed.endpoint
        if served_address and served_address != endpoint.address:
            # Envoy retried on a fallback: the primary refused, the fallback served.
            self._metrics.fallback_served.inc()
            fallback = self._store.by_address(served_address)
            self._store.completed(endpoint, 503, routed.dispatch)
            if fallback is not None:
                fallback.in_flight += 1  # balanced by the completion below
                self._store.completed(fallback, status)
            return
        self._store.completed(endpoint, status, routed.dispatch)

    def _observe(
        self,
        request: InferenceRequest,
        sched: SchedulingRequest,
        decision: Decision,
        elapsed_us: float,
    ) -> None:
        m = self._metrics
        cache = decision.factor("cache")
        best = (
            max(sched.prefix_match.values(), default=0) / sched.total_blocks
            if sched.total_blocks
            else 0.0
        )
        m.decisions.labels(request.model or "", "routed").inc()
        m.latency_us.observe(elapsed_us)
        m.composite.observe(decision.score)
        m.candidates.observe(len(decision.candidates))
        m.prefix_nodes.set(self._index.nodes)
        if cache is not None:
            m.cache_match.observe(cache)
        m.best_possible_match.observe(best)
        if request.adapter and not decision.primary.has_adapter(request.adapter):
            m.adapter_loads.labels(request.adapter).inc()
        log.info(
            "request_routed",
            request_id=decision.request_id,
            model=request.model,
            adapter=request.adapter,
            input_tokens=sched.prompt_tokens,
            pod=decision.primary.name,
            address=decision.primary.address,
            score=round(decision.score, 4),
            cache_match=None if cache is None else round(cache, 4),
            candidates=len(decision.candidates),
            fallbacks=[e.name for e in decision.endpoints[1:]],
            latency_us=round(elapsed_us, 1),
        )
        if self._debug:
            log.debug(
                "scoring_breakdown", request_id=decision.request_id, top=decision.breakdown(3)
            )
