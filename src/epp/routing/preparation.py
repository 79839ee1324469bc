"""Request preparation: parse the body, resolve the model, tokenize, hash, prioritise.

`prepare(IncomingRequest) -> PreparedRequest`, or RequestRejected for bad
input. Reads the endpoint store (which pods serve an adapter) and the model table; writes
nothing but the request it returns. The work is bounded whatever the prompt's size: at
most prefix.max_blocks_per_request blocks are tokenized and hashed (prefix/blocks.py).
"""

from __future__ import annotations

import logging
import random
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from epp.config import EppConfig
from epp.datalayer.discovery.models import ModelTable
from epp.datalayer.store import EndpointStore
from epp.observability.logs import effective_level
from epp.observability.upstream import UpstreamMetrics
from epp.prefix.blocks import PromptBlocks, prompt_blocks
from epp.prefix.hashing import block_hashes, chain_seed
from epp.request import IncomingRequest, InferenceRequest, parse_request, with_model
from epp.routing.observation import short
from epp.routing.types import PreparedRequest
from epp.scheduling.admission import request_priority
from epp.scheduling.models import resolve_model
from epp.tokenization import TokenizerRegistry
from epp.tokenization.engine import EngineTokenizer

log = structlog.get_logger("epp.routing")


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A parsed request and the models it resolved to, before tokenizing."""

    path: str
    request: InferenceRequest
    served: str | None  # the model the pod serves it as
    body: bytes | None  # the body naming `served`, when the model table rewrote it
    base: str | None
    adapter: str | None


class Preparation:
    def __init__(
        self,
        config: EppConfig,
        store: EndpointStore,
        tokenizers: TokenizerRegistry,
        upstream: UpstreamMetrics,
        debug: bool = False,
    ) -> None:
        self._config = config
        self._store = store
        self._tokenizers = tokenizers  # one per base model, a fallback for the others
        self._upstream = upstream
        self._debug = debug  # DEBUG detail whatever the logger's level
        self._block_size = config.prefix.block_size
        self._max_blocks = config.prefix.max_blocks_per_request
        self.models = ModelTable()
        self.rng = random.Random()  # picks a weighted target model (the model table)
        # Models whose tokenizer is the engine (`tokenizers:` with `source: engine`):
        # `prepare_async` asks a pod for their ids; `prepare` keeps the local path.
        self.engine_tokenizer: EngineTokenizer | None = None

    def set_model_table(self, table: ModelTable) -> None:
        """Models from InferenceModel / InferenceObjective / InferenceModelRewrite objects
        (Kubernetes discovery): priorities, and target models chosen by weight. Replaces
        the previous table."""
        for problem in table.problems:
            log.warning("model_table_problem", problem=problem)
        self.models = table
        log.info("model_table", models=len(table.models), objectives=len(table.objectives))

    def prepare(self, incoming: IncomingRequest) -> PreparedRequest:
        """Parse, tokenize and hash one request (raises RequestRejected for bad input)."""
        started = time.perf_counter()
        parsed = self._parse(incoming)
        return self._prepared(parsed, incoming, started)

    async def prepare_async(self, incoming: IncomingRequest) -> PreparedRequest:
        """`prepare`, with the prompt's ids asked of a pod first when the model's
        tokenizer is the engine (`source: engine`); the local path if that fails."""
        engine = self.engine_tokenizer
        started = time.perf_counter()
        parsed = self._parse(incoming)
        model = parsed.base or parsed.served
        ids = None
        if engine is not None and model is not None and engine.wants(model):
            ids = await engine.tokenize(model, parsed.served or model, parsed.request.prompt)
        return self._prepared(parsed, incoming, started, ids)

    def _parse(self, incoming: IncomingRequest) -> _Parsed:
        max_tokens = self._max_blocks * self._block_size
        body = incoming.body
        request = parse_request(
            incoming.path, body, self._config.adapters, max_prompt_tokens=max_tokens
        )
        served, rewritten = request.model, None
        if request.model is not None:
            # InferenceModelRewrite / InferenceModel targets / the rewrite header
            # (ModelTable.target): the body's model is rewritten before Envoy forwards it.
            served = self.models.target(request.model, self.rng.random(), incoming.headers)
            if served != request.model:
                rewritten = with_model(body, served)
        base, adapter = resolve_model(served, self._config.adapters, self._store.all())
        return _Parsed(incoming.path, request, served, rewritten, base, adapter)

    def _prepared(
        self,
        parsed: _Parsed,
        incoming: IncomingRequest,
        started: float,
        engine_ids: array | None = None,
    ) -> PreparedRequest:
        request, served, headers = parsed.request, parsed.served, incoming.headers or {}
        request_id, size = incoming.request_id, len(incoming.body)
        blocks = self._blocks(parsed, engine_ids)
        priority = self._priority(request, headers)
        level = self._log_level()
        if level <= logging.DEBUG:
            log.debug(
                "request_received",
                request_id=request_id,
                path=parsed.path,
                model=short(request.model),
                adapter=short(parsed.adapter),
                input_tokens=blocks.prompt_tokens,
                blocks=len(blocks.hashes),
                priority=priority,
                body_bytes=size,
            )
        prepared = PreparedRequest(
            request_id, request, parsed.base, parsed.adapter, blocks.hashes,
            blocks.prompt_tokens, incoming.subset, priority, size, started, served,
            parsed.body, level,
        )  # fmt: skip
        prepared.upstream = self._upstream.request(
            request.model, served, priority, headers, request.stream, started
        )
        return prepared

    def _blocks(self, parsed: _Parsed, engine_ids: array | None) -> PromptBlocks:
        request = parsed.request
        seed = chain_seed(parsed.served or "", parsed.adapter, request.cache_salt)
        if engine_ids is None:
            tokenizer = self._tokenizers.for_model(parsed.base or parsed.served)
            return prompt_blocks(
                request.prompt, tokenizer, self._block_size, seed, self._max_blocks
            )
        # The engine tokenized the prompt (tokenization/engine.py): its ids, its count,
        # plus what the parser left out of a very long conversation (estimated).
        omitted = request.prompt.omitted_tokens
        return PromptBlocks(
            len(engine_ids) + omitted,
            block_hashes(engine_ids, self._block_size, seed, self._max_blocks),
            self._block_size,
            omitted == 0,
        )

    def _priority(self, request: InferenceRequest, headers: Mapping[str, str]) -> int:
        """The model table's (InferenceObjective) when it has one, else flow_control's."""
        flow = self._config.flow_control
        priority = self.models.priority(
            request.model,
            headers,
            own=flow.priorities.get(request.model) if request.model is not None else None,
            may_raise=flow.objective_may_raise,
        )
        if priority is None:
            return request_priority(request.model, headers, flow)
        return priority

    def _log_level(self) -> int:
        """The request's log level, decided once: what observation builds for it."""
        level = effective_level(log)
        if self._debug and level > logging.DEBUG:
            return logging.DEBUG
        return level
