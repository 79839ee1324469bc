"""The engine's own tokenizer: a pod serving the model tokenizes the prompt (vLLM's
`POST /tokenize`), for models configured with `source: engine` in `tokenizers:`.

Why: the engine's ids are the ones its KV blocks are made of, whatever its tokenizer
files, chat template or version; no local copy can drift from them. The cost is one HTTP
round trip per request, so it is bounded: `timeout_ms`, a response size limit, and on any
failure the request falls back to the model's local tokenizer (if `path` is set) or the
byte estimate. Each call is counted in `epp_engine_tokenize_total{result}`:

- `ok`: the engine's ids were used;
- `timeout`: no full answer within `timeout_ms`;
- `error`: the connection failed or the pod answered an HTTP error;
- `bad_answer`: not vLLM's `{"tokens": [...], "count": n}`, ids out of range, or longer
  than `max_response_mb`;
- `no_pod`: no healthy pod serves the model;
- `skipped`: the request carries what /tokenize cannot express (media parts, `documents`,
  `reasoning_effort`), so the local path renders it.

The request body sent (vLLM 0.32, `entrypoints/serve/tokenize/protocol.py`):
`{model, prompt}` for completions (`add_special_tokens` defaults to true, as for
/v1/completions), `{model, messages, add_generation_prompt, continue_final_message,
add_special_tokens, tools?, chat_template_kwargs?}` for chats. The messages are the
parsed turns (epp.conversation), so an Anthropic /v1/messages body goes as the chat vLLM
converts it to; vLLM's merge of inline system turns for templates that refuse them is
not applied by /tokenize (such a conversation hashes as the engine's /tokenize renders it).

The Router awaits this before `prepare` only when the model's entry says `engine`
(`wants`); other models never reach this module. One aiohttp session serves every call
(keep-alive connections, bounded), opened on first use and closed by the app.
"""

from __future__ import annotations

import asyncio
import json
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter

from epp.config import TokenizerConfig
from epp.datalayer.endpoint import Endpoint
from epp.request import Prompt
from epp.tokenization.protocol import ChatMessage

log = structlog.get_logger("epp.tokenization.engine")

RESULTS = ("ok", "timeout", "error", "bad_answer", "no_pod", "skipped")
# Connections to pods for /tokenize: enough for a burst, few enough not to crowd the pods.
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_POD = 16


class _Answer(msgspec.Struct, gc=False):
    tokens: list[int]
    count: int


_ANSWER = msgspec.json.Decoder(_Answer)


@dataclass(frozen=True, slots=True)
class EngineSource:
    timeout_s: float
    max_response_bytes: int


