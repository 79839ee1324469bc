"""The byte estimate: every 4 bytes of UTF-8 become one pseudo-token (the usual ~4
characters per token of English text). The default tokenizer: in approximate mode (the
router's own routing history) self-consistency is all that matters, so an estimate is
enough; precise mode (matching vLLM's own KV blocks) needs the model's tokenizer.

Strings from the request body are valid Unicode (the parser rejects unpaired surrogate
escapes with a 400); the `surrogatepass` below is a second line of defence for callers
that hand over strings from elsewhere: a stray surrogate hashes as its 3-byte form instead
of raising.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

from epp.tokenization.protocol import ChatMessage, ChatOptions, Encoded

BYTES_PER_PSEUDO_TOKEN = 4

_GENERATION_PROMPT = "<|assistant|>\n"
_TURN_OVERHEAD = len("<||>\n<|end|>\n")


def _render(message: ChatMessage) -> str:
    return f"<|{message.role}|>\n{message.content}<|end|>\n"


def _pseudo_tokens(nbytes: int) -> int:
    return -(-nbytes // BYTES_PER_PSEUDO_TOKEN)


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
