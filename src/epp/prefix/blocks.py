"""A prompt -> its token count and the hashes of its leading blocks, with bounded work.

This is the one call the Router makes between parsing and the index lookup. Only the first
`max_blocks` blocks are tokenized and hashed (so lookup and record are bounded too), while
`prompt_tokens` counts the whole prompt, exactly for token-id prompts and for what was
encoded, estimated for the rest, because the scheduler's load accounting needs the
prompt's real length.

Rule: a prompt longer than `max_blocks` x `block_size` tokens is matched and recorded on
its head only. Its cache ratio is computed over the hashed blocks, so a long prompt whose
head is cached looks fully cached; `total_blocks` gives the whole prompt's block count for
callers that prefer to divide by that.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from epp.prefix.hashing import BlockHash, block_hashes
from epp.request import Prompt, RequestRejected
from epp.tokenization.protocol import Encoded, TokenizationError, Tokenizer


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    prompt_tokens: int  # the whole prompt (exact, or estimated beyond the encoded head)
    hashes: list[BlockHash]  # chained hashes of at most `max_blocks` leading full blocks
    block_size: int
    exact: bool = True  # False when prompt_tokens is partly an estimate

    @property
    def total_blocks(self) -> int:
        """Full blocks in the whole prompt (hashed or not)."""
        return self.prompt_tokens // self.block_size

    @property
    def truncated(self) -> bool:
        return len(self.hashes) < self.total_blocks


def encode_head(prompt: Prompt, tokenizer: Tokenizer, max_tokens: int | None) -> Encoded:
    """At most `max_tokens` leading token ids of the prompt and its whole length."""
    if prompt.token_ids is not None:
        ids = prompt.token_ids
        head = ids if max_tokens is None or len(ids) <= max_tokens else ids[:max_tokens]
        return Encoded(head, len(ids))
    if prompt.messages is not None:
        chat = getattr(tokenizer, "encode_chat_prefix", None)
        # Template inputs besides the messages go only to tokenizers that take them.
        extra = {} if prompt.chat is None else {"options": prompt.chat}
        if chat is not None:
            return chat(prompt.messages, max_tokens, **extra)
        return _cut(tokenizer.encode_chat(prompt.messages, **extra), max_tokens)
    if prompt.text is not None:
        text = getattr(tokenizer, "encode_prefix", None)
        if text is not None:
            return text(prompt.text, max_tokens)
        return _cut(tokenizer.encode(prompt.text), max_tokens)
    return Encoded(array("I"), 0)


def prompt_blocks(
    prompt: Prompt, tokenizer: Tokenizer, block_size: int, seed: int, max_blocks: int
) -> PromptBlocks:
    """Token count and leading block hashes (at most `max_blocks`) of one prompt.

    `seed` is `chain_seed(model, adapter, cache_salt)`; `max_blocks` is
    `config.prefix.max_blocks_per_request`. A prompt the tokenizer cannot render (a chat
    template that refuses the conversation) raises RequestRejected (400), as vLLM
    answers the same request.
    """
    try:
        encoded = encode_head(prompt, tokenizer, max_blocks * block_size)
    except TokenizationError as exc:
        raise RequestRejected(400, str(exc), reason="invalid-request", param="messages") from None
    hashes = block_hashes(encoded.ids, block_size, seed, max_blocks)
    # The parser may have kept only the prompt's head: add what it counted of the rest
    # (exact for token ids, estimated for chat turns).
    omitted = prompt.omitted_tokens
    exact = encoded.exact and (omitted == 0 or prompt.token_ids is not None)
    return PromptBlocks(encoded.total_tokens + omitted, hashes, block_size, exact)


def _cut(ids: array, max_tokens: int | None) -> Encoded:
    # A tokenizer without the prefix methods encoded the whole prompt: keep its head.
    if max_tokens is None or len(ids) <= max_tokens:
        return Encoded(ids, len(ids))
    return Encoded(ids[:max_tokens], len(ids))