class EngineTokenizer:
    """model name -> ids from a pod's /tokenize, for the models configured so."""

    def __init__(
        self,
        sources: Mapping[str, EngineSource],
        endpoints: Callable[[], Iterable[Endpoint]],  # the store's current pods
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._sources = dict(sources)
        self._endpoints = endpoints
        self._session: aiohttp.ClientSession | None = None
        self.calls = Counter(
            "epp_engine_tokenize_total",
            "Prompts sent to a pod's /tokenize (tokenizers source: engine), by result:"
            " ok, or the fallback taken after timeout, error, bad_answer, no_pod, skipped.",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self.calls.labels(result)  # every series from the start, at 0

    @classmethod
    def from_config(
        cls,
        configs: Mapping[str, TokenizerConfig],
        endpoints: Callable[[], Iterable[Endpoint]],
        registry: CollectorRegistry | None = None,
    ) -> EngineTokenizer | None:
        """None when no model asks for the engine: the Router then never awaits."""
        sources = {
            model: EngineSource(c.timeout_ms / 1000.0, int(c.max_response_mb * 1024 * 1024))
            for model, c in configs.items()
            if c.source == "engine"
        }
        return cls(sources, endpoints, registry) if sources else None

    def wants(self, model: str | None) -> bool:
        return model is not None and model in self._sources

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=MAX_CONNECTIONS, limit_per_host=MAX_CONNECTIONS_PER_POD, keepalive_timeout=30
            )
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def tokenize(self, base_model: str, served_model: str, prompt: Prompt) -> array | None:
        """The prompt's ids as the engine counts them, or None (fall back; counted).

        `base_model` picks the configuration and the pods; `served_model` is the name the
        pod is asked with (an adapter, or the model table's target)."""
        source = self._sources[base_model]
        body = request_body(served_model, prompt)
        if body is None:
            if prompt.token_ids is None:
                self.calls.labels("skipped").inc()
            return None  # token ids need no tokenizer at all
        pod = pick_pod(self._endpoints(), base_model)
        if pod is None:
            self.calls.labels("no_pod").inc()
            return None
        result, ids = await self._call(pod, body, source)
        self.calls.labels(result).inc()
        if ids is None:
            # The prompt's text is never logged: the pod, the result and the model are.
            log.debug("engine_tokenize_fallback", pod=pod.name, result=result, model=base_model)
        return ids

    async def _call(
        self, pod: Endpoint, body: bytes, source: EngineSource
    ) -> tuple[str, array | None]:
        session = self._session_now()
        limit = source.max_response_bytes
        try:
            async with asyncio.timeout(source.timeout_s):
                async with session.post(
                    f"http://{pod.address}/tokenize",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as response:
                    if response.status != 200:
                        return "error", None
                    if (response.content_length or 0) > limit:
                        return "bad_answer", None
                    # Chunk by chunk (a read returns what has arrived, not the whole
                    # answer), refusing as soon as the answer outgrows the limit.
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.content.iter_chunked(64 * 1024):
                        size += len(chunk)
                        if size > limit:
                            return "bad_answer", None
                        chunks.append(chunk)
                    raw = b"".join(chunks)
        except TimeoutError:
            return "timeout", None
        except (aiohttp.ClientError, OSError):
            return "error", None
        try:
            answer = _ANSWER.decode(raw)
            ids = array("I", answer.tokens)  # OverflowError: an id outside uint32
        except (msgspec.DecodeError, OverflowError):
            return "bad_answer", None
        if answer.count != len(ids) or not ids:
            return "bad_answer", None
        return "ok", ids


def pick_pod(endpoints: Iterable[Endpoint], model: str) -> Endpoint | None:
    """A healthy pod serving `model`, the least loaded (any pod renders alike)."""
    best: Endpoint | None = None
    for e in endpoints:
        if e.model != model or e.excluded:
            continue
        if best is None or (e.load, e.queue_depth) < (best.load, best.queue_depth):
            best = e
    return best


def request_body(model: str, prompt: Prompt) -> bytes | None:
    """vLLM's /tokenize body for the prompt, or None when it cannot say the same thing."""
    if prompt.text is not None:
        return msgspec.json.encode({"model": model, "prompt": prompt.text})
    if prompt.messages is None:
        return None
    options = prompt.chat
    body: dict[str, Any] = {"model": model}
    if options is not None:
        if options.documents is not None or options.reasoning_effort is not None:
            return None  # /tokenize takes neither
        body["add_generation_prompt"] = options.add_generation_prompt
        body["continue_final_message"] = options.continue_final_message
        body["add_special_tokens"] = options.add_special_tokens
        if options.tools is not None:
            body["tools"] = list(options.tools)
        if options.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = dict(options.chat_template_kwargs)
    turns = [_turn(m) for m in prompt.messages]
    if any(t is None for t in turns):
        return None
    body["messages"] = turns
    return msgspec.json.encode(body)


def _turn(message: ChatMessage) -> dict[str, Any] | None:
    """One parsed turn back in OpenAI's shape; None if it holds media (the stand-ins the
    parser put there are not what the engine would tokenize)."""
    content: Any = message.content
    if message.parts is not None:
        if any(part.get("type") != "text" for part in message.parts):
            return None
        content = [dict(part) for part in message.parts]
    turn: dict[str, Any] = {"role": message.role, "content": content}
    for key, value in (message.extra or {}).items():
        if key == "tool_calls":
            # The parser decoded each call's arguments; the API carries them as a string.
            value = [_call_with_string_arguments(call) for call in value]
        elif key == "reasoning_content":
            continue  # the parser's copy of `reasoning`
        turn[key] = value
    return turn


def _call_with_string_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(call)
    function = dict(out.get("function") or {})
    if not isinstance(function.get("arguments"), str):
        function["arguments"] = json.dumps(function.get("arguments", {}))
    out["function"] = function
    return out
