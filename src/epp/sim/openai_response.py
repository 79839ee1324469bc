"""OpenAI/vLLM response bodies and SSE chunks for the simulator's deterministic output.

The output is filler words, one per token, the same for every request: the simulator
models timing and caching, not language, and fixed text keeps tests reproducible.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from epp.sim.openai_request import Endpoint

FILLER_WORDS = (
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
    "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et",
)  # fmt: skip

SSE_DONE = b"data: [DONE]\n\n"


def filler_token(index: int) -> str:
    """The text of output token `index` (0-based)."""
    return " " + FILLER_WORDS[index % len(FILLER_WORDS)]


def filler_text(count: int) -> str:
    return "".join(filler_token(i) for i in range(count))


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

    def full(self, text: str, finish_reason: str, usage_: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming body, sent once all tokens are out."""
        if self.endpoint is Endpoint.CHAT:
            body = self._envelope("chat.completion")
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        else:
            body = self._envelope("text_completion")
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        body["choices"] = [choice]
        body["usage"] = usage_
        return body

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role, as vLLM sends it with the first output."""
        body = self._envelope("chat.completion.chunk")
        body["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return body

    def token_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
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
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage` is set: no choices, only usage."""
        kind = "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else "text_completion"
        body = self._envelope(kind)
        body["choices"] = []
        body["usage"] = usage_
        return body
