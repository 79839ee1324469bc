"""Bounded parsing work for conversations far longer than routing reads: the head is cut
from a window of the list's first bytes, the tail is measured, never split into turns;
and what is kept is the same as splitting the whole list would keep."""

from __future__ import annotations

import json

import msgspec
import pytest

import epp.request.heads as heads_module
from epp.request import CHAT_PATH, MESSAGES_PATH, parse_request

MIB = 1024 * 1024


class CountingDecoder:
    """msgspec's list-of-raw decoder, counting the elements it produces."""

    def __init__(self, inner: msgspec.json.Decoder) -> None:
        self.inner = inner
        self.elements = 0

    def decode(self, data):
        out = self.inner.decode(data)
        self.elements += len(out)
        return out


def many_turns(size: int, nested: bool) -> list[dict]:
    turns: list[dict] = []
    n = 0
    total = 0
    while total < size:
        if nested and n % 3 == 0:
            # content parts: `},` inside a turn, and inside strings, must not cut there
            content: object = [
                {"type": "text", "text": "a},{b"},
                {"type": "text", "text": f"turn {n} }}, {{"},
            ]
        else:
            content = f"hi {n % 97} " * (1 + n % 5)
        turns.append({"role": "user" if n % 2 == 0 else "assistant", "content": content})
        total += len(json.dumps(turns[-1])) + 2
        n += 1
    return turns


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("path", [CHAT_PATH, MESSAGES_PATH])
def test_a_long_conversation_keeps_the_same_head_as_splitting_all_of_it(monkeypatch, nested, path):
    body = json.dumps(
        {"model": "m", "max_tokens": 1, "messages": many_turns(12 * MIB, nested)}
    ).encode()
    windowed = parse_request(path, body, {}).prompt
    monkeypatch.setattr(heads_module, "_WINDOWED", 10**9)  # always split all of it
    whole = parse_request(path, body, {}).prompt
    assert windowed.messages == whole.messages
    assert len(whole.messages) > 1000
    assert whole.omitted_tokens > 1_000_000
    assert windowed.omitted_tokens == pytest.approx(whole.omitted_tokens, rel=0.05)


def test_a_long_conversation_is_not_split_past_its_head(monkeypatch):
    """32 MiB of tiny turns (~800k): the turns split into elements are those of the
    window, not all of them."""
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": f"hi {i % 97}"} for i in range(800_000)],
        }
    ).encode()
    counting = CountingDecoder(heads_module._MESSAGE_RAWS)
    monkeypatch.setattr(heads_module, "_MESSAGE_RAWS", counting)
    prompt = parse_request(CHAT_PATH, body, {}).prompt
    assert 0 < len(prompt.messages) < counting.elements < 100_000
    assert prompt.omitted_tokens > 1_000_000


def test_one_huge_turn_or_image_is_split_whole_after_a_bounded_search():
    text = "lorem ipsum " * (3 * MIB)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    prompt = parse_request(CHAT_PATH, body, {}).prompt
    assert prompt.messages[0].content == text and prompt.omitted_tokens == 0
