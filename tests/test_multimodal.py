"""Multimodal chat bodies: a base64 image is routed with bounded work and memory (never
decoded into a string, never tokenized as text, never counted as prompt tokens), and the
text before it hashes as the same chat without the image, so prefix affinity holds."""

from __future__ import annotations

import base64
import json
import random
import tracemalloc

import pytest
from tokenizer_fixtures import tokenizer_dir

from epp.conversation import HashedMedia
from epp.prefix.blocks import prompt_blocks
from epp.request import CHAT_PATH, DEFAULT_MAX_PROMPT_TOKENS, MESSAGES_PATH, parse_request
from epp.tokenization import load_tokenizer_dir

MIB = 1024 * 1024
SYSTEM = "You are a careful assistant who describes pictures for a museum catalogue. " * 80
QUESTION = "What is in this picture?"


def image_part(size: int, seed: int = 1) -> dict:
    raw = random.Random(seed).randbytes(size * 3 // 4)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def chat_body(messages: list[dict]) -> bytes:
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 8}).encode()


def with_image(size: int = 5 * MIB, seed: int = 1) -> list[dict]:
    parts = [{"type": "text", "text": "What is in this picture?"}, image_part(size, seed)]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def without_image() -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]},
    ]


def test_a_base64_image_is_not_decoded_into_a_string():
    body = chat_body(with_image())
    assert len(body) > 5 * MIB
    tracemalloc.start()
    try:
        request = parse_request(CHAT_PATH, body, {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Before: the data URI as a str, its canonical JSON and that JSON's bytes (~3x). Now
    # at most a window of the list's bytes searched for a cut (_windowed_head).
    assert peak < len(body) / 2, f"parsing allocated {peak / MIB:.1f} MiB for a 5 MiB image"
    user = request.prompt.messages[1]
    assert user.content.startswith("<image:") and user.content.endswith("What is in this picture?")
    assert user.parts == ({"type": "text", "text": "What is in this picture?"}, {"type": "image"})


def test_equal_images_stand_in_equally_and_different_ones_differently():
    def stand_in(seed: int) -> str:
        return (
            parse_request(CHAT_PATH, chat_body(with_image(MIB, seed)), {})
            .prompt.messages[1]
            .content
        )

    assert stand_in(1) == stand_in(1) != stand_in(2)
    assert HashedMedia("image", "ab").stand_in == "<image:ab>"


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_the_text_before_an_image_hashes_as_without_it(name):
    """The blocks of the system prompt (and the user turn's opening) are the same with
    and without the 5 MiB image: a pod that served the text-only chat keeps the affinity.
    The image itself costs a stand-in of a few tokens, not 1.3M pseudo-tokens."""
    tokenizer = load_tokenizer_dir(tokenizer_dir(name))
    blocks = {}
    for label, messages in (("image", with_image()), ("text", without_image())):
        prompt = parse_request(CHAT_PATH, chat_body(messages), {}).prompt
        blocks[label] = prompt_blocks(prompt, tokenizer, 16, 7, 8192)
    image, text = blocks["image"], blocks["text"]
    common = 0
    for a, b in zip(image.hashes, text.hashes, strict=False):
        if a != b:
            break
        common += 1
    assert len(text.hashes) > 40
    assert common >= len(text.hashes) - 1  # at most the block holding the stand-in differs
    assert image.prompt_tokens - text.prompt_tokens < 40


def test_an_image_in_an_omitted_turn_is_not_counted_as_prompt_tokens():
    """A conversation past the head keeps counting its later turns from their JSON size;
    a base64 image there counts as its stand-in, not as 5 MiB / 4 pseudo-tokens."""
    long_text = "word " * (DEFAULT_MAX_PROMPT_TOKENS * 2)
    messages = [
        {"role": "user", "content": long_text},
        {"role": "user", "content": [image_part(5 * MIB), {"type": "text", "text": "and this?"}]},
        {"role": "assistant", "content": "A cat."},
    ]
    prompt = parse_request(CHAT_PATH, chat_body(messages), {}).prompt
    assert len(prompt.messages) == 1
    assert 0 < prompt.omitted_tokens < 100, prompt.omitted_tokens


def test_a_small_image_part_keeps_its_canonical_stand_in():
    """Parts up to 16 KiB are decoded as before: the stand-in hashes their canonical JSON,
    whatever the key order the client wrote."""
    part = {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}
    swapped = {
        "image_url": {"detail": "low", "url": "https://example.com/a.png"},
        "type": "image_url",
    }
    contents = [
        parse_request(CHAT_PATH, chat_body([{"role": "user", "content": [p]}]), {})
        .prompt.messages[0]
        .content
        for p in (part, swapped)
    ]
    assert contents[0] == contents[1] and contents[0].startswith("<image:")


def anthropic_body(blocks: list[dict]) -> bytes:
    messages = [{"role": "user", "content": blocks}]
    return json.dumps(
        {"model": "m", "system": SYSTEM, "messages": messages, "max_tokens": 8}
    ).encode()


def anthropic_image(size: int, seed: int = 1) -> dict:
    data = base64.b64encode(random.Random(seed).randbytes(size * 3 // 4)).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def test_an_anthropic_image_block_is_not_decoded_into_a_string():
    body = anthropic_body([{"type": "text", "text": QUESTION}, anthropic_image(5 * MIB)])
    tracemalloc.start()
    try:
        request = parse_request(MESSAGES_PATH, body, {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body) / 2, f"parsing allocated {peak / MIB:.1f} MiB for a 5 MiB image"
    system, user = request.prompt.messages
    assert system.content == SYSTEM
    assert user.content.startswith("<image:") and user.content.endswith(QUESTION)
    assert user.parts == ({"type": "text", "text": QUESTION}, {"type": "image"})
    other = parse_request(
        MESSAGES_PATH,
        anthropic_body([{"type": "text", "text": QUESTION}, anthropic_image(5 * MIB, 2)]),
        {},
    )
    assert other.prompt.messages[1].content != user.content
