"""What the router needs from a tokenizer: the `Tokenizer` protocol and the values it
passes (`ChatMessage`, `ChatOptions`, `Encoded`, `TokenizationError`).

The router only needs token ids to cut a prompt into blocks whose hashes can be compared
across requests. The byte estimate (`estimate.py`, the default) and the model's own
tokenizer (`hf.py`, per model through `registry.py`) both implement the protocol.

Bounded work: the router hashes at most `prefix.max_blocks_per_request` blocks of a prompt,
so it never needs more than that many tokens. `encode_prefix` / `encode_chat_prefix`
encode at most `max_tokens` tokens from the prompt's start and estimate the token count of
the rest (the scheduler accounts for the whole prompt's length), so a 32 MiB prompt costs
no more to tokenize than a 128k-token one. The head they return is exactly the first
`max_tokens` ids of the full encoding, so a long prompt shares its blocks with a short one.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec


class ChatMessage(msgspec.Struct, frozen=True, gc=False):
    """One chat turn, its content as text. A msgspec Struct: a request body can carry
    hundreds of thousands of turns, and building one costs ~0.1 us (a frozen dataclass
    costs ~1 us); gc=False because it holds only strings and JSON values (no cycles).

    `content` is the text as vLLM gives it to a chat template that takes strings: text
    parts joined with "\n". A real chat template may need more, which only a real
    tokenizer reads (the byte estimate uses role and content alone):
    - `parts`: the content as a list of parts, for templates that iterate over parts
      (vLLM's "openai" content format), e.g. `{"type": "text", "text": ...}`,
      `{"type": "image"}`; None when the content was a plain string.
    - `extra`: the other keys vLLM passes the template for this turn, already in its
      shape: `tool_calls` (arguments decoded to objects), `tool_call_id`, `name`,
      `reasoning` / `reasoning_content`, `tools` (developer turns).
    """

    role: str
    content: str
    parts: tuple[Mapping[str, Any], ...] | None = None
    extra: Mapping[str, Any] | None = None


class ChatOptions(msgspec.Struct, frozen=True, gc=False):
    """What a chat request adds to its messages when the engine renders them: the body's
    `add_generation_prompt` (vLLM's default: true), `continue_final_message`,
    `add_special_tokens` (default false for chats), `tools` (in vLLM's shape:
    `{"type": "function", "function": {...}}`), `documents`, `reasoning_effort`, and
    `chat_template_kwargs`. `source` says which API the body came from: an Anthropic
    `/v1/messages` body is rendered as vLLM renders it (inline system turns merged into the
    first when the template requires a leading system turn)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: tuple[Mapping[str, Any], ...] | None = None
    documents: tuple[Any, ...] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    source: str = "openai"


DEFAULT_CHAT_OPTIONS = ChatOptions()


class TokenizationError(ValueError):
    """The request cannot be rendered or tokenized as the engine would (a chat template
    raised, or the conversation is malformed for the template). The router answers 400 with
    the message, as vLLM does for the same request."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """The first tokens of a prompt and the whole prompt's token count.

    `ids` holds at most the `max_tokens` asked for; `total_tokens` >= len(ids) counts the
    whole prompt: exact for the encoded part, an estimate for the rest (`exact` tells).
    """

    ids: array
    total_tokens: int
    exact: bool = True


class Tokenizer(Protocol):
    """What the router needs from a tokenizer.

    `encode_prefix` / `encode_chat_prefix` must return the same leading ids as
    `encode` / `encode_chat` and do work bounded by `max_tokens` (None: no bound), not by
    the prompt's length. A tokenizer without them still works (`prompt_blocks` falls back
    to a full encode, unbounded); `encode_head_by_slicing` builds them for any tokenizer.
    """

    name: str

    def encode(self, text: str) -> array:
        """Token ids of a completion prompt, as an array of unsigned 32-bit ints."""
        ...

    def encode_chat(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> array:
        """Token ids of a chat conversation rendered the way the engine renders it."""
        ...

    def encode_prefix(self, text: str, max_tokens: int | None = None) -> Encoded:
        """At most `max_tokens` leading ids of `encode(text)`, and its (estimated) length."""
        ...

    def encode_chat_prefix(
        self,
        messages: Sequence[ChatMessage],
        max_tokens: int | None = None,
        options: ChatOptions | None = None,
    ) -> Encoded:
        """At most `max_tokens` leading ids of `encode_chat(messages)`, and its length."""
        ...


def encode_head_by_slicing(
    encode: Callable[[str], array],
    text: str,
    max_tokens: int | None,
    *,
    chars_per_token: float = 4.0,
    margin_tokens: int = 16,
) -> Encoded:
    """`encode_prefix` for any tokenizer with a plain `encode(text) -> array`.

    Encodes a slice of the text's start large enough to yield `max_tokens` +
    `margin_tokens` ids (growing it while it does not), keeps the first `max_tokens` (the
    margin absorbs merges across the cut), and estimates the rest from the slice's
    characters per token. Work is bounded by the slice, not by the text.
    """
    if max_tokens is None:
        ids = encode(text)
        return Encoded(ids, len(ids))
    want = max(0, max_tokens) + margin_tokens
    size = max(64, math.ceil(want * chars_per_token))
    while True:
        head = text[:size]
        ids = encode(head)
        if len(head) == len(text):
            return Encoded(ids[:max_tokens], len(ids))
        if len(ids) >= want:
            per_char = len(ids) / len(head)
            total = len(ids) + math.ceil((len(text) - len(head)) * per_char)
            return Encoded(ids[:max_tokens], total, exact=False)
        size *= 2
