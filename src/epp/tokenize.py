"""Turning a prompt into token ids.

The router only needs token ids to cut a prompt into blocks whose hashes can be compared
across requests. In approximate mode (the router's own routing history) self-consistency
is all that matters, so a byte-level estimate is enough: every 4 bytes of UTF-8 become one
pseudo-token (the usual ~4 characters per token of English text). A real tokenizer (HF
`tokenizers` with the model's chat template) plugs in through the same `Tokenizer`
protocol, which precise mode (matching vLLM's own KV blocks) will need.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

BYTES_PER_PSEUDO_TOKEN = 4


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer(Protocol):
    """What the router needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> array:
        """Token ids of a completion prompt, as an array of unsigned 32-bit ints."""
        ...

    def encode_chat(self, messages: Sequence[ChatMessage]) -> array:
        """Token ids of a chat conversation rendered the way the engine renders it."""
        ...


def token_array(ids: Sequence[int]) -> array:
    """Token ids as the uint32 array every tokenizer returns (raises on out-of-range ids)."""
    return array("I", ids)


class ByteEstimateTokenizer:
    """4 UTF-8 bytes per pseudo-token; a chat renders as role-tagged turns.

    The chat rendering is prefix-stable: a conversation that grows by a turn keeps the
    exact bytes of every earlier turn at the same offsets, so its blocks keep their hashes.
    """

    name = "byte-estimate"

    def encode(self, text: str) -> array:
        return self._encode_bytes(text.encode("utf-8", "surrogatepass"))

    def encode_chat(self, messages: Sequence[ChatMessage]) -> array:
        rendered = "".join(f"<|{m.role}|>\n{m.content}<|end|>\n" for m in messages)
        # The generation prompt sits at the end, so it never shifts an earlier block.
        return self.encode(rendered + "<|assistant|>\n")

    @staticmethod
    def _encode_bytes(raw: bytes) -> array:
        tail = len(raw) % BYTES_PER_PSEUDO_TOKEN
        if tail:
            raw += b"\x00" * (BYTES_PER_PSEUDO_TOKEN - tail)
        ids = array("I")
        ids.frombytes(raw)
        return ids
