"""OpenAI request bodies -> the few facts the scheduler needs.

Only what routing uses is extracted: model (and the LoRA adapter it names), the prompt
(completion text, token ids, or chat messages), stream and cache_salt. Everything else
in the body is passed to the pod untouched. Malformed input raises `RequestRejected`
carrying the HTTP status and an OpenAI-style message; it never raises anything else.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from epp.tokenize import ChatMessage

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

RequestKind = Literal["completion", "chat", "other"]


class RequestRejected(Exception):
    """A request the EPP answers itself (ImmediateResponse) instead of routing."""

    def __init__(self, status: int, message: str, *, reason: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.param = param

    @property
    def error_type(self) -> str:
        return {
            400: "BadRequestError",
            404: "NotFoundError",
            413: "RequestTooLargeError",
            429: "RateLimitError",
            503: "ServiceUnavailableError",
        }.get(self.status, "InternalServerError")

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.status,
        }
        return json.dumps({"error": error}).encode()


@dataclass(frozen=True, slots=True)
class Prompt:
    """Exactly one of text, token_ids or messages is set (none for bodiless requests)."""

    text: str | None = None
    token_ids: array | None = None
    messages: tuple[ChatMessage, ...] | None = None


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    kind: RequestKind
    model: str | None
    base_model: str | None
    adapter: str | None
    prompt: Prompt
    stream: bool = False
    cache_salt: str | None = None


def _bad(
    message: str, param: str | None = None, reason: str = "invalid-request"
) -> RequestRejected:
    return RequestRejected(400, message, reason=reason, param=param)


def _token_ids(value: list[Any], param: str) -> array:
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value):
        raise _bad(f"'{param}' token ids must be integers in [0, 2^32)", param)
    return array("I", value)


def _completion_prompt(body: Mapping[str, Any]) -> Prompt:
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("a completion request needs 'prompt'", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if all(isinstance(p, str) for p in prompt):
            # A batch of prompts is one request to one pod; its first prompt leads the cache.
            return Prompt(text=first)
        if isinstance(first, int):
            return Prompt(token_ids=_token_ids(prompt, "prompt"))
        if all(isinstance(p, list) for p in prompt):
            return Prompt(token_ids=_token_ids(first, "prompt"))
    raise _bad("'prompt' must be a string, a list of strings, or token ids", "prompt")


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""  # assistant turns with tool calls carry no content
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping):
                raise _bad(f"messages[{index}].content parts must be objects", "messages")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _bad(f"messages[{index}] text part needs a string 'text'", "messages")
                parts.append(text)
            else:
                # Images and audio: stand in with their reference so equal media hash equal.
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "\n".join(parts)
    raise _bad(f"messages[{index}].content must be a string or a list of parts", "messages")


def _chat_prompt(body: Mapping[str, Any]) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("a chat request needs a non-empty 'messages' list", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise _bad(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}] needs a string 'role'", "messages")
        parsed.append(ChatMessage(role=role, content=_content_text(message.get("content"), i)))
    return Prompt(messages=tuple(parsed))


def kind_of(path: str) -> RequestKind:
    route = path.split("?", 1)[0].rstrip("/")
    if route == COMPLETIONS_PATH:
        return "completion"
    if route == CHAT_PATH:
        return "chat"
    return "other"


def parse_request(path: str, body: bytes, adapters: Mapping[str, str]) -> InferenceRequest:
    """Parse an OpenAI request body; `adapters` maps adapter names to their base model."""
    kind = kind_of(path)
    if not body:
        if kind == "other":
            return InferenceRequest(kind, None, None, None, Prompt())
        raise _bad("the request has no body; expected a JSON object")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"the body is not valid JSON: {exc}", reason="invalid-json") from None
    except RecursionError:
        raise _bad("the body is nested too deeply to parse", reason="invalid-json") from None
    if not isinstance(data, dict):
        raise _bad("the body must be a JSON object")
    model = data.get("model")
    if kind != "other" and (not isinstance(model, str) or not model):
        raise _bad("the request needs a string 'model'", "model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    salt = data.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad("'cache_salt' must be a string", "cache_salt")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    if kind == "completion":
        prompt = _completion_prompt(data)
    elif kind == "chat":
        prompt = _chat_prompt(data)
    else:
        prompt = Prompt()
    adapter = model if model in adapters else None
    base = adapters[model] if adapter else model
    return InferenceRequest(kind, model, base, adapter, prompt, stream, salt)
