"""Turning a prompt into token ids.

The router only needs token ids to cut a prompt into blocks whose hashes can be compared
across requests. In approximate mode (the router's own routing history) self-consistency
is all that matters, so a byte-level estimate is enough: every 4 bytes of UTF-8 become one
pseudo-token (the usual ~4 characters per token of English text). A real tokenizer (HF
`tokenizers` with the model's chat template) plugs in through the same `Tokenizer`
protocol, which precise mode (matching vLLM's own KV blocks) needs: `epp.tokenization`
(per model, from the model's tokenizer files; the byte estimate stays the default).

Bounded work: the router hashes at most `prefix.max_blocks_per_request` blocks of a prompt,
so it never needs more than that many tokens. `encode_prefix` / `encode_chat_prefix`
encode at most `max_tokens` tokens from the prompt's start and estimate the token count of
the rest (the scheduler accounts for the whole prompt's length), so a 32 MiB prompt costs
no more to tokenize than a 128k-token one. The head they return is exactly the first
`max_tokens` ids of the full encoding, so a long prompt shares its blocks with a short one.

Strings from the request body are valid Unicode (the parser rejects unpaired surrogate
escapes with a 400); the `surrogatepass` below is a second line of defence for callers
that hand over strings from elsewhere: a stray surrogate hashes as its 3-byte form instead
of raising.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

BYTES_PER_PSEUDO_TOKEN = 4


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


_GENERATION_PROMPT = "<|assistant|>\n"
_TURN_OVERHEAD = len("<||>\n<|end|>\n")


def _render(message: ChatMessage) -> str:
    return f"<|{message.role}|>\n{message.content}<|end|>\n"


def _pseudo_tokens(nbytes: int) -> int:
    return -(-nbytes // BYTES_PER_PSEUDO_TOKEN)


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


class ByteEstimateTokenizer:
    """4 UTF-8 bytes per pseudo-token; a chat renders as role-tagged turns.

    The chat rendering is prefix-stable: a conversation that grows by a turn keeps the
    exact bytes of every earlier turn at the same offsets, so its blocks keep their hashes.
    """

    name = "byte-estimate"

    def encode(self, text: str) -> array:
        return self._encode_bytes(text.encode("utf-8", "surrogatepass"))

    def encode_chat(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> array:
        # `options` (tools, template arguments) are not rendered: the estimate only has to
        # agree with itself.
        rendered = "".join(_render(m) for m in messages)
        # The generation prompt sits at the end, so it never shifts an earlier block.
        return self.encode(rendered + _GENERATION_PROMPT)

    def encode_prefix(self, text: str, max_tokens: int | None = None) -> Encoded:
        if max_tokens is None:
            ids = self.encode(text)
            return Encoded(ids, len(ids))
        limit = max(0, max_tokens) * BYTES_PER_PSEUDO_TOKEN
        # Every character is at least one UTF-8 byte: `limit` characters give >= `limit`
        # bytes whenever the text is longer, so the head's bytes are the full encoding's.
        head = text[:limit]
        raw = head.encode("utf-8", "surrogatepass")
        ids = self._encode_bytes(raw[:limit])
        if len(head) == len(text):
            return Encoded(ids, _pseudo_tokens(len(raw)))
        if text.isascii():  # O(1) in CPython: one byte per character
            return Encoded(ids, _pseudo_tokens(len(text)))
        sample = head or text[:256]  # bytes per character of the rest, from its start
        ratio = len(sample.encode("utf-8", "surrogatepass")) / len(sample)
        rest = math.ceil((len(text) - len(head)) * ratio)
        return Encoded(ids, _pseudo_tokens(len(raw) + rest), exact=False)

    def encode_chat_prefix(
        self,
        messages: Sequence[ChatMessage],
        max_tokens: int | None = None,
        options: ChatOptions | None = None,
    ) -> Encoded:
        if max_tokens is None:
            ids = self.encode_chat(messages)
            return Encoded(ids, len(ids))
        # Render only the characters the head needs (characters >= bytes / 4 tokens), a
        # huge turn included; the rest is counted, not rendered: its length in characters
        # scaled by the head's bytes per character.
        budget = max(0, max_tokens) * BYTES_PER_PSEUDO_TOKEN
        pieces: list[str] = []
        chars = 0
        rest_chars = 0
        for i, message in enumerate(messages):
            piece = (
                _render(message)
                if len(message.content) < budget - chars
                else f"<|{message.role}|>\n{message.content[: max(0, budget - chars)]}"
            )
            pieces.append(piece)
            chars += len(piece)
            if chars >= budget:
                rest_chars = len(message.content) + len(message.role) + _TURN_OVERHEAD
                rest_chars -= len(piece)
                rest_chars += sum(
                    len(m.role) + len(m.content) + _TURN_OVERHEAD for m in messages[i + 1 :]
                )
                break
        else:
            pieces.append(_GENERATION_PROMPT)
            return self.encode_prefix("".join(pieces), max_tokens)
        rest_chars += len(_GENERATION_PROMPT)
        head = self.encode_prefix("".join(pieces), max_tokens)
        bytes_per_char = head.total_tokens * BYTES_PER_PSEUDO_TOKEN / max(chars, 1)
        rest = _pseudo_tokens(math.ceil(rest_chars * max(bytes_per_char, 1.0)))
        return Encoded(head.ids, head.total_tokens + rest, exact=False)

    @staticmethod
    def _encode_bytes(raw: bytes) -> array:
        tail = len(raw) % BYTES_PER_PSEUDO_TOKEN
        if tail:
            raw += b"\x00" * (BYTES_PER_PSEUDO_TOKEN - tail)
        ids = array("I")
        ids.frombytes(raw)
        return ids
