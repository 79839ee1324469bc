"""One simulated vLLM pod over HTTP: the OpenAI API, /metrics, /health, /v1/models,
runtime LoRA loading, KV-cache events over ZMQ, and failure injection.

The engine (`vllm_sim.engine`) decides who runs and how long each step takes, in engine
seconds; this module turns those seconds into asyncio sleeps multiplied by `time_scale`
(0.1 runs ten times faster than the pod it imitates) and streams filler tokens.

Time: the engine clock is wall-clock time since start divided by `time_scale`, and the
latency histograms observe the same engine seconds (wall time / `time_scale`), so /metrics
describes the simulated pod, not the speeded-up process. With a small `time_scale` the
real overheads of HTTP and the event loop are magnified by the same factor.

Requests are scheduled event by event, with no background task: every submit and every
finish asks the engine which waiting requests can start now, and wakes their handlers.
A started request's first token is due `prefill_seconds` later, which includes its wait
for the pod's prefill compute (prefills run one after the other, first come first served,
see `vllm_sim.engine`); each decode step is asked of the engine for the time it starts, so
tokens come slower while a prefill runs. /metrics counts a request still queued behind
other prefills as waiting, and its queue time (`vllm:request_queue_time_seconds`) runs
until its own prefill begins, as vLLM counts a request no step has scheduled yet.
A handler that ends for any reason (done, client gone, cancelled) finishes its request in
the engine, which frees its slot and unpins its KV blocks.

KV events: after every engine call that can change the block pool (starting requests,
finishing one) the events the engine queued are published as one batch, as vLLM's
scheduler publishes its block pool's events once per step. A finish publishes the output
blocks the request filled (the engine caches them then, see `vllm_sim.engine`) in a batch
of their own, before the batch of whatever its slot lets start. A prefix-cache reset
publishes nothing by itself: its `AllBlocksCleared` goes out with the next batch, as in
vLLM, whose engine sends events only with a scheduler step (so an idle pod tells its
subscribers of a reset when the next request arrives).

Prompts are tokenized by the simulator's own tokenizer (`vllm_sim.tokenizer`, Llama 3's
chat template) and their blocks hashed as vLLM hashes them (`vllm_sim.hashing`), both
through `vllm_sim.openai_request.engine_prompt`: nothing here is the router's code, so a
router's view of a pod's cache is only as good as what it can observe. Output tokens are
filler words whose ids are the tokenizer's own ids for them (`vllm_sim.openai_response`),
passed to the engine when the request finishes, so that a later prompt that quotes the
output reuses its cached blocks. `return_token_ids: true` answers with the prompt's and
the output's token ids, as vLLM does.

Failure injection (`vllm_sim.failures`) happens here: error answers before anything
reaches the engine; `hang` and `drop` after the request got its slot, so that a router's
view of the pod (running requests, KV usage) is what a stuck or crashing pod would show.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from vllm_sim.engine import (
    DEFAULT_LORA_RANK,
    Admission,
    EngineConfig,
    FinishReason,
    SimEngine,
    StartedRequest,
)
from vllm_sim.failures import (
    ERROR_KINDS,
    FAIL_HEADER,
    GARBAGE_METRICS_PAGE,
    INJECTED_HEADER,
    SLOW_METRICS_DEFAULT_S,
    FailureConfig,
    FailureCounts,
    FailureInjector,
    FailureKind,
    MetricsFault,
    PodFaults,
    TokenizeFault,
    injected_error,
    parse_header,
)
from vllm_sim.kv_publisher import KvEventPublisher, KvEventsConfig, default_topic
from vllm_sim.latency import LatencyStats, RequestTimeline
from vllm_sim.lora_admin import LoraAdmin
from vllm_sim.metrics_page import (
    CONTENT_TYPE,
    LoraInfoSeries,
    only_families,
    process_start_time,
    render_metrics_page,
)
from vllm_sim.openai_errors import ApiError, error_type
from vllm_sim.openai_request import (
    Endpoint,
    GenerationRequest,
    engine_prompt,
    parse_json_object,
    tokenize_request,
)
from vllm_sim.openai_response import (
    FILLER_WORDS,
    SSE_DONE,
    ResponseShape,
    filler_text,
    filler_token,
    filler_token_ids,
    sse,
    usage,
)
from vllm_sim.served_models import LoraAdapter, ServedModels
from vllm_sim.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("vllm_sim")

POD_HEADER = "x-sim-pod"
DEFAULT_CLIENT_MAX_SIZE = 64 * 1024 * 1024

# Non-streaming responses need no per-token wake-up: sleep only once at least this far
# ahead of schedule, which batches tokens without changing when the response completes.
_NON_STREAM_MIN_SLEEP_S = 0.005
# A long request that is behind schedule must still let other handlers run.
_YIELD_EVERY_TOKENS = 64
# How often a hung handler checks whether its client gave up (when aiohttp does not
# cancel it on disconnect).
_HANG_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class SimPodConfig:
    """Everything that makes one simulated pod what it is."""

    pod_name: str = "pod-0"
    model: str = "sim-llama-8b"
    lora_adapters: tuple[str, ...] = ()  # served from startup
    engine: EngineConfig = field(default_factory=EngineConfig)
    time_scale: float = 1.0  # wall seconds per engine second
    client_max_size: int = DEFAULT_CLIENT_MAX_SIZE
    # Rank of each startup adapter (missing: DEFAULT_LORA_RANK).
    lora_ranks: Mapping[str, int] = field(default_factory=dict)
    # Accept /v1/load_lora_adapter even with no startup adapter (implied by adapters).
    enable_lora: bool = False
    kv_events: KvEventsConfig | None = None
    failures: FailureConfig = field(default_factory=FailureConfig)
    # A real model's tokenizer files (tokenizer.json, tokenizer_config.json); None: the
    # simulator's own tokenizer (vllm_sim.tokenizer).
    tokenizer_dir: str | None = None

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError("time_scale must be a finite number > 0")
        if self.model in self.lora_adapters:
            raise ValueError("a LoRA adapter cannot share the base model's name")
        if len(set(self.lora_adapters)) != len(self.lora_adapters):
            raise ValueError("LoRA adapter names must be unique")
        if self.client_max_size < 1:
            raise ValueError("client_max_size must be at least 1")
        for name, rank in self.lora_ranks.items():
            if name not in self.lora_adapters:
                raise ValueError(f"rank given for {name!r}, which is not a LoRA adapter")
            if rank < 1:
                raise ValueError(f"LoRA adapter {name!r}: rank must be at least 1")

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_adapters)

    def startup_adapters(self) -> list[LoraAdapter]:
        return [
            LoraAdapter(name, self.lora_ranks.get(name, DEFAULT_LORA_RANK))
            for name in self.lora_adapters
        ]


@dataclass(slots=True)
class _Progress:
    """Output tokens produced so far, so that an abandoned request counts what it made."""

    output_tokens: int = 0


class SimPod:
    """An engine plus the glue that makes its times real and its state visible."""

    def __init__(self, config: SimPodConfig) -> None:
        self.config = config
        self.engine = SimEngine(config.engine, kv_events=config.kv_events is not None)
        self.latency = LatencyStats()
        self.lora_info = LoraInfoSeries(config.engine.max_loras) if config.lora_enabled else None
        self.served = ServedModels(config.model, config.startup_adapters())
        for adapter in config.startup_adapters():
            # Registered with its rank, loaded into a slot by its first request.
            self.engine.load_adapter(adapter.name, adapter.rank)
        self.lora_admin = LoraAdmin(
            self.served,
            self.engine,
            enabled=config.lora_enabled,
            engine_now=self.engine_now,
            sleep_engine_seconds=self._sleep_engine_seconds,
        )
        self.failures = FailureInjector(config.failures)
        self.faults = PodFaults()
        self.injected = FailureCounts()
        self.kv_publisher: KvEventPublisher | None = None
        self.tokenizer: Tokenizer = load_tokenizer(config.tokenizer_dir)
        # The id of each filler word: what the engine generated, and what the word's text
        # encodes to when a client sends it back. A real tokenizer may split a filler
        # word: its first id stands for it (the reply then re-encodes to other ids).
        try:
            self._filler_ids = filler_token_ids(self.tokenizer.encode)
        except ValueError:
            self._filler_ids = tuple(
                self.tokenizer.encode(filler_token(i))[0] for i in range(len(FILLER_WORDS))
            )
        self.created_unix = time.time()
        # On the page as vLLM's: a restarted process has a new one (a router's signal).
        self.process_start_unix = process_start_time()
        self._clock_origin = time.monotonic()
        # Handlers of queued requests, woken when the engine starts their request.
        self._start_waiters: dict[str, asyncio.Future[StartedRequest]] = {}
        # Handler tasks with a request in the engine (or hanging on purpose), cancelled on
        # shutdown so that they do not hold the process up for aiohttp's shutdown timeout.
        self._in_flight: set[asyncio.Task[object]] = set()
        # The page /metrics repeats while the `frozen` switch is on.
        self._frozen_page: bytes | None = None

    def engine_now(self) -> float:
        return (time.monotonic() - self._clock_origin) / self.config.time_scale

    # -- scheduling glue -------------------------------------------------------------------

    def _start_ready(self) -> None:
        started_now = self.engine.start_ready(self.engine_now())
        self._publish_kv_events()
        for started in started_now:
            waiter = self._start_waiters.pop(started.req_id, None)
            # A cancelled waiter's handler is unwinding and will finish the request itself.
            if waiter is not None and not waiter.done():
                waiter.set_result(started)

    def _publish_kv_events(self) -> None:
        events = self.engine.drain_kv_events()
        # Before the publisher is up (or after it closed) there is nobody to tell.
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(events)

    def output_token_ids(self, count: int) -> list[int]:
        """The token ids of the first `count` output tokens (the same for every request)."""
        ids = self._filler_ids
        return [ids[index % len(ids)] for index in range(count)]

    async def _sleep_engine_seconds(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds * self.config.time_scale)

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        failure = self.failures.for_generation(request.headers.get(FAIL_HEADER))
        if failure is None:
            failure = self.faults.generation
        if self.faults.delay_ms:
            await asyncio.sleep(self.faults.delay_ms / 1000.0)
        if failure is not None:
            self._note_injected(failure, request)
            if failure in ERROR_KINDS:
                raise _injected(failure)
        body = parse_json_object(await request.read())
        engine_config = self.config.engine
        prompt = engine_prompt(
            endpoint,
            body,
            self.served,
            self.tokenizer,
            engine_config.block_size,
            engine_config.max_context_tokens,
        )
        gen = prompt.request
        prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        admission = self.engine.submit(
            req_id,
            prompt.block_hashes,
            len(gen.tokens),
            gen.max_tokens,
            gen.adapter,
            prompt_token_ids=gen.tokens,
            cache_salt=gen.cache_salt,
        )
        if admission is Admission.QUEUE_FULL:
            raise ApiError(
                429, "The server is overloaded: its waiting queue is full.", "TooManyRequestsError"
            )
        if admission is not Admission.QUEUED:
            raise ApiError(400, f"The request cannot be served ({admission}).")
        return await self._run(request, req_id, gen, failure)

    async def _run(
        self,
        request: web.Request,
        req_id: str,
        gen: GenerationRequest,
        failure: FailureKind | None = None,
    ) -> web.StreamResponse:
        """Wait for a slot, prefill, decode; always finish the request in the engine.

        `failure` is `hang` or `drop` (errors never get here): both happen once the
        first token is ready, a streamed `drop` right after sending it.
        """
        arrival = time.monotonic()
        scale = self.config.time_scale
        waiter: asyncio.Future[StartedRequest] = asyncio.get_running_loop().create_future()
        self._start_waiters[req_id] = waiter
        shape = ResponseShape(gen.endpoint, req_id, int(time.time()), gen.model)
        output_ids = self.output_token_ids(gen.max_tokens)
        # vLLM's `return_token_ids`: the ids ride along in the response.
        shown_ids = output_ids if gen.return_token_ids else None
        prompt_ids = list(gen.tokens) if gen.return_token_ids else None
        progress = _Progress()
        reason = FinishReason.ABORT
        response: web.StreamResponse | None = None
        task = asyncio.current_task()
        if task is not None:
            self._in_flight.add(task)
        try:
            self._start_ready()
            # A hung request never answers, not even the headers of a stream.
            if gen.stream and failure is not FailureKind.HANG:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            started = await waiter
            # vLLM's queue time ends when a step first schedules the request: when its
            # prefill begins, after any wait behind the pod's other prefills.
            scheduled = time.monotonic() + started.prefill_wait_seconds * scale
            log.debug(
                "request started req_id=%s model=%s prompt_tokens=%d cached_tokens=%d "
                "max_tokens=%d",
                req_id,
                gen.model,
                started.prompt_tokens,
                started.cached_tokens,
                gen.max_tokens,
            )
            await self._sleep_engine_seconds(started.prefill_seconds)
            if failure is FailureKind.HANG:
                await _until_client_leaves(request)
                return _client_closed()
            first_token = time.monotonic()
            progress.output_tokens = 1
            self.latency.ttft.observe((first_token - arrival) / scale)
            if response is not None:
                first = b""
                chunk_prompt_ids = prompt_ids
                if gen.endpoint is Endpoint.CHAT:
                    first = sse(shape.role_chunk(prompt_ids))
                    chunk_prompt_ids = None
                finish = "length" if gen.max_tokens == 1 else None
                chunk = shape.token_chunk(
                    filler_token(0),
                    finish,
                    None if shown_ids is None else shown_ids[0],
                    chunk_prompt_ids,
                )
                await response.write(first + sse(chunk))
            if failure is FailureKind.DROP:
                _drop_connection(request)
                return response or _client_closed()
            await self._decode(request, response, shape, gen.max_tokens, progress, shown_ids)
            output_tokens = progress.output_tokens
            if output_tokens < gen.max_tokens:
                return response or _client_closed()
            reason = FinishReason.LENGTH
            finished = time.monotonic()
            self.latency.observe_finished(
                RequestTimeline(
                    arrived=0.0,
                    scheduled=(scheduled - arrival) / scale,
                    first_token=(first_token - arrival) / scale,
                    finished=(finished - arrival) / scale,
                    output_tokens=output_tokens,
                )
            )
            usage_ = usage(started.prompt_tokens, output_tokens, started.cached_tokens)
            if response is None:
                body = shape.full(
                    filler_text(output_tokens),
                    "length",
                    usage_,
                    None if shown_ids is None else shown_ids[:output_tokens],
                    prompt_ids,
                )
                return web.json_response(body, dumps=_dumps)
            tail = sse(shape.usage_chunk(usage_)) if gen.include_usage else b""
            await response.write(tail + SSE_DONE)
            await response.write_eof()
            return response
        except ConnectionResetError:
            log.debug("client disconnected req_id=%s", req_id)
            return response or _client_closed()
        finally:
            if task is not None:
                self._in_flight.discard(task)
            self._start_waiters.pop(req_id, None)
            self.engine.finish(
                req_id,
                progress.output_tokens,
                reason,
                output_token_ids=output_ids[: progress.output_tokens],
            )
            # The output blocks it filled: vLLM announces them from the steps that filled
            # them, before anything the freed slot lets start.
            self._publish_kv_events()
            self._start_ready()

    async def _decode(
        self,
        request: web.Request,
        response: web.StreamResponse | None,
        shape: ResponseShape,
        max_tokens: int,
        progress: _Progress,
        token_ids: list[int] | None = None,
    ) -> None:
        """Produce tokens 2..max_tokens on the engine's schedule, counting them in `progress`.

        With `token_ids` (`return_token_ids`), each streamed chunk carries its token's id.

        Each token is due one decode step after the previous one, asked of the engine for
        the step's start (the previous token's deadline): the batch as it is, plus a
        prefill chunk when a prefill is in progress on the pod then. Sleeping to absolute
        deadlines keeps the total right even when the event loop wakes a little late.
        """
        engine = self.engine
        scale = self.config.time_scale
        origin = self._clock_origin
        inter_token = self.latency.inter_token
        min_sleep = 0.0 if response is not None else _NON_STREAM_MIN_SLEEP_S
        deadline = time.monotonic()
        for index in range(1, max_tokens):
            # The step starts at the previous token's deadline (engine seconds), and
            # carries a prefill chunk if a prefill is in progress then.
            step = engine.decode_step_seconds((deadline - origin) / scale)
            # The engine's own step, which the deadlines below keep to on average.
            inter_token.observe(step)
            deadline += step * scale
            delay = deadline - time.monotonic()
            if delay > min_sleep:
                await asyncio.sleep(delay)
            elif index % _YIELD_EVERY_TOKENS == 0:
                await asyncio.sleep(0)
            if response is not None:
                finish = "length" if index == max_tokens - 1 else None
                token_id = None if token_ids is None else token_ids[index]
                await response.write(sse(shape.token_chunk(filler_token(index), finish, token_id)))
            elif _client_gone(request):
                return
            progress.output_tokens += 1
        delay = deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def abandon_in_flight(self, app: web.Application | None = None) -> None:
        """Cancel every request being served (shutdown: the pod goes away mid-request)."""
        for task in list(self._in_flight):
            task.cancel()
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=1.0)

    # -- other endpoints -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, Endpoint.CHAT)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: the prompt's ids as this pod would compute them (its
        tokenizer, its chat template), `{"count", "max_model_len", "tokens"}`."""
        fault = self.faults.tokenize
        if fault is TokenizeFault.HANG:
            await self._hang(request)
            return _client_closed()
        if fault is TokenizeFault.ERROR:
            raise ApiError(500, "Injected /tokenize failure.", "InternalServerError")
        if fault is TokenizeFault.GARBAGE:
            return web.Response(body=b'{"tokens": "not ids", "count": -1', status=200)
        body = parse_json_object(await request.read())
        ids = tokenize_request(body, self.served, self.tokenizer)
        answer = {
            "count": len(ids),
            "max_model_len": self.config.engine.max_context_tokens,
            "tokens": ids.tolist(),
        }
        return web.json_response(answer, dumps=_dumps)

    async def models(self, request: web.Request) -> web.Response:
        created = int(self.created_unix)
        base = self.config.model
        data = [_model_card(base, base, None, created, self.config.engine.max_context_tokens)]
        for name in self.served.adapters:
            adapter = self.served.adapter(name)
            root = adapter.path if adapter is not None and adapter.path else name
            data.append(_model_card(name, root, base, created, None))
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.faults.health_status or 200)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        # Its AllBlocksCleared stays queued in the engine: like vLLM, the pod publishes it
        # with its next batch of events (the next start or finish), not on its own.
        dropped = self.engine.reset_prefix_cache()
        log.info("prefix cache reset dropped_blocks=%d", dropped)
        return web.Response(status=200)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self.lora_admin.load(request)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self.lora_admin.unload(request)

    async def sim_fail(self, request: web.Request) -> web.Response:
        """GET: the pod-wide failure switches; POST: change them (see `PodFaults`)."""
        if request.method == "POST":
            self.faults.update(parse_json_object(await request.read()))
            if self.kv_publisher is not None:
                self.kv_publisher.fault = self.faults.kv_events
            log.info("pod failures set pod=%s state=%s", self.config.pod_name, self.faults.state())
        return web.json_response(self.faults.state(), dumps=_dumps)

    async def sim_kv_restart(self, request: web.Request) -> web.Response:
        """POST /sim/kv/restart: the publisher restarts (same ports, its sequence from the
        start, its replay buffer empty) while the engine keeps its blocks."""
        if self.kv_publisher is None:
            raise ApiError(404, "This pod publishes no KV events.")
        await self.kv_publisher.restart()
        log.info("kv publisher restarted pod=%s", self.config.pod_name)
        return web.json_response({"next_seq": self.kv_publisher.next_seq}, dumps=_dumps)

    async def sim_kv(self, request: web.Request) -> web.Response:
        """GET /sim/kv: the engine's cached blocks, each hash once (16 hex digits), sorted:
        what a router that follows this pod's KV events should hold for it."""
        hashes = sorted(f"{h:016x}" for h in self.engine.cached_block_hashes())
        body = {"block_size": self.config.engine.block_size, "blocks": hashes}
        return web.json_response(body, dumps=_dumps)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        header = request.headers.get(FAIL_HEADER)
        kind = None if header is None else parse_header(header)
        if kind is not None:
            self._note_injected(kind, request)
            if kind in ERROR_KINDS:
                raise _injected(kind)
            if kind is FailureKind.DROP:
                _drop_connection(request)
                return _client_closed()
        if kind is FailureKind.HANG or self.faults.metrics is MetricsFault.HANG:
            await self._hang(request)
            return _client_closed()
        delay = self.config.failures.metrics_delay_s
        if kind is FailureKind.SLOW_METRICS:
            delay = delay or SLOW_METRICS_DEFAULT_S
        if delay > 0:
            await asyncio.sleep(delay)
        if self.faults.metrics is MetricsFault.GARBAGE:
            return web.Response(body=GARBAGE_METRICS_PAGE, headers={"Content-Type": CONTENT_TYPE})
        if self.lora_info is not None:
            self.lora_info.observe(
                self.engine.running_adapters, self.engine.waiting_adapters, time.time()
            )
        if self.faults.metrics is MetricsFault.FROZEN and self._frozen_page is not None:
            return web.Response(body=self._frozen_page, headers={"Content-Type": CONTENT_TYPE})
        page = render_metrics_page(
            self.engine,
            model_name=self.config.model,
            created_unix=self.created_unix,
            latency=self.latency,
            lora_info=self.lora_info,
            now=self.engine_now(),
            process_start_unix=self.process_start_unix,
        )
        body = page.encode()
        self._frozen_page = body if self.faults.metrics is MetricsFault.FROZEN else None
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def metrics_mounted(self, request: web.Request) -> web.StreamResponse:
        """`/metrics/`, where vLLM mounts prometheus_client's app: the same page (and the
        same injected failures), only the families named by `name[]` when asked."""
        response = await self.metrics(request)
        names = frozenset(request.query.getall("name[]", ()))
        garbage = self.faults.metrics is MetricsFault.GARBAGE
        if not names or garbage or not isinstance(response, web.Response):
            return response
        body = response.body
        if response.status != 200 or not isinstance(body, bytes):
            return response
        return web.Response(body=only_families(body, names), headers={"Content-Type": CONTENT_TYPE})

    # -- failure injection ---------------------------------------------------------------

    def _note_injected(self, kind: FailureKind, request: web.Request) -> None:
        self.injected.add(kind)
        # DEBUG: a failure rate makes these as frequent as requests.
        log.debug(
            "injecting failure pod=%s kind=%s path=%s", self.config.pod_name, kind, request.path
        )

    async def _hang(self, request: web.Request) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._in_flight.add(task)
        try:
            await _until_client_leaves(request)
        finally:
            if task is not None:
                self._in_flight.discard(task)


