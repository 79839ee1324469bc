"""Reading one streamed (SSE) OpenAI-style completion: reply text, TTFT, usage, how it ended.

`read_stream` takes the response body as an async iterable of lines (aiohttp's
`response.content` is one), so it runs the same against a socket and against a list in a
test. It never raises for a bad stream: what went wrong is in `StreamResult.error`, and a
stream that ends without `data: [DONE]` has `done` False.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

# The simulated pod names itself in this response header (vllm_sim.server.POD_HEADER).
POD_HEADER = "x-sim-pod"
_ERROR_LIMIT = 300


@dataclass(slots=True)
class StreamResult:
    reply: str = ""
    ttft_s: float | None = None  # from `start` to the first chunk with content
    usage: dict | None = None  # the last `usage` object of the stream
    done: bool = False  # `data: [DONE]` arrived
    error: str | None = None  # an unparseable chunk or an error event stopped the read


async def read_stream(
    lines: AsyncIterable[bytes],
    start: float,
    clock: Callable[[], float] = time.monotonic,
) -> StreamResult:
    """Read `data:` lines until `[DONE]`, an error event or the end of the body.

    `start` is the `clock()` reading when the request was sent; TTFT is measured from it.
    Content is a chat `delta.content` or a completion `text`.
    """
    result = StreamResult()
    parts: list[str] = []
    async for raw_line in lines:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            result.done = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            result.error = "unparseable SSE chunk"
            break
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            result.error = f"error event: {str(chunk['error'])[:_ERROR_LIMIT]}"
            break
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text") or ""
            if text:
                if result.ttft_s is None:
                    result.ttft_s = clock() - start
                parts.append(text)
        if isinstance(chunk.get("usage"), dict):
            result.usage = chunk["usage"]
    result.reply = "".join(parts)
    return result
