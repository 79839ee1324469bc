from __future__ import annotations

import struct
from array import array

import pytest
import xxhash

from epp.prefix.hashing import block_hashes, chain_seed
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.protocol import ChatMessage


def ids(n: int, start: int = 0) -> array:
    return array("I", range(start, start + n))


def test_only_full_blocks_are_hashed(kernels_used):
    assert len(block_hashes(ids(47), 16, 1)) == 2
    assert block_hashes(ids(15), 16, 1) == []


def test_hashes_are_chained_prefix_stable_and_position_dependent(kernels_used):
    seed = chain_seed("m")
    short, long = block_hashes(ids(32), 16, seed), block_hashes(ids(64), 16, seed)
    assert long[:2] == short
    # The same 16 tokens at a different position (other parent) hash differently.
    a = block_hashes(array("I", [1] * 16 + [2] * 16), 16, seed)
    b = block_hashes(array("I", [2] * 16), 16, seed)
    assert a[1] != b[0]
    # A change in block 0 changes every later hash.
    changed = block_hashes(array("I", [9, *range(1, 64)]), 16, seed)
    assert all(x != y for x, y in zip(changed, long, strict=True))


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("m", None, None), ("other", None, None)),
        (("m", None, None), ("m", "sql-lora", None)),
        (("m", None, None), ("m", None, "tenant-a")),
        (("m", None, "tenant-a"), ("m", None, "tenant-b")),
    ],
)
def test_model_adapter_and_salt_separate_tenants(left, right):
    tokens = ids(32)
    assert block_hashes(tokens, 16, chain_seed(*left)) != block_hashes(
        tokens, 16, chain_seed(*right)
    )


def test_wrong_array_type_is_rejected():
    with pytest.raises(TypeError):
        block_hashes(array("q", range(32)), 16, 0)


def test_byte_estimate_is_four_bytes_per_token_and_chat_is_prefix_stable():
    tok = ByteEstimateTokenizer()
    assert len(tok.encode("abcdefgh")) == 2
    assert len(tok.encode("abcdefghi")) == 3  # partial token padded
    turn1 = [ChatMessage("system", "s" * 400), ChatMessage("user", "u" * 100)]
    turn2 = [*turn1, ChatMessage("assistant", "a" * 100), ChatMessage("user", "v" * 50)]
    h1 = block_hashes(tok.encode_chat(turn1), 16, 0)
    h2 = block_hashes(tok.encode_chat(turn2), 16, 0)
    # Every full block of turn 1's history (before its generation prompt) is reused.
    history_blocks = (
        len(tok.encode("".join(f"<|{m.role}|>\n{m.content}<|end|>\n" for m in turn1))) // 16
    )
    assert h2[:history_blocks] == h1[:history_blocks]


def test_chain_seed_never_raises_on_unpaired_surrogates():
    # The parser rejects them; a direct caller must still not get a UnicodeEncodeError.
    assert chain_seed("\ud800", "a\udfff", "\udc00") != chain_seed("m")


# -- the format of the hashes: peers exchange them (epp.replicas), logs print the first ------
# Replicas of two releases side by side (a rolling upgrade) must name a prompt's blocks
# alike, so the key format is pinned: known values, and the same values computed here from
# xxHash64 itself (the `xxhash` package's streaming API, little-endian uint32 token bytes).


def _xxh64(data: bytes, seed: int = 0) -> int:
    return xxhash.xxh64(data, seed=seed).intdigest()


def test_chain_seed_is_xxh64_of_model_adapter_and_salt_joined_by_nul():
    assert chain_seed("m") == _xxh64(b"m\x00\x00") == 17607514036111505583
    assert chain_seed("m", "lora") == _xxh64(b"m\x00lora\x00") == 10388189656632213088
    assert chain_seed("m", None, "salt") == _xxh64(b"m\x00\x00salt") == 13841172145725487272
    assert chain_seed("m", "lora", "salt") == _xxh64(b"m\x00lora\x00salt") == 10753272937072626496
    # No adapter and no salt are the empty string: the same blocks.
    assert chain_seed("m", "", "") == chain_seed("m")
    # UTF-8, as the names arrive in the request.
    assert chain_seed("é") == _xxh64("é\x00\x00".encode())


def test_block_i_is_xxh64_of_its_token_bytes_seeded_with_block_i_minus_1(kernels_used):
    seed = chain_seed("m")
    tokens = ids(40)
    expected, prev = [], seed
    for start in (0, 16):
        prev = _xxh64(struct.pack("<16I", *range(start, start + 16)), prev)
        expected.append(prev)
    assert block_hashes(tokens, 16, seed) == expected == [6819791902961925833, 12494120453162771088]
    # Another block size cuts other blocks.
    assert block_hashes(tokens, 8, seed)[0] == _xxh64(struct.pack("<8I", *range(8)), seed)
    assert len(block_hashes(tokens, 8, seed)) == 5
    # Token ids above 2**31 are unsigned 32-bit values, not sign-extended.
    big = array("I", [2**32 - 1] * 16)
    assert block_hashes(big, 16, 0) == [_xxh64(b"\xff" * 64, 0)]


@pytest.mark.parametrize(("max_blocks", "count"), [(None, 6), (7, 6), (6, 6), (2, 2), (1, 1)])
def test_max_blocks_keeps_the_first_blocks_of_the_chain(max_blocks, count, kernels_used):
    tokens = ids(100)
    full = block_hashes(tokens, 16, 5)
    assert block_hashes(tokens, 16, 5, max_blocks) == full[:count]


@pytest.mark.parametrize("max_blocks", [0, -1, -100])
def test_no_blocks_for_a_zero_or_negative_cap(max_blocks, kernels_used):
    assert block_hashes(ids(100), 16, 5, max_blocks) == []


def test_only_uint32_arrays_are_accepted_with_a_clear_message():
    for typecode in ("i", "L", "H", "Q"):
        with pytest.raises(TypeError, match=r"^tokens must be an array\('I'\) of token ids$"):
            block_hashes(array(typecode, range(32)), 16, 0)
