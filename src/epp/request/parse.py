"""`parse_request`: one body -> an InferenceRequest, or RequestRejected (a 400)."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from epp.request.anthropic import messages_prompt
from epp.request.body import NESTED_TOO_DEEPLY, Body, decode_body, invalid_json
from epp.request.chat import chat_prompt
from epp.request.completions import completion_prompt
from epp.request.options import anthropic_options, openai_options
from epp.request.types import (
    DEFAULT_MAX_PROMPT_TOKENS,
    InferenceRequest,
    Prompt,
    RequestKind,
    bad,
    kind_of,
)


def parse_request(
    path: str,
    body: bytes | bytearray | memoryview,
    adapters: Mapping[str, str],
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
) -> InferenceRequest:
    """Parse an OpenAI or Anthropic request body; `adapters` maps adapter names to their
    base model.

    The body is decoded with msgspec (faster than `json.loads` on large bodies: see
    docs/benchmarks/pause.md), which also rejects what `json.loads` would let through to
    fail later: unpaired UTF-16 surrogates in any string, NaN/Infinity, and numbers out of
    float range are all a 400 here, never a 500 further on.
    """
    kind = kind_of(path)
    if not body:
        if kind == "other":
            return InferenceRequest(kind, None, None, None, Prompt())
        raise bad("the request has no body; expected a JSON object")
    data = decode_body(body)
    model = _model(data, kind)
    salt = data.cache_salt
    if salt is not None and not isinstance(salt, str):
        raise bad("'cache_salt' must be a string", "cache_salt")
    stream = False if data.stream is msgspec.UNSET else data.stream
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    prompt = _prompt(kind, data, body, max_prompt_tokens)
    adapter = model if model in adapters else None
    base = adapters[adapter] if adapter else model
    return InferenceRequest(kind, model, base, adapter, prompt, stream, salt)


def _model(data: Body, kind: RequestKind) -> str | None:
    """The body's model: required on the prompt routes, a string wherever it is given."""
    model = data.model
    if kind != "other" and (not isinstance(model, str) or not model):
        raise bad("the request needs a string 'model'", "model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    return model


def _prompt(
    kind: RequestKind, data: Body, body: bytes | bytearray | memoryview, max_tokens: int
) -> Prompt:
    try:
        if kind == "completion":
            return completion_prompt(data.prompt, max_tokens)
        if kind == "chat":
            return chat_prompt(data.messages, max_tokens, openai_options(data))
        if kind == "messages":
            return messages_prompt(data, max_tokens, anthropic_options(data))
        return Prompt()
    except msgspec.DecodeError as exc:  # the raw value was validated already: defensive
        raise invalid_json(body, exc) from None
    except RecursionError:
        raise bad(NESTED_TOO_DEEPLY, reason="invalid-json") from None
