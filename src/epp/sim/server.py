"""One simulated vLLM pod over HTTP: the OpenAI API, /metrics, /health, /v1/models.

The engine (`epp.sim.engine`) decides who runs and how long each step takes, in engine
seconds; this module turns those seconds into asyncio sleeps multiplied by `time_scale`
(0.1 runs ten times faster than the pod it imitates) and streams filler tokens.

Time: the engine clock is wall-clock time since start divided by `time_scale`, and the
latency histograms observe the same engine seconds (wall time / `time_scale`), so /metrics
describes the simulated pod, not the speeded-up process. With a small `time_scale` the
real overheads of HTTP and the event loop are magnified by the same factor.

Requests are scheduled event by event, with no background task: every submit and every
finish asks the engine which waiting requests can start now, and wakes their handlers.
A handler that ends for any reason (done, client gone, cancelled) finishes its request in
the engine, which frees its slot and unpins its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from aiohttp import web

from epp.prefix.hashing import block_hashes, chain_seed
from epp.sim.engine import Admission, EngineConfig, FinishReason, SimEngine, StartedRequest
from epp.sim.latency import LatencyStats
from epp.sim.metrics_page import CONTENT_TYPE, LoraInfoSeries, render_metrics_page
from epp.sim.openai_request import (
    ApiError,
    Endpoint,
    GenerationRequest,
    ServedModels,
    parse_generation_request,
    parse_json_object,
)
from epp.sim.openai_response import SSE_DONE, ResponseShape, filler_text, filler_token, sse, usage
from epp.tokenize import ByteEstimateTokenizer

log = logging.getLogger("epp.sim")

POD_HEADER = "x-sim-pod"
DEFAULT_CLIENT_MAX_SIZE = 64 * 1024 * 1024

# Non-streaming responses need no per-token wake-up: sleep only once at least this far
# ahead of schedule, which batches tokens without changing when the response completes.
_NON_STREAM_MIN_SLEEP_S = 0.005
# A long request that is behind schedule must still let other handlers run.
_YIELD_EVERY_TOKENS = 64


@dataclass(frozen=True, slots=True)
class SimPodConfig:
    """Everything that makes one simulated pod what it is."""

    pod_name: str = "pod-0"
    model: str = "sim-llama-8b"
    lora_adapters: tuple[str, ...] = ()
    engine: EngineConfig = field(default_factory=EngineConfig)
    time_scale: float = 1.0  # wall seconds per engine second
    client_max_size: int = DEFAULT_CLIENT_MAX_SIZE

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError("time_scale must be a finite number > 0")
        if self.model in self.lora_adapters:
            raise ValueError("a LoRA adapter cannot share the base model's name")
        if len(set(self.lora_adapters)) != len(self.lora_adapters):
            raise ValueError("LoRA adapter names must be unique")
        if self.client_max_size < 1:
            raise ValueError("client_max_size must be at least 1")


@dataclass(slots=True)
class _Progress:
    """Output tokens produced so far, so that an abandoned request counts what it made."""

    output_tokens: int = 0


class SimPod:
    """An engine plus the glue that makes its times real and its state visible."""

    def __init__(self, config: SimPodConfig) -> None:
        self.config = config
        self.engine = SimEngine(config.engine)
        self.latency = LatencyStats()
        self.lora_info = LoraInfoSeries(config.engine.max_loras) if config.lora_adapters else None
        self.served = ServedModels(config.model, config.lora_adapters)
        self.tokenizer = ByteEstimateTokenizer()
        self.created_unix = time.time()
        self._clock_origin = time.monotonic()
        # Handlers of queued requests, woken when the engine starts their request.
        self._start_waiters: dict[str, asyncio.Future[StartedRequest]] = {}
        # Handler tasks with a request in the engine, cancelled on shutdown so that a long
        # stream does not hold the process up for aiohttp's shutdown timeout.
        self._in_flight: set[asyncio.Task[object]] = set()

    def engine_now(self) -> float:
        return (time.monotonic() - self._clock_origin) / self.config.time_scale

    # -- scheduling glue -------------------------------------------------------------------

    def _start_ready(self) -> None:
        for started in self.engine.start_ready(self.engine_now()):
            waiter = self._start_waiters.pop(started.req_id, None)
            # A cancelled waiter's handler is unwinding and will finish the request itself.
            if waiter is not None and not waiter.done():
                waiter.set_result(started)

    async def _sleep_engine_seconds(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds * self.config.time_scale)

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        gen = parse_generation_request(endpoint, body, self.served, self.tokenizer)
        engine_config = self.config.engine
        prompt_tokens = len(gen.tokens)
        if prompt_tokens + gen.max_tokens > engine_config.max_context_tokens:
            raise ApiError(
                400,
                f"This model's maximum context length is {engine_config.max_context_tokens} "
                f"tokens. However, you requested {prompt_tokens + gen.max_tokens} tokens "
                f"({prompt_tokens} in the messages, {gen.max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        hashes = block_hashes(
            gen.tokens, engine_config.block_size, chain_seed(gen.model, None, gen.cache_salt)
        )
        prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        admission = self.engine.submit(req_id, hashes, prompt_tokens, gen.max_tokens, gen.adapter)
        if admission is Admission.QUEUE_FULL:
            raise ApiError(
                429, "The server is overloaded: its waiting queue is full.", "TooManyRequestsError"
            )
        if admission is not Admission.QUEUED:
            raise ApiError(400, f"The request cannot be served ({admission}).")
        return await self._run(request, req_id, gen)

    async def _run(
        self, request: web.Request, req_id: str, gen: GenerationRequest
    ) -> web.StreamResponse:
        """Wait for a slot, prefill, decode; always finish the request in the engine."""
        arrival = time.monotonic()
        waiter: asyncio.Future[StartedRequest] = asyncio.get_running_loop().create_future()
        self._start_waiters[req_id] = waiter
        shape = ResponseShape(gen.endpoint, req_id, int(time.time()), gen.model)
        progress = _Progress()
        reason = FinishReason.ABORT
        response: web.StreamResponse | None = None
        task = asyncio.current_task()
        if task is not None:
            self._in_flight.add(task)
        try:
            self._start_ready()
            if gen.stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            started = await waiter
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
            progress.output_tokens = 1
            self.latency.ttft.observe((time.monotonic() - arrival) / self.config.time_scale)
            if response is not None:
                first = b""
                if gen.endpoint is Endpoint.CHAT:
                    first = sse(shape.role_chunk())
                finish = "length" if gen.max_tokens == 1 else None
                await response.write(first + sse(shape.token_chunk(filler_token(0), finish)))
            await self._decode(request, response, shape, gen.max_tokens, progress)
            output_tokens = progress.output_tokens
            if output_tokens < gen.max_tokens:
                return response or _client_closed()
            reason = FinishReason.LENGTH
            self.latency.e2e.observe((time.monotonic() - arrival) / self.config.time_scale)
            usage_ = usage(started.prompt_tokens, output_tokens, started.cached_tokens)
            if response is None:
                return web.json_response(
                    shape.full(filler_text(output_tokens), "length", usage_), dumps=_dumps
                )
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
            self.engine.finish(req_id, progress.output_tokens, reason)
            self._start_ready()

    async def _decode(
        self,
        request: web.Request,
        response: web.StreamResponse | None,
        shape: ResponseShape,
        max_tokens: int,
        progress: _Progress,
    ) -> None:
        """Produce tokens 2..max_tokens on the engine's schedule, counting them in `progress`.

        Each token is due one decode step (asked of the engine as the batch is now) after
        the previous one. Sleeping to absolute deadlines keeps the total right even when
        the event loop wakes a little late.
        """
        engine = self.engine
        scale = self.config.time_scale
        min_sleep = 0.0 if response is not None else _NON_STREAM_MIN_SLEEP_S
        deadline = time.monotonic()
        for index in range(1, max_tokens):
            deadline += engine.decode_step_seconds() * scale
            delay = deadline - time.monotonic()
            if delay > min_sleep:
                await asyncio.sleep(delay)
            elif index % _YIELD_EVERY_TOKENS == 0:
                await asyncio.sleep(0)
            if response is not None:
                finish = "length" if index == max_tokens - 1 else None
                await response.write(sse(shape.token_chunk(filler_token(index), finish)))
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

    async def models(self, request: web.Request) -> web.Response:
        created = int(self.created_unix)
        base = self.config.model
        data = [_model_card(base, None, created, self.config.engine.max_context_tokens)]
        data += [_model_card(name, base, created, None) for name in self.config.lora_adapters]
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        dropped = self.engine.reset_prefix_cache()
        log.info("prefix cache reset dropped_blocks=%d", dropped)
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        if self.lora_info is not None:
            self.lora_info.observe(
                self.engine.running_adapters, self.engine.waiting_adapters, time.time()
            )
        page = render_metrics_page(
            self.engine,
            model_name=self.config.model,
            created_unix=self.created_unix,
            latency=self.latency,
            lora_info=self.lora_info,
        )
        return web.Response(body=page.encode(), headers={"Content-Type": CONTENT_TYPE})


def _client_closed() -> web.Response:
    # Nobody will read this: the status only names the outcome for access logs.
    return web.Response(status=499, reason="Client Closed Request")


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _dumps(payload: object) -> str:
    return json.dumps(payload, separators=(",", ":"))


def _model_card(
    name: str, parent: str | None, created: int, max_model_len: int | None
) -> dict[str, object]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": name,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [],
    }


def _error_type(status: int) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def _error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, dumps=_dumps)


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
        return _error_response(ApiError(exc.status, message, _error_type(exc.status)))
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
    app.router.add_get("/health", pod.health)
    app.router.add_post("/reset_prefix_cache", pod.reset_prefix_cache)
    app.router.add_get("/metrics", pod.metrics)
    return app


@dataclass(slots=True)
class RunningPod:
    """A pod serving on a real socket; `close()` stops it."""

    pod: SimPod
    runner: web.AppRunner
    host: str
    port: int
    _closed: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and abandon requests in flight; safe to call twice."""
        if not self._closed:
            self._closed = True
            await self.runner.cleanup()


async def start_pod(
    config: SimPodConfig, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 1.0
) -> RunningPod:
    """Serve `config` on host:port (0 picks a free port) until `close()`.

    Handlers are cancelled when their client disconnects, so an abandoned request gives its
    slot back at once rather than after it would have finished.
    """
    app = create_app(config)
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return RunningPod(pod=app[POD_KEY], runner=runner, host=host, port=bound_port)
