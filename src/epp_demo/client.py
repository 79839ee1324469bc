"""Drive a workload against an OpenAI-compatible base URL and time every request.

Conversations run concurrently up to a limit; the turns of one conversation run in order,
each carrying the reply the server returned for the previous one. Every request streams
(SSE) and asks for usage on the last chunk, which is where the pod reports how many
prompt tokens it found in its prefix cache.

Nothing here raises for a failed request: it becomes a record with `error` set, and the
conversation it belonged to stops (its next turn would need the missing reply).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import aiohttp

from epp.datalayer.metrics_parser import MetricsFormatError, PodMetrics, parse_vllm_metrics
from epp_demo.workload import Conversation, Workload, chat_request_body, turn_messages
from epp_harness.sse import POD_HEADER, read_stream

_ERROR_BODY_LIMIT = 300

ProgressCallback = Callable[[int, int], None]


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are seconds; `started_s` is relative to the run start."""

    conversation_id: int
    turn_index: int
    system_prompt_index: int
    started_s: float
    latency_s: float
    status: int | None = None
    ttft_s: float | None = None
    pod: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


def _apply_usage(record: RequestRecord, usage: dict | None) -> None:
    if not usage:
        return
    record.prompt_tokens = usage.get("prompt_tokens")
    record.output_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    record.cached_tokens = cached if isinstance(cached, int) else None


async def _send_turn(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    record: RequestRecord,
    run_start: float,
) -> str | None:
    """Send one request, fill `record`, return the reply text (None on failure)."""
    start = time.monotonic()
    record.started_s = start - run_start
    try:
        async with session.post(url, json=body) as response:
            record.status = response.status
            record.pod = response.headers.get(POD_HEADER)
            if response.status != 200:
                text = await response.text(errors="replace")
                record.error = f"HTTP {response.status}: {text[:_ERROR_BODY_LIMIT]}"
                return None
            stream = await read_stream(response.content, start)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_LIMIT]
        return None
    finally:
        record.latency_s = time.monotonic() - start
    record.ttft_s = stream.ttft_s
    _apply_usage(record, stream.usage)
    if stream.error is not None:
        record.error = stream.error
    elif not stream.done:
        record.error = "stream ended before [DONE]"
    return stream.reply if record.error is None else None


async def _run_conversation(
    session: aiohttp.ClientSession,
    url: str,
    workload: Workload,
    conversation: Conversation,
    run_start: float,
    records: list[RequestRecord],
    on_record: Callable[[], None],
) -> None:
    replies: list[str] = []
    for turn_index, turn in enumerate(conversation.turns):
        if turn.think_time_s > 0:
            await asyncio.sleep(turn.think_time_s)
        messages = turn_messages(workload, conversation, turn_index, replies)
        record = RequestRecord(
            conversation_id=conversation.conversation_id,
            turn_index=turn_index,
            system_prompt_index=conversation.system_prompt_index,
            started_s=0.0,
            latency_s=0.0,
        )
        reply = await _send_turn(
            session, url, chat_request_body(workload.spec, messages), record, run_start
        )
        records.append(record)
        on_record()
        if reply is None:
            return
        replies.append(reply)


async def run_workload(
    base_url: str,
    workload: Workload,
    *,
    concurrency: int = 8,
    request_timeout_s: float = 120.0,
    progress: ProgressCallback | None = None,
) -> list[RequestRecord]:
    """Run every conversation of `workload` against `base_url`; one record per request sent.

    `concurrency` bounds the conversations in flight (each has at most one request out).
    `progress(done, total)` is called after every request.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    url = base_url.rstrip("/") + "/v1/chat/completions"
    total = workload.total_requests
    records: list[RequestRecord] = []
    limit = asyncio.Semaphore(concurrency)

    def on_record() -> None:
        if progress is not None:
            progress(len(records), total)

    async def bounded(conversation: Conversation) -> None:
        async with limit:
            await _run_conversation(
                session, url, workload, conversation, run_start, records, on_record
            )

    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        run_start = time.monotonic()
        await asyncio.gather(*(bounded(c) for c in workload.conversations))
    records.sort(key=lambda r: (r.conversation_id, r.turn_index))
    return records


async def scrape_pod_metrics(
    metrics_urls: dict[str, str], *, timeout_s: float = 5.0
) -> dict[str, PodMetrics]:
    """Each pod's metrics page, read by the router's parser, by pod name; a pod that does not
    answer, or answers with something that is not a vLLM page, is left out."""

    async def one(session: aiohttp.ClientSession, url: str) -> PodMetrics | None:
        try:
            async with session.get(url) as response:
                if response.status != 200:
                    return None
                return parse_vllm_metrics(await response.text(errors="replace"))
        except (TimeoutError, aiohttp.ClientError, OSError, MetricsFormatError):
            return None

    names: Sequence[str] = list(metrics_urls)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*(one(session, metrics_urls[n]) for n in names))
    return {name: page for name, page in zip(names, results, strict=True) if page is not None}
