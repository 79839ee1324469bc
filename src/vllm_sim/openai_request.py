"""OpenAI request bodies -> what the simulated engine needs, or an `ApiError`.

Bodies are hostile input: every field is type-checked and every failure becomes a 400 (or
404 for an unknown model) in vLLM's error shape, never an exception that escapes. Checks
run in vLLM's order: field types first, then the model name, then tokenization (the only
costly step, so it runs last).

Tokenizing follows vLLM: a completion prompt as text gets the BOS token
(`add_special_tokens=True`), token ids are taken as they are, and a chat is rendered
through the chat template (`add_generation_prompt`, default true). `engine_prompt` adds
the block hashes (`vllm_sim.hashing`): it is everything the pod does to a request body
before the engine sees it, and what the virtual-time benchmark calls to see a prompt as
the simulated pod sees it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from vllm_sim.hashing import BlockHash, block_hashes
from vllm_sim.openai_errors import ApiError
from vllm_sim.served_models import ServedModels
from vllm_sim.tokenizer import ChatMessage, Tokenizer

__all__ = [
    "ApiError",
    "Endpoint",
    "EnginePrompt",
    "GenerationRequest",
    "ServedModels",
    "engine_prompt",
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
        generation_prompt = _optional(body, "add_generation_prompt", bool)
        model, adapter = served.resolve(requested)
        tokens = tokenizer.encode_chat(
            messages, add_generation_prompt=generation_prompt is not False
        )
    else:
        max_tokens = _max_tokens(body, "max_tokens")
        prompt = _completion_prompt(body.get("prompt"))
        model, adapter = served.resolve(requested)
        if isinstance(prompt, array):
            tokens = prompt
        elif prompt:
            tokens = tokenizer.encode(prompt, add_special_tokens=True)
        else:
            tokens = array("I")  # no text: refused below, BOS or not
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


def tokenize_request(
    body: dict[str, Any], served: ServedModels, tokenizer: Tokenizer
) -> array[int]:
    """The ids of vLLM's POST /tokenize body: `messages` (a chat, rendered as
    /v1/chat/completions renders it) or `prompt` (a completion; `add_special_tokens`
    defaults to true, as there)."""
    served.resolve(_optional(body, "model", str))  # an unknown model is refused as vLLM does
    if "messages" in body:
        if _optional(body, "add_generation_prompt", bool) and _optional(
            body, "continue_final_message", bool
        ):
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            )
        generation_prompt = _optional(body, "add_generation_prompt", bool)
        return tokenizer.encode_chat(
            _chat_messages(body.get("messages")),
            add_generation_prompt=generation_prompt is not False,
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "Parameter 'prompt' must be a string.", param="prompt")
    special = _optional(body, "add_special_tokens", bool)
    return tokenizer.encode(prompt, add_special_tokens=special is not False)


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    """A request as the engine takes it: validated and tokenized (`request`), and the
    chained hashes of its prompt's full blocks."""

    request: GenerationRequest
    block_hashes: list[BlockHash]


def engine_prompt(
    endpoint: Endpoint,
    body: dict[str, Any],
    served: ServedModels,
    tokenizer: Tokenizer,
    block_size: int,
    max_context_tokens: int | None = None,
) -> EnginePrompt:
    """Parse, tokenize and hash one request body, as the simulated pod does for every
    request it receives; raises `ApiError` for what the pod refuses.

    With `max_context_tokens` (the pod's KV capacity in tokens), a prompt plus
    `max_tokens` longer than that is refused with vLLM's 400 before it is hashed.
    """
    gen = parse_generation_request(endpoint, body, served, tokenizer)
    prompt_tokens = len(gen.tokens)
    if max_context_tokens is not None and prompt_tokens + gen.max_tokens > max_context_tokens:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_context_tokens} tokens. However, "
            f"you requested {prompt_tokens + gen.max_tokens} tokens ({prompt_tokens} in the "
            f"messages, {gen.max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="max_tokens",
        )
    hashes = block_hashes(gen.tokens, block_size, lora_name=gen.adapter, cache_salt=gen.cache_salt)
    return EnginePrompt(gen, hashes)


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
    media: list[str] = []
    for part in content:
        placeholder = _media_placeholder(part)
        if placeholder is not None:
            media.append(placeholder)
            continue
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise ApiError(
                400,
                f"{where}.content parts must be {{'type': 'text', 'text': str}} or media "
                "({'type': 'image_url', 'image_url': {'url': str}}, audio_url, video_url, "
                "input_audio).",
                param="messages",
            )
        texts.append(part["text"])
    # vLLM joins text parts with newlines when it flattens content for a string template,
    # and puts the media placeholders before the text.
    return "\n".join([*media, "\n".join(texts)] if texts else media)


_MEDIA_URL_PARTS = {"image_url": "image", "audio_url": "audio", "video_url": "video"}


def _media_placeholder(part: object) -> str | None:
    """A media part as the simulated vision model sees it: one placeholder naming its
    modality and a hash of its data (equal media share cache blocks, different media do
    not, as vLLM's multimodal hashes make them). A real model expands it to as many tokens
    as the media needs; the simulator counts the placeholder's few. None: not media."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    value = part.get(kind) if isinstance(kind, str) else None
    if kind in _MEDIA_URL_PARTS and isinstance(value, dict):
        data, modality = value.get("url"), _MEDIA_URL_PARTS[kind]
    elif kind == "input_audio" and isinstance(value, dict):
        data, modality = value.get("data"), "audio"
    else:
        return None
    if not isinstance(data, str) or not data:
        return None
    digest = hashlib.blake2b(data.encode(), digest_size=8).hexdigest()
    return f"<{modality}:{digest}>"
