"""The simulated engine's block hashes, computed the way vLLM computes its own.

vLLM's prefix cache (`vllm/v1/core/kv_cache_utils.py`) keys each full block of
`block_size` tokens by a hash chained to the block before it:

    hash(block i) = H(hash(block i-1), or NONE_HASH for block 0;
                      tuple of block i's token ids;
                      block i's extra keys, or None)

so one hash stands for the whole prefix up to and including its block. The extra keys
are the LoRA adapter's name on every block when the request uses an adapter, and the
request's `cache_salt` on block 0 only (by the chain, a salt still changes every later
hash); vLLM puts multimodal input ids there too, which a text-only simulator has none of.
A partial trailing block is not hashed: vLLM never caches one.

Here H is SHA-256 over the msgpack encoding of that triple (vLLM's `sha256_cbor` does the
same with CBOR), and a block's hash is the digest's low 64 bits as an unsigned int, which
is what vLLM publishes in its KV events by default. The chain runs on those 64-bit
values, so anyone holding a `BlockStored` event (parent hash, token ids, extra keys) can
recompute its hashes. NONE_HASH is fixed: vLLM draws it at random per process unless
PYTHONHASHSEED is set, and a simulated fleet wants every pod to agree, as real pods that
share PYTHONHASHSEED do.

These hashes have nothing in common with the router's (`epp.prefix.hashing`, xxHash64 of
its own pseudo-tokens with model, adapter and salt in the seed): a router matches the
engine's blocks only through what it can observe, never by sharing code.

Cost: about 1.5 us per block (one small msgpack encode and one SHA-256), computed once
per request: the server hashes a prompt when it arrives and the engine hashes only the
output blocks, when the request ends.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NewType

import msgspec

BlockHash = NewType("BlockHash", int)
"""A block's hash: the low 64 bits of its SHA-256 digest, as an unsigned int."""

ExtraKeys = tuple[str, ...] | None
"""A block's extra hash keys: (LoRA name?, cache_salt?) in that order, None when empty."""

_encode = msgspec.msgpack.Encoder().encode


def _low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


NONE_HASH = BlockHash(_low64(hashlib.sha256(b"vllm_sim NONE_HASH").digest()))
"""The parent of block 0: a fixed seed, the same in every process."""


def block_extra_keys(
    block_index: int, lora_name: str | None = None, cache_salt: str | None = None
) -> ExtraKeys:
    """vLLM's extra keys of block `block_index`: the LoRA name, then `cache_salt` on
    block 0 only; None when there are none."""
    if cache_salt is not None and block_index == 0:
        return (lora_name, cache_salt) if lora_name is not None else (cache_salt,)
    return (lora_name,) if lora_name is not None else None


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None
) -> BlockHash:
    """One block's hash from its parent's (None for block 0), its token ids and its
    extra keys."""
    key = (NONE_HASH if parent is None else parent, list(token_ids), extra_keys)
    return BlockHash(_low64(hashlib.sha256(_encode(key)).digest()))


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    start_block: int = 0,
    parent: BlockHash | None = None,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """The chained hashes of the full blocks of `tokens` (a sequence's ids from its very
    first token), from block `start_block` on; `parent` is block `start_block - 1`'s hash
    (None, and ignored, when `start_block` is 0). `max_blocks` caps how many are hashed.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    if start_block < 0:
        raise ValueError("start_block must not be negative")
    if start_block > 0 and parent is None:
        raise ValueError("hashing from a later block needs its parent's hash")
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, start_block + max(0, max_blocks))
    if full <= start_block:
        return []
    # A list slices into lists cheaply; an array('I') would need one `tolist` per block.
    if isinstance(tokens, list):
        ids = tokens
    elif isinstance(tokens, array):
        ids = tokens.tolist()
    else:
        ids = list(tokens)
    sha256 = hashlib.sha256
    encode = _encode
    from_bytes = int.from_bytes
    out: list[BlockHash] = []
    append = out.append
    prev: int = NONE_HASH if start_block == 0 else parent  # type: ignore[assignment]
    first = start_block
    if first == 0:
        # Block 0 alone may carry cache_salt: hash it before the loop.
        prev = from_bytes(
            sha256(
                encode((prev, ids[:block_size], block_extra_keys(0, lora_name, cache_salt)))
            ).digest()[-8:],
            "big",
        )
        append(BlockHash(prev))
        first = 1
    keys = block_extra_keys(first, lora_name, cache_salt)
    for start in range(first * block_size, full * block_size, block_size):
        prev = from_bytes(
            sha256(encode((prev, ids[start : start + block_size], keys))).digest()[-8:], "big"
        )
        append(prev)  # type: ignore[arg-type]
    return out
