"""The simulator's block hashes: vLLM's chain, extra keys and encoding."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from array import array

import pytest

from epp.prefix.hashing import block_hashes as router_block_hashes
from epp.prefix.hashing import chain_seed
from epp.tokenization.estimate import ByteEstimateTokenizer
from vllm_sim.hashing import (
    NONE_HASH,
    BlockHash,
    block_extra_keys,
    block_hashes,
    hash_block_tokens,
)
from vllm_sim.tokenizer import SimTokenizer


def tokens(n: int, start: int = 0) -> array[int]:
    return array("I", range(start, start + n))


def differing(a: list[BlockHash], b: list[BlockHash]) -> list[bool]:
    return [x != y for x, y in zip(a, b, strict=True)]


def test_each_block_chains_to_its_parent_from_none_hash() -> None:
    toks = tokens(48)
    hashes = block_hashes(toks, 16)
    parent: BlockHash | None = None
    for index, block_hash in enumerate(hashes):
        chunk = list(toks[index * 16 : (index + 1) * 16])
        assert hash_block_tokens(parent, chunk, None) == block_hash
        parent = block_hash
    assert hash_block_tokens(None, list(toks[:16])) == hash_block_tokens(NONE_HASH, toks[:16])


def test_changing_a_block_changes_it_and_every_later_hash_only() -> None:
    base = block_hashes(tokens(64), 16)
    first = tokens(64)
    first[3] += 1000
    assert differing(base, block_hashes(first, 16)) == [True, True, True, True]
    third = tokens(64)
    third[40] += 1000
    assert differing(base, block_hashes(third, 16)) == [False, False, True, True]


def test_cache_salt_is_an_extra_key_of_block_0_and_changes_every_hash_by_the_chain() -> None:
    toks = tokens(64)
    plain, salted = block_hashes(toks, 16), block_hashes(toks, 16, cache_salt="tenant-a")
    assert differing(plain, salted) == [True] * 4
    assert block_hashes(toks, 16, cache_salt="tenant-b") != salted
    assert [block_extra_keys(i, cache_salt="tenant-a") for i in range(3)] == [
        ("tenant-a",),
        None,
        None,
    ]
    # Only block 0's own key holds the salt: block 1 chains to a salted parent, no key.
    assert salted[1] == hash_block_tokens(salted[0], toks[16:32], None)


def test_lora_name_is_an_extra_key_of_every_block() -> None:
    toks = tokens(48)
    plain, lora = block_hashes(toks, 16), block_hashes(toks, 16, lora_name="sql")
    assert differing(plain, lora) == [True] * 3
    assert block_hashes(toks, 16, lora_name="chat") != lora
    parent: BlockHash | None = None
    for index in range(3):
        keys = block_extra_keys(index, "sql", "s")
        assert keys == (("sql", "s") if index == 0 else ("sql",))
        chunk = toks[index * 16 : (index + 1) * 16]
        parent = hash_block_tokens(parent, chunk, keys)
        assert parent == block_hashes(toks, 16, lora_name="sql", cache_salt="s")[index]


def test_a_partial_trailing_block_is_not_hashed() -> None:
    assert len(block_hashes(tokens(47), 16)) == 2
    assert block_hashes(tokens(15), 16) == []
    # Adding tokens to the partial block changes none of the full blocks' hashes.
    assert block_hashes(tokens(33), 16) == block_hashes(tokens(47), 16)


def test_hashing_can_start_mid_sequence_and_stop_early() -> None:
    toks = tokens(80)
    hashes = block_hashes(toks, 16, lora_name="a", cache_salt="s")
    rest = block_hashes(toks, 16, lora_name="a", cache_salt="s", start_block=2, parent=hashes[1])
    assert rest == hashes[2:]
    assert block_hashes(toks, 16, max_blocks=2) == block_hashes(toks, 16)[:2]
    assert block_hashes(list(toks), 16) == block_hashes(toks, 16)  # list or array alike
    with pytest.raises(ValueError, match="parent"):
        block_hashes(toks, 16, start_block=1)


def test_a_hash_is_the_low_64_bits_of_sha256_over_msgpack() -> None:
    # msgpack by hand: [uint64 parent, array16 of 16 fixints, nil].
    encoded = (
        b"\x93\xcf" + NONE_HASH.to_bytes(8, "big") + b"\xdc\x00\x10" + bytes(range(16)) + b"\xc0"
    )
    digest = hashlib.sha256(encoded).digest()
    assert block_hashes(tokens(16), 16) == [int.from_bytes(digest[-8:], "big")]
    assert all(0 <= h < 2**64 for h in block_hashes(tokens(160, 70_000), 16, lora_name="x"))


def test_hashes_are_the_same_in_every_process() -> None:
    code = (
        "from vllm_sim.hashing import block_hashes; "
        "print(block_hashes(list(range(64)), 16, lora_name='a', cache_salt='s'))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "1", "random")
    }
    expected = block_hashes(list(range(64)), 16, lora_name="a", cache_salt="s")
    assert outputs == {str(expected)}


def test_the_simulated_pods_hashes_share_nothing_with_the_routers() -> None:
    # The same prompt through each side's own tokenizer and hashing: the router cannot
    # match the pod's blocks by construction, only through what it observes.
    prompt = "You are a helpful assistant who answers questions about routing. " * 20
    sim_tokens = SimTokenizer().encode(prompt, add_special_tokens=True)
    router_tokens = ByteEstimateTokenizer().encode(prompt)
    assert list(sim_tokens[:32]) != list(router_tokens[:32])
    sim = block_hashes(sim_tokens, 16)
    router = router_block_hashes(router_tokens, 16, chain_seed("sim-llama-8b"))
    assert len(sim) > 10 and len(router) > 10
    assert not set(sim) & set(router)
    # Even fed the very same token ids, the two hash chains differ.
    same_ids = router_block_hashes(sim_tokens, 16, chain_seed("sim-llama-8b"))
    assert not set(sim) & set(same_ids)
