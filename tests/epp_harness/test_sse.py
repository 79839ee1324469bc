"""Reading a streamed completion: content, TTFT, usage, and every way a stream can end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable

from epp_harness.sse import read_stream


async def _lines(lines: Iterable[bytes]) -> AsyncIterator[bytes]:
    for line in lines:
        yield line


def _data(chunk: dict | str) -> bytes:
    return b"data: " + (chunk if isinstance(chunk, str) else json.dumps(chunk)).encode() + b"\n"


class StepClock:
    """Each reading is one second after the previous one."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _chat(content: str | None) -> dict:
    delta = {"role": "assistant"} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta}]}


async def test_chat_stream_gives_reply_ttft_and_the_last_usage() -> None:
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    body = [
        b": keep-alive comment\n",
        _data(_chat(None)),  # the role-only first chunk is not the first token
        b"\n",
        _data(_chat("Hel")),
        _data(_chat("lo")),
        _data({"choices": [], "usage": usage}),
        b"data: [DONE]\n",
        _data(_chat("after the end")),
    ]
    clock = StepClock()
    result = await read_stream(_lines(body), start=100.0, clock=clock)
    assert result.reply == "Hello"
    assert result.ttft_s == 1.0  # the clock's first reading: at the "Hel" chunk only
    assert result.usage == usage
    assert result.done and result.error is None


async def test_completion_text_counts_as_content() -> None:
    body = [
        _data({"choices": [{"text": "a"}]}),
        _data({"choices": [{"text": "b"}]}),
        b"data:[DONE]",
    ]
    result = await read_stream(_lines(body), start=0.0, clock=lambda: 0.25)
    assert (result.reply, result.ttft_s, result.done) == ("ab", 0.25, True)


async def test_a_stream_cut_before_done_is_not_done() -> None:
    result = await read_stream(_lines([_data(_chat("partial"))]), start=0.0)
    assert result.reply == "partial" and not result.done and result.error is None


async def test_an_error_event_stops_the_read() -> None:
    body = [_data(_chat("x")), _data({"error": {"message": "overloaded"}}), _data(_chat("y"))]
    result = await read_stream(_lines(body), start=0.0)
    assert result.error is not None and "overloaded" in result.error
    assert result.reply == "x" and not result.done


async def test_an_unparseable_chunk_stops_the_read() -> None:
    body = [_data("{not json"), _data(_chat("never read")), b"data: [DONE]\n"]
    result = await read_stream(_lines(body), start=0.0)
    assert result.error == "unparseable SSE chunk"
    assert result.reply == "" and result.ttft_s is None and not result.done


async def test_a_chunk_that_is_not_an_object_is_skipped() -> None:
    body = [_data("[1, 2]"), _data(_chat("ok")), b"data: [DONE]\n"]
    result = await read_stream(_lines(body), start=0.0)
    assert result.reply == "ok" and result.done and result.error is None
