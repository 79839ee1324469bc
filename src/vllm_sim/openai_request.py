"""OpenAI request bodies -> what the simulated engine needs, or an `ApiError`.

Bodies are hostile input: every field is type-checked and every failure becomes a 400 (or
404 for an unknown model) in vLLM's error shape, never an exception that escapes. Checks
run in vLLM's order: field types first, then the model name, then tokenization (the only
costly step, so it runs last).
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from epp.tokenize import ChatMessage, Tokenizer
from vllm_sim.openai_errors import ApiError
from vllm_sim.served_models import ServedModels

__all__ = [
    "ApiError",
    "Endpoint",
    "GenerationRequest",
    "ServedModels",
    "parse_generation_request",
    "parse_json_object",
]

DEFAULT_MAX_TOKENS = 16


class Endpoint(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated, tokenized completion or chat request."""

    endpoint: Endpoint
    model: str  # as the client named it: the base model or an adapter
    adapter: str | None
    tokens: array[int]  # uint32 prompt token ids
    max_tokens: int  # exactly this many output tokens are generated
    stream: bool
    include_usage: bool
    cache_salt: str | None
    return_token_ids: bool = False  # vLLM's extension: answer with prompt and output ids


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError covers both bad JSON and bad UTF-8; RecursionError, absurd nesting.
        raise ApiError(400, f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    return body


def parse_generation_request(
    endpoint: Endpoint, body: dict[str, Any], served: ServedModels, tokenizer: Tokenizer
) -> GenerationRequest:
    requested = _optional(body, "model", str)
    stream = bool(_optional(body, "stream", bool))
    stream_options = _optional(body, "stream_options", dict)
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise ApiError(
                400, "Stream options can only be defined when `stream=True`.", param="stream"
            )
        include_usage = bool(_optional(stream_options, "include_usage", bool, "stream_options"))
    return_token_ids = bool(_optional(body, "return_token_ids", bool))
    cache_salt = _optional(body, "cache_salt", str)
    if cache_salt == "":
        raise ApiError(400, "Parameter 'cache_salt' must not be empty.", param="cache_salt")
    if endpoint is Endpoint.CHAT:
        max_tokens = _max_tokens(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _max_tokens(body, "max_tokens")
        messages = _chat_messages(body.get("messages"))
        model, adapter = served.resolve(requested)
        tokens = tokenizer.encode_chat(messages)
    else:
        max_tokens = _max_tokens(body, "max_tokens")
        prompt = _completion_prompt(body.get("prompt"))
        model, adapter = served.resolve(requested)
        tokens = prompt if isinstance(prompt, array) else tokenizer.encode(prompt)
    if not tokens:
        raise ApiError(400, "The prompt is empty.", param="prompt")
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        adapter=adapter,
        tokens=tokens,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        stream=stream,
        include_usage=include_usage,
        cache_salt=cache_salt,
        return_token_ids=return_token_ids,
    )


def _optional(body: dict[str, Any], key: str, kind: type, where: str | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        name = f"{where}.{key}" if where else key
        raise ApiError(400, f"Parameter '{name}' must be of type {kind.__name__}.", param=name)
    return value


def _max_tokens(body: dict[str, Any], key: str) -> int | None:
    value: int | None = _optional(body, key, int)
    if value is not None and value < 1:
        raise ApiError(400, f"Parameter '{key}' must be at least 1, got {value}.", param=key)
    return value


def _completion_prompt(prompt: object) -> str | array[int]:
    """A string or token ids. A list of several prompts is a batch, which the sim refuses."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(
            400,
            "Parameter 'prompt' must be a string, a list of token ids, or a list of one of those.",
            param="prompt",
        )
    first = prompt[0]
    if isinstance(first, (str, list)):
        if len(prompt) != 1:
            raise ApiError(
                400,
                "Batched prompts are not supported: send one prompt per request.",
                param="prompt",
            )
        return first if isinstance(first, str) else _token_ids(first)
    return _token_ids(prompt)


def _token_ids(ids: list[Any]) -> array[int]:
    try:
        tokens = array("I", ids)
    except (TypeError, OverflowError):
        raise ApiError(400, "Token ids must be integers in [0, 2**32).", param="prompt") from None
    if not tokens:
        raise ApiError(400, "The prompt is empty.", param="prompt")
    return tokens


def _chat_messages(messages: object) -> list[ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "Parameter 'messages' must be a non-empty list.", param="messages")
    out: list[ChatMessage] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object.", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"{where}.role must be a non-empty string.", param="messages")
        out.append(ChatMessage(role, _message_text(message.get("content"), where)))
    return out


def _message_text(content: object, where: str) -> str:
    if content is None:
        return ""  # e.g. an assistant turn that only called tools
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            400, f"{where}.content must be a string or a list of parts.", param="messages"
        )
    texts: list[str] = []
    for part in content:
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ApiError(
                400,
                f"{where}.content parts must be {{'type': 'text', 'text': str}}; "
                "the simulator serves a text-only model.",
                param="messages",
            )
        texts.append(part["text"])
    # vLLM joins text parts with newlines when it flattens content for a string template.
    return "\n".join(texts)
