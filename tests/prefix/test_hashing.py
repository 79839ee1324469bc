from __future__ import annotations

from array import array

import pytest

from epp.prefix.hashing import block_hashes, chain_seed
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.protocol import ChatMessage


def ids(n: int, start: int = 0) -> array:
    return array("I", range(start, start + n))


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(ids(47), 16, 1)) == 2
    assert block_hashes(ids(15), 16, 1) == []


def test_hashes_are_chained_prefix_stable_and_position_dependent():
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
