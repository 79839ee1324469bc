"""OpenAI request bodies -> the few facts the scheduler needs.

Only what routing uses is extracted: model (and the LoRA adapter it names), the prompt
(completion text, token ids, or chat messages), stream and cache_salt. Everything else
in the body is passed to the pod untouched. Malformed input raises `RequestRejected`
carrying the HTTP status and an OpenAI-style message; it never raises anything else.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from epp.tokenize import ChatMessage

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"

RequestKind = Literal["completion", "chat", "other"]


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


# The body is decoded by msgspec into this struct: only the fields routing reads become
# Python objects; every other field is validated as JSON and skipped. `prompt` and
# `messages` stay raw here and are decoded with their own typed decoders, so that type and
# range checks of every element happen in C and each error names its parameter.
class _Body(msgspec.Struct):
    model: Any = None
    cache_salt: Any = None
    stream: Any = msgspec.UNSET
    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class _Message(msgspec.Struct):
    role: Annotated[str, msgspec.Meta(min_length=1)]
    # None: assistant turns with tool calls carry no content.
    content: str | list[Any] | None = None


_BODY = msgspec.json.Decoder(_Body)
_PROMPT_TEXT = msgspec.json.Decoder(str)
_PROMPT_TEXTS = msgspec.json.Decoder(list[str])
_PROMPT_IDS = msgspec.json.Decoder(list[TokenId])
_PROMPT_ID_LISTS = msgspec.json.Decoder(list[list[TokenId]])
_MESSAGES = msgspec.json.Decoder(list[_Message])
# A JSON string escape of a UTF-16 surrogate (\ud800-\udfff): legal only in pairs.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _invalid_json(body: bytes, exc: Exception) -> RequestRejected:
    message = f"the body is not valid JSON: {exc}"
    if _SURROGATE_ESCAPE.search(body):
        # msgspec reports a lone high surrogate as "truncated": name the real cause.
        message += (
            " (strings must be valid Unicode: an unpaired UTF-16 surrogate escape such as"
            " \\ud800 is not allowed)"
        )
    return _bad(message, reason="invalid-json")


def _is_null(raw: msgspec.Raw) -> bool:
    return len(raw) == 0 or (len(raw) == 4 and bytes(raw) == b"null")


def _completion_prompt(raw: msgspec.Raw) -> Prompt:
    if _is_null(raw):
        raise _bad("a completion request needs 'prompt'", "prompt")
    head = bytes(memoryview(raw)[:64]).lstrip()
    if head.startswith(b'"'):
        return Prompt(text=_PROMPT_TEXT.decode(raw))
    if head.startswith(b"["):
        # The first element says which form the list is: strings, ids, or lists of ids.
        first = head[1:].lstrip()[:1]
        try:
            if first == b'"':
                # A batch of prompts is one request to one pod; its first prompt leads.
                return Prompt(text=_PROMPT_TEXTS.decode(raw)[0])
            if first == b"[":
                return Prompt(token_ids=array("I", _PROMPT_ID_LISTS.decode(raw)[0]))
            if first.isdigit() or first == b"-":
                return Prompt(token_ids=array("I", _PROMPT_IDS.decode(raw)))
        except msgspec.ValidationError as exc:
            if first != b'"':
                raise _bad(
                    f"'prompt' token ids must be integers in [0, 2^32): {exc}", "prompt"
                ) from None
    raise _bad("'prompt' must be a string, a list of strings, or token ids", "prompt")


def _content_text(content: str | list[Any] | None, index: int) -> str:
    if content is None:
        return ""  # assistant turns with tool calls carry no content
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict):
            raise _bad(f"messages[{index}].content parts must be objects", "messages")
        if part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"messages[{index}] text part needs a string 'text'", "messages")
            parts.append(text)
        else:
            # Images and audio: stand in with their reference so equal media hash equal.
            try:
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
            except (ValueError, TypeError, RecursionError):
                raise _bad(
                    f"messages[{index}].content has a part that cannot be read", "messages"
                ) from None
    return "\n".join(parts)


def _chat_prompt(raw: msgspec.Raw) -> Prompt:
    if _is_null(raw):
        raise _bad("a chat request needs a non-empty 'messages' list", "messages")
    try:
        messages = _MESSAGES.decode(raw)
    except msgspec.ValidationError as exc:
        # "Expected `object`, got `str` - at `$[0]`" -> "... at `messages[0]`"
        detail = str(exc).replace("`$", "`messages")
        raise _bad(f"invalid 'messages': {detail}", "messages") from None
    if not messages:
        raise _bad("a chat request needs a non-empty 'messages' list", "messages")
    return Prompt(
        messages=tuple(
            ChatMessage(m.role, m.content)
            if type(m.content) is str
            else ChatMessage(m.role, _content_text(m.content, i))
            for i, m in enumerate(messages)
        )
    )


def kind_of(path: str) -> RequestKind:
    route = path.split("?", 1)[0].rstrip("/")
    if route == COMPLETIONS_PATH:
        return "completion"
    if route == CHAT_PATH:
        return "chat"
    return "other"


def parse_request(
    path: str, body: bytes | bytearray | memoryview, adapters: Mapping[str, str]
) -> InferenceRequest:
    """Parse an OpenAI request body; `adapters` maps adapter names to their base model.

    The body is decoded with msgspec (measured 1.4-2.3x faster than `json.loads` on large
    bodies, see docs/benchmarks/pause.md), which also rejects what `json.loads` would let
    through to fail later: unpaired UTF-16 surrogates in any string, NaN/Infinity, and
    numbers out of float range are all a 400 here, never a 500 further on.
    """
    kind = kind_of(path)
    if not body:
        if kind == "other":
            return InferenceRequest(kind, None, None, None, Prompt())
        raise _bad("the request has no body; expected a JSON object")
    try:
        data = _BODY.decode(body)
    except msgspec.ValidationError as exc:
        if str(exc).startswith("Expected `object`"):
            raise _bad("the body must be a JSON object") from None
        raise _invalid_json(body, exc) from None  # e.g. a number out of range (1e999)
    except msgspec.DecodeError as exc:
        raise _invalid_json(body, exc) from None
    except RecursionError:
        raise _bad("the body is nested too deeply to parse", reason="invalid-json") from None
    model = data.model
    if kind != "other" and (not isinstance(model, str) or not model):
        raise _bad("the request needs a string 'model'", "model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    salt = data.cache_salt
    if salt is not None and not isinstance(salt, str):
        raise _bad("'cache_salt' must be a string", "cache_salt")
    stream = False if data.stream is msgspec.UNSET else data.stream
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    try:
        if kind == "completion":
            prompt = _completion_prompt(data.prompt)
        elif kind == "chat":
            prompt = _chat_prompt(data.messages)
        else:
            prompt = Prompt()
    except msgspec.DecodeError as exc:  # the raw value was validated already: defensive
        raise _invalid_json(body, exc) from None
    except RecursionError:
        raise _bad("the body is nested too deeply to parse", reason="invalid-json") from None
    adapter = model if model in adapters else None
    base = adapters[model] if adapter else model
    return InferenceRequest(kind, model, base, adapter, prompt, stream, salt)
