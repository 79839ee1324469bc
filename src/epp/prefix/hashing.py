"""Chained xxHash64 fingerprints of full token blocks.

Block i's hash is xxh64(bytes of its token ids, seed = hash of block i-1); block 0 is
seeded with a hash of (model, LoRA adapter, cache_salt). The chain makes one hash stand for
the whole prefix up to and including its block, so a flat hash -> pods map answers the same
question as a prefix tree: "which pods hold this exact prefix" (see index.py). Seeding with
model, adapter and salt keeps tenants and adapters from ever matching each other's blocks,
which is what vLLM does with its own extra keys. Partial trailing blocks are not hashed,
as vLLM does not cache them either.
"""

from __future__ import annotations

from array import array
from typing import NewType, cast

import xxhash

from epp.kernels import PREFIX as COMPILED

BlockHash = NewType("BlockHash", int)


def chain_seed(model: str, adapter: str | None = None, cache_salt: str | None = None) -> int:
    # The parser rejects unpaired surrogates; `surrogatepass` keeps any other caller from a
    # UnicodeEncodeError (it changes nothing for valid strings).
    key = f"{model}\x00{adapter or ''}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass")
    return xxhash.xxh64_intdigest(key)


def block_hashes(
    tokens: array, block_size: int, seed: int, max_blocks: int | None = None
) -> list[BlockHash]:
    """Hashes of the full blocks of `tokens` (uint32 array), each chained to the one before:
    all of them, or the first `max_blocks`."""
    if tokens.typecode != "I":
        raise TypeError("tokens must be an array('I') of token ids")
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max(0, max_blocks))
    step = block_size * tokens.itemsize
    if COMPILED is not None:
        return cast("list[BlockHash]", COMPILED.xxh64_chain(tokens, step, seed, full))
    return python_block_hashes(memoryview(tokens).cast("B"), step, seed, full)


def python_block_hashes(raw: memoryview, step: int, seed: int, full: int) -> list[BlockHash]:
    """The pure-Python twin of the compiled `xxh64_chain` (epp.kernels): the first
    `full` blocks of `step` bytes of `raw`, chained."""
    digest = xxhash.xxh64_intdigest
    out: list[int] = []
    append = out.append
    prev = seed
    for start in range(0, full * step, step):
        prev = digest(raw[start : start + step], prev)
        append(prev)
    # A BlockHash is an int at run time: one cast for the list, no call per block.
    return cast("list[BlockHash]", out)
