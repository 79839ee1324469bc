"""The seeded multi-turn chat workload and the streaming client that drives it.

Text is made of the words the tiny model's tokenizer was trained on
(`tools/vllm_check/build_model.py`), so one word is about one real token and the sizes
below are close to real token counts (the run records vLLM's own `prompt_tokens`).

Replies are greedy (temperature 0) with a frequency penalty (plain greedy decoding of
the random model repeats one newline, which the chat template trims away), so for a given
prompt the engine returns the same text whichever server answers: every router faces the
same histories, turn after turn (each record keeps a hash of its reply to check this).
Per-request `seed` is not used: vLLM 0.32's CPU runner crashes the engine with
`RuntimeError: CPU Generator does not use offset` when a seeded request's sampled token
is discarded during a chunked prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_check"))
from build_model import WORDS

UPSTREAM_HEADER = "x-fleet-upstream"  # added by our Envoy config: %UPSTREAM_HOST%
DESTINATION_ECHO_HEADER = "x-fleet-epp-destination"  # the EPP's list, echoed by Envoy
REQUEST_ID_HEADER = "x-fleet-request-id"  # Envoy's x-request-id: the EPP logs decisions by it
ENVOY_START_HEADER = "x-fleet-envoy-start"  # when Envoy got the request (unix s, %START_TIME%)
_ERROR_LIMIT = 300


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int = 0
    conversations: int = 16
    turns: int = 4
    system_prompts: int = 4
    system_prompt_words: int = 600
    user_message_words: int = 60
    max_tokens: int = 48
    think_time_ms: tuple[float, float] = (0.0, 50.0)
    model: str = "tiny-llama"


@dataclass(frozen=True)
class Conversation:
    conversation: int
    system_prompt: int
    user_messages: tuple[str, ...]
    think_times_s: tuple[float, ...]


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    system_prompts: tuple[str, ...]
    conversations: tuple[Conversation, ...] = field(repr=False)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def generate(spec: WorkloadSpec) -> Workload:
    """Deterministic in spec.seed: the same spec gives the same bytes."""
    rng = random.Random(spec.seed)
    prompts = tuple(
        f"You are assistant number {i}. " + _words(rng, spec.system_prompt_words)
        for i in range(spec.system_prompts)
    )
    # Balanced groups in shuffled order: each prompt opens the same number of conversations.
    assignment = [i % spec.system_prompts for i in range(spec.conversations)]
    rng.shuffle(assignment)
    low, high = spec.think_time_ms
    conversations = tuple(
        Conversation(
            conversation=c,
            system_prompt=p,
            user_messages=tuple(
                f"Conversation {c} turn {t}: " + _words(rng, spec.user_message_words)
                for t in range(spec.turns)
            ),
            think_times_s=tuple(
                0.0 if t == 0 else rng.uniform(low, high) / 1000.0 for t in range(spec.turns)
            ),
        )
        for c, p in enumerate(assignment)
    )
    return Workload(spec, prompts, conversations)


def request_body(workload: Workload, conv: Conversation, turn: int, replies: list[str]) -> dict:
    messages = [{"role": "system", "content": workload.system_prompts[conv.system_prompt]}]
    for t in range(turn):
        messages.append({"role": "user", "content": conv.user_messages[t]})
        messages.append({"role": "assistant", "content": replies[t]})
    messages.append({"role": "user", "content": conv.user_messages[turn]})
    return {
        "model": workload.spec.model,
        "messages": messages,
        "max_tokens": workload.spec.max_tokens,
        # Every request generates exactly max_tokens, reproducibly.
        "ignore_eos": True,
        "temperature": 0.0,
        "frequency_penalty": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    system_prompt: int
    started_s: float = 0.0
    latency_s: float | None = None
    ttft_s: float | None = None
    status: int | None = None
    upstream: str | None = None
    server: str | None = None
    epp_destination: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    reply_sha: str | None = None
    error: str | None = None
    # Wall clock (unix seconds), to line up with Envoy and the EPP's log: when the client
    # sent the request, when Envoy started it, when the EPP routed it (run.py fills that
    # in from the EPP's log by request id).
    request_id: str | None = None
    sent_unix: float | None = None
    envoy_start_unix: float | None = None
    epp_routed_unix: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


async def _send(
    session: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord, t0: float
) -> str | None:
    start = time.monotonic()
    rec.sent_unix = round(time.time(), 6)
    rec.started_s = round(start - t0, 4)
    parts: list[str] = []
    done = False
    try:
        async with session.post(url, json=body) as resp:
            rec.status = resp.status
            rec.upstream = resp.headers.get(UPSTREAM_HEADER)
            rec.epp_destination = resp.headers.get(DESTINATION_ECHO_HEADER)
            rec.request_id = resp.headers.get(REQUEST_ID_HEADER)
            with contextlib.suppress(TypeError, ValueError):
                rec.envoy_start_unix = float(resp.headers.get(ENVOY_START_HEADER))
            if resp.status != 200:
                text = await resp.text(errors="replace")
                reason = resp.headers.get("x-request-dropped-reason")
                rec.error = f"HTTP {resp.status}{f' ({reason})' if reason else ''}: {text}"[
                    :_ERROR_LIMIT
                ]
                return None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"error event: {chunk['error']}"[:_ERROR_LIMIT]
                    break
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.monotonic() - start
                        parts.append(text)
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:_ERROR_LIMIT]
    finally:
        rec.latency_s = time.monotonic() - start
    if rec.error is None and not done:
        rec.error = "stream ended before [DONE]"
    if rec.error is not None:
        return None
    reply = "".join(parts)
    rec.reply_sha = hashlib.sha256(reply.encode()).hexdigest()[:12]
    return reply


async def run_workload(
    base_url: str,
    workload: Workload,
    concurrency: int,
    servers_by_address: dict[str, str],
    timeout_s: float = 180.0,
) -> tuple[list[RequestRecord], float]:
    """Every conversation, `concurrency` at a time; returns the records and the wall time."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    records: list[RequestRecord] = []
    limit = asyncio.Semaphore(concurrency)

    async def conversation(session: aiohttp.ClientSession, conv: Conversation) -> None:
        async with limit:
            replies: list[str] = []
            for turn in range(len(conv.user_messages)):
                if conv.think_times_s[turn] > 0:
                    await asyncio.sleep(conv.think_times_s[turn])
                rec = RequestRecord(conv.conversation, turn, conv.system_prompt)
                reply = await _send(
                    session, url, request_body(workload, conv, turn, replies), rec, t0
                )
                rec.server = servers_by_address.get(rec.upstream or "", rec.upstream)
                records.append(rec)
                if reply is None:
                    return  # the next turn would need this reply
                replies.append(reply)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(conversation(session, c) for c in workload.conversations))
        wall = time.monotonic() - t0
    records.sort(key=lambda r: (r.conversation, r.turn))
    return records, wall