def _injected(kind: FailureKind) -> ApiError:
    error = injected_error(kind)
    error.headers[INJECTED_HEADER] = kind.value
    return error


async def _until_client_leaves(request: web.Request) -> None:
    """Wait until the client disconnects (a served handler is cancelled before that)."""
    while not _client_gone(request):
        await asyncio.sleep(_HANG_POLL_S)


def _drop_connection(request: web.Request) -> None:
    """Close the TCP connection without (the rest of) a response, as a crashing pod does."""
    transport = request.transport
    if transport is not None:
        transport.close()


def _client_closed() -> web.Response:
    # Nobody will read this: the status only names the outcome for access logs.
    return web.Response(status=499, reason="Client Closed Request")


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _dumps(payload: object) -> str:
    return json.dumps(payload, separators=(",", ":"))


def _model_card(
    name: str, root: str, parent: str | None, created: int, max_model_len: int | None
) -> dict[str, object]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [],
    }


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(
        error.body(), status=error.status, headers=error.headers or None, dumps=_dumps
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes vLLM's JSON error shape; nothing escapes as a traceback page."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        return _error_response(ApiError(exc.status, message, error_type(exc.status)))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error path=%s", request.path)
        return _error_response(ApiError(500, "Internal server error.", "InternalServerError"))


POD_KEY = web.AppKey("sim_pod", SimPod)


def create_app(config: SimPodConfig) -> web.Application:
    """The aiohttp application for one simulated pod (`app[POD_KEY]` is its `SimPod`).

    Serve it with `handler_cancellation=True` (as `start_pod` does) so that a client that
    goes away while queued frees its place at once; without it, the request is noticed
    gone only at its next output token.
    """
    pod = SimPod(config)
    app = web.Application(client_max_size=config.client_max_size, middlewares=[_errors_as_json])
    app[POD_KEY] = pod

    async def tag_pod(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[POD_HEADER] = config.pod_name

    app.on_response_prepare.append(tag_pod)
    app.on_shutdown.append(pod.abandon_in_flight)
    app.router.add_post("/v1/completions", pod.completions)
    app.router.add_post("/v1/chat/completions", pod.chat_completions)
    app.router.add_get("/v1/models", pod.models)
    app.router.add_post("/tokenize", pod.tokenize)
    app.router.add_get("/health", pod.health)
    app.router.add_post("/reset_prefix_cache", pod.reset_prefix_cache)
    app.router.add_get("/metrics", pod.metrics)  # vLLM's: the whole page, `name[]` ignored
    app.router.add_get("/metrics/", pod.metrics_mounted)
    app.router.add_post("/v1/load_lora_adapter", pod.load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", pod.unload_lora_adapter)
    app.router.add_get("/sim/fail", pod.sim_fail)
    app.router.add_post("/sim/fail", pod.sim_fail)
    app.router.add_get("/sim/kv", pod.sim_kv)
    app.router.add_post("/sim/kv/restart", pod.sim_kv_restart)
    return app


@dataclass(slots=True)
class RunningPod:
    """A pod serving on a real socket; `close()` stops it."""

    pod: SimPod
    runner: web.AppRunner
    host: str
    port: int
    _closed: bool = False
    kv_publisher: KvEventPublisher | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and abandon requests in flight; safe to call twice."""
        if not self._closed:
            self._closed = True
            try:
                await self.runner.cleanup()
            finally:
                if self.kv_publisher is not None:
                    self.pod.kv_publisher = None
                    await self.kv_publisher.close()


async def start_pod(
    config: SimPodConfig, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 1.0
) -> RunningPod:
    """Serve `config` on host:port (0 picks a free port) until `close()`.

    Handlers are cancelled when their client disconnects, so an abandoned request gives its
    slot back at once rather than after it would have finished. With `config.kv_events`,
    the ZMQ sockets are bound too (raises zmq.ZMQError if a port is taken).
    """
    app = create_app(config)
    pod = app[POD_KEY]
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, access_log=None
    )
    await runner.setup()
    publisher: KvEventPublisher | None = None
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        if config.kv_events is not None:
            topic = config.kv_events.topic or default_topic(host, bound_port, config.model)
            publisher = KvEventPublisher(config.kv_events, topic)
            await publisher.start()
            pod.kv_publisher = publisher
    except BaseException:
        await runner.cleanup()
        raise
    return RunningPod(pod=pod, runner=runner, host=host, port=bound_port, kv_publisher=publisher)
