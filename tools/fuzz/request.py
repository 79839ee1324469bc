"""atheris harness: request parsing and the blocks the router hashes (epp.request,
epp.prefix.blocks). Contract: any body is parsed or refused with a 4xx RequestRejected."""

from __future__ import annotations

import json
import sys

import atheris

with atheris.instrument_imports():
    from epp.conversation import BadConversation  # noqa: F401 (instrumented)
    from epp.prefix.blocks import prompt_blocks
    from epp.prefix.hashing import chain_seed
    from epp.request import (
        CHAT_PATH,
        COMPLETIONS_PATH,
        MESSAGES_PATH,
        RequestRejected,
        parse_request,
    )
    from epp.tokenization.estimate import ByteEstimateTokenizer

from harness import run

PATHS = [COMPLETIONS_PATH, CHAT_PATH, MESSAGES_PATH, "/v1/models"]
TOKENIZER = ByteEstimateTokenizer()


def test_one_input(data: bytes) -> None:
    if not data:
        return
    path = PATHS[data[0] % len(PATHS)]
    body = data[1:]
    try:
        request = parse_request(path, body, {"lora": "m"}, max_prompt_tokens=256)
        blocks = prompt_blocks(request.prompt, TOKENIZER, 16, chain_seed(request.model or ""), 16)
    except RequestRejected as exc:
        if not 400 <= exc.status < 500:
            raise AssertionError(f"status {exc.status}: {exc.message}") from None
        return
    if blocks.prompt_tokens < 0 or len(blocks.hashes) > 16:
        raise AssertionError(f"blocks out of range: {blocks}")


def seeds() -> list[bytes]:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    bodies = [
        (0, {"model": "m", "prompt": "hello world " * 10}),
        (0, {"model": "m", "prompt": [1, 2, 3, 4] * 20}),
        (0, {"model": "m", "prompt": [[1, 2], [3]]}),
        (1, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        (
            1,
            {
                "model": "lora",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}],
            },
        ),
        (
            1,
            {
                "model": "m",
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
        ),
        (
            2,
            {
                "model": "m",
                "system": "s",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "x"},
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AAAA",
                                },
                            },
                        ],
                    }
                ],
                "thinking": {"type": "enabled", "budget_tokens": 10},
            },
        ),
        (
            2,
            {
                "model": "m",
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
                    },
                ],
            },
        ),
    ]
    return [bytes([i]) + json.dumps(b).encode() for i, b in bodies]


if __name__ == "__main__":
    sys.exit(run("request", test_one_input, seeds()))
