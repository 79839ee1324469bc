"""What request parsing hands the router: the request as the proxy forwards it, the few
facts routing reads of its body, and the refusal the EPP answers itself."""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from epp.tokenization.protocol import ChatMessage, ChatOptions

# Routing hashes at most prefix.max_blocks_per_request (8,192) blocks of 16 tokens: the
# parser keeps that much of a prompt by default (see Prompt).
DEFAULT_MAX_PROMPT_TOKENS = 8192 * 16

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API (vLLM serves it too)

RequestKind = Literal["completion", "chat", "messages", "other"]

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


@dataclass(frozen=True, slots=True)
class IncomingRequest:
    """One request as the proxy forwards it: what the Router routes (`prepare`,
    `route_now`, `route`). `subset` is the proxy's hint of the pods it may use (None: any);
    `headers` are the request's headers, lower-case names."""

    path: str
    body: bytes
    request_id: str
    subset: frozenset[str] | None = None
    headers: Mapping[str, str] | None = None


class RequestRejected(Exception):
    """A request the EPP answers itself (ImmediateResponse) instead of routing."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        reason: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.param = param
        # Sent as a Retry-After header (whole seconds) when set: refusals under load.
        self.retry_after_s = retry_after_s

    @property
    def error_type(self) -> str:
        return _ERROR_TYPES.get(self.status, "InternalServerError")

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.status,
        }
        return json.dumps({"error": error}).encode()


def bad(message: str, param: str | None = None, reason: str = "invalid-request") -> RequestRejected:
    """A 400 naming the parameter at fault."""
    return RequestRejected(400, message, reason=reason, param=param)


@dataclass(frozen=True, slots=True)
class Prompt:
    """Exactly one of text, token_ids or messages is set (none for bodiless requests).

    Bounded work and memory: a token-id prompt or a conversation far longer than routing
    can use (`max_prompt_tokens` of `parse_request`) keeps only its head: at most the first
    `max_prompt_tokens` ids, or the first turns covering at least that many pseudo-tokens.
    `omitted_tokens` counts the rest: exactly for ids, estimated for turns (their JSON
    bytes / 4). The rest is checked as JSON, not as ids or turns: the engine validates it.
    `chat` carries, with messages, what the engine's chat template reads besides them.
    """

    text: str | None = None
    token_ids: array | None = None
    messages: tuple[ChatMessage, ...] | None = None
    omitted_tokens: int = 0
    chat: ChatOptions | None = None


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    kind: RequestKind
    model: str | None
    base_model: str | None
    adapter: str | None
    prompt: Prompt
    stream: bool = False
    cache_salt: str | None = None


def kind_of(path: str) -> RequestKind:
    """The route a path names, whatever its query string and trailing slash."""
    route = path.split("?", 1)[0].rstrip("/")
    if route == COMPLETIONS_PATH:
        return "completion"
    if route == CHAT_PATH:
        return "chat"
    if route == MESSAGES_PATH:
        return "messages"
    return "other"
