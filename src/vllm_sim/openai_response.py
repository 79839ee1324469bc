"""OpenAI/vLLM response bodies and SSE chunks for the simulator's deterministic output.

The output is filler words, one per token, the same for every request: the simulator
models timing and caching, not language, and fixed text keeps tests reproducible.

Every filler token is a space and a three-letter word, which the simulator's tokenizer
(`vllm_sim.tokenizer`) encodes as one token: a letter run after one space, short enough
not to be split. Its pre-tokenizer always cuts before such a space, whatever precedes
it, so the text of N tokens re-encodes to exactly the N token ids the engine generated
wherever it sits in a later prompt, as long as no letter follows it directly (a letter
would join the last word, as it would merge with BPE; the chat template ends the turn
with a special token). A client that sends a reply back thus reuses the blocks the
engine cached for it, as a real tokenizer re-encodes a model's reply to its own ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_sim.openai_request import Endpoint

FILLER_WORDS = (
    "sed", "sit", "est", "non", "vel", "nec", "per", "cum",
    "quo", "rem", "eos", "qui", "aut", "hic", "iam", "sum",
)  # fmt: skip

SSE_DONE = b"data: [DONE]\n\n"


def filler_token(index: int) -> str:
    """The text of output token `index` (0-based)."""
    return " " + FILLER_WORDS[index % len(FILLER_WORDS)]


def filler_text(count: int) -> str:
    return "".join(filler_token(i) for i in range(count))


def filler_token_ids(encode: Callable[[str], Sequence[int]]) -> tuple[int, ...]:
    """The token id of each filler token under `encode` (a tokenizer's), in order.

    Raises ValueError if a filler token is not exactly one token for it, since the
    generated ids would then not be what the text re-encodes to.
    """
    ids = []
    for index in range(len(FILLER_WORDS)):
        encoded = list(encode(filler_token(index)))
        if len(encoded) != 1:
            raise ValueError(f"filler token {filler_token(index)!r} is {len(encoded)} tokens")
        ids.append(encoded[0])
    return tuple(ids)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What every body of one response shares: kind, id, creation time and model name."""

    endpoint: Endpoint
    response_id: str
    created: int
    model: str

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
        }

    def full(
        self,
        text: str,
        finish_reason: str,
        usage_: dict[str, Any],
        token_ids: Sequence[int] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming body, sent once all tokens are out.

        With `token_ids` (vLLM's `return_token_ids`), the choice also carries the output
        token ids and the prompt's: in the choice for completions, at the top for chats.
        """
        if self.endpoint is Endpoint.CHAT:
            body = self._envelope("chat.completion")
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            if token_ids is not None:
                choice["token_ids"] = list(token_ids)
        else:
            body = self._envelope("text_completion")
            choice = _text_choice(text, finish_reason)
            if token_ids is not None:
                choice["prompt_token_ids"] = _ids(prompt_token_ids)
                choice["token_ids"] = list(token_ids)
        body["choices"] = [choice]
        body["usage"] = usage_
        if self.endpoint is Endpoint.CHAT and token_ids is not None:
            body["prompt_token_ids"] = _ids(prompt_token_ids)
        return body

    def role_chunk(self, prompt_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
        """Chat streams open with the assistant role, as vLLM sends it with the first output
        (and, with `return_token_ids`, the prompt's token ids)."""
        body = self._envelope("chat.completion.chunk")
        body["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        if prompt_token_ids is not None:
            body["prompt_token_ids"] = list(prompt_token_ids)
        return body

    def token_chunk(
        self,
        text: str,
        finish_reason: str | None,
        token_id: int | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """One streamed token; with `token_id` (`return_token_ids`) its id rides along,
        and `prompt_token_ids` on a completion's first chunk, as vLLM sends them."""
        if self.endpoint is Endpoint.CHAT:
            body = self._envelope("chat.completion.chunk")
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            body = self._envelope("text_completion")
            choice = _text_choice(text, finish_reason)
            if prompt_token_ids is not None:
                choice["prompt_token_ids"] = list(prompt_token_ids)
        if token_id is not None:
            choice["token_ids"] = [token_id]
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage` is set: no choices, only usage."""
        kind = "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else "text_completion"
        body = self._envelope(kind)
        body["choices"] = []
        body["usage"] = usage_
        return body


def _ids(token_ids: Sequence[int] | None) -> list[int] | None:
    return None if token_ids is None else list(token_ids)


def _text_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    """A completion choice, the same shape in a whole response and in a stream chunk."""
    return {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
