"""KV-cache events: what the engine queues, and the msgpack wire format against vLLM's."""

from __future__ import annotations

import itertools
import re
from array import array
from pathlib import Path

import msgspec
import pytest

from vllm_sim.engine import EngineConfig, SimEngine
from vllm_sim.hashing import BlockHash, block_hashes, hash_block_tokens
from vllm_sim.kv_events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    decode_event_batch,
    decode_seq,
    encode_event_batch,
    encode_seq,
)

FIXTURE = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-kv-events.md").read_text()
MAP_PAYLOAD, POSITIONAL_PAYLOAD = (
    bytes.fromhex(h) for h in re.findall(r"^    ([0-9a-f]{40,})$", FIXTURE, re.MULTILINE)
)
# The fixture's payloads come from a vLLM older than 0.32, without kv_cache_spec_kind.
FIXTURE_EVENTS: list[KvEvent] = [
    BlockStored(
        block_hashes=[0xDEADBEEF12345678],
        parent_block_hash=None,
        token_ids=list(range(16)),
        block_size=16,
        extra_keys=[None],
        kv_cache_spec_kind=None,
    ),
    BlockRemoved(block_hashes=[7]),
    AllBlocksCleared(),
]
FIXTURE_TS = 1757500000.25


class EventDriver:
    """An engine with KV events on, 4-token blocks, driven one request at a time."""

    def __init__(self, num_gpu_blocks: int = 8) -> None:
        self.engine = SimEngine(
            EngineConfig(block_size=4, num_gpu_blocks=num_gpu_blocks), kv_events=True
        )
        self._ids = itertools.count()

    def hashes(self, toks: array[int], adapter: str | None = None, salt: str | None = None):
        return block_hashes(toks, 4, lora_name=adapter, cache_salt=salt)

    def serve(
        self, toks: array[int], adapter: str | None = None, salt: str | None = None
    ) -> list[KvEvent]:
        """Run one request to completion; the events its start and finish queued."""
        req_id = f"r{next(self._ids)}"
        self.engine.submit(
            req_id,
            self.hashes(toks, adapter, salt),
            len(toks),
            1,
            adapter,
            prompt_token_ids=toks,
            cache_salt=salt,
        )
        assert [s.req_id for s in self.engine.start_ready(0.0)] == [req_id]
        self.engine.finish(req_id, 1)
        return self.engine.drain_kv_events()


def tokens(n: int, start: int = 0) -> array[int]:
    return array("I", range(start, start + n))


# -- what the engine emits ---------------------------------------------------------------


def test_new_blocks_are_stored_once_reused_ones_are_silent() -> None:
    driver = EventDriver(num_gpu_blocks=16)
    a = tokens(10)  # 2 full blocks + a partial one
    hashes = driver.hashes(a)
    assert driver.serve(a) == [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            extra_keys=[None, None],
        )
    ]
    assert driver.serve(a) == []  # a full reuse stores nothing
    longer = tokens(14)  # the same two blocks, then one more
    [stored] = driver.serve(longer)
    assert stored == BlockStored(
        block_hashes=[driver.hashes(longer)[2]],
        parent_block_hash=hashes[1],
        token_ids=[8, 9, 10, 11],
        block_size=4,
        extra_keys=[None],
    )


def test_eviction_is_reported_tail_first_before_the_blocks_that_replace_them() -> None:
    driver = EventDriver(num_gpu_blocks=8)
    a, b = tokens(12, start=100), tokens(12, start=200)
    driver.serve(a)  # 3 blocks cached
    driver.serve(b)  # 3 more: 6 of 8 used
    c = tokens(14, start=300)  # needs 3 hashed + 1 private: evicts a's last two
    events = driver.serve(c)
    a_hashes = driver.hashes(a)
    assert events[:2] == [
        BlockRemoved(block_hashes=[a_hashes[2]]),
        BlockRemoved(block_hashes=[a_hashes[1]]),
    ]
    assert isinstance(events[2], BlockStored)
    assert events[2].block_hashes == driver.hashes(c)
    assert len(events) == 3


def test_reset_clears_and_the_next_request_stores_again() -> None:
    driver = EventDriver()
    a = tokens(8)
    driver.serve(a)
    driver.engine.reset_prefix_cache()
    assert driver.engine.drain_kv_events() == [AllBlocksCleared()]
    [stored] = driver.serve(a)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == driver.hashes(a)


def test_after_a_hole_in_the_cached_prefix_every_block_is_stored_again() -> None:
    # vLLM reuses only the cached blocks before the first miss; it computes and caches
    # every later one, also those still cached (second copies), in one BlockStored.
    driver = EventDriver(num_gpu_blocks=16)
    engine = driver.engine
    long = tokens(17)  # blocks 0..3 and one more token
    driver.serve(long)
    hashes = driver.hashes(long)
    # Drop only block 1 from the cache by hand (the pool evicts tails first).
    pool = engine._pool
    [block] = pool._copies.pop(hashes[1])
    del pool._hash_of[block]
    del pool._evictable[block]
    del pool._refs[block]
    events = driver.serve(long)
    assert events == [
        BlockStored(
            block_hashes=hashes[1:],
            parent_block_hash=hashes[0],
            token_ids=list(range(4, 16)),
            block_size=4,
            extra_keys=[None, None, None],
        )
    ]
    assert [pool.copies(h) for h in hashes] == [1, 1, 2, 2]


def test_a_recomputed_last_block_is_stored_again_and_each_copy_removed() -> None:
    # vLLM, the same 64 ids twice with 32-token blocks: "Stored 1 blk/32 tok (child)" under
    # the hash it already held, and later one BlockRemoved per copy.
    driver = EventDriver(num_gpu_blocks=8)
    toks = tokens(8)  # 2 blocks, exactly
    hashes = driver.hashes(toks)
    driver.serve(toks)
    assert driver.serve(toks) == [
        BlockStored(
            block_hashes=[hashes[1]],
            parent_block_hash=hashes[0],
            token_ids=[4, 5, 6, 7],
            block_size=4,
            extra_keys=[None],
        )
    ]
    events = driver.serve(tokens(24, start=100))  # 6 blocks: 5 free, then evict 1
    assert events[0] == BlockRemoved(block_hashes=[hashes[1]])  # the older copy
    events = driver.serve(tokens(8, start=500))  # 2 more: both remaining idle blocks
    assert events[:2] == [
        BlockRemoved(block_hashes=[hashes[1]]),  # the second copy
        BlockRemoved(block_hashes=[hashes[0]]),
    ]


def serve_generating(
    driver: EventDriver,
    toks: array[int],
    output: list[int],
    salt: str | None = None,
) -> tuple[list[KvEvent], list[KvEvent]]:
    """Start one request, then finish it with `output`: the events of each."""
    engine = driver.engine
    engine.submit(
        "gen",
        driver.hashes(toks, None, salt),
        len(toks),
        len(output),
        prompt_token_ids=toks,
        cache_salt=salt,
    )
    engine.start_ready(0.0)
    started = engine.drain_kv_events()
    engine.finish("gen", len(output), output_token_ids=output)
    return started, engine.drain_kv_events()


def test_output_blocks_are_stored_one_event_each_chained_to_the_prompt() -> None:
    driver = EventDriver(num_gpu_blocks=16)
    toks, output = tokens(6), list(range(100, 108))
    started, finished = serve_generating(driver, toks, output)
    sequence = array("I", [*toks, *output[:7]])  # 13 tokens with KV: 3 full blocks
    hashes = block_hashes(sequence, 4)
    assert started == [
        BlockStored(
            block_hashes=hashes[:1],
            parent_block_hash=None,
            token_ids=[0, 1, 2, 3],
            block_size=4,
            extra_keys=[None],
        )
    ]
    # vLLM fills them in different steps: one BlockStored each, each the next's parent.
    assert finished == [
        BlockStored(
            block_hashes=[hashes[1]],
            parent_block_hash=hashes[0],
            token_ids=[4, 5, 100, 101],
            block_size=4,
            extra_keys=[None],
        ),
        BlockStored(
            block_hashes=[hashes[2]],
            parent_block_hash=hashes[1],
            token_ids=[102, 103, 104, 105],
            block_size=4,
            extra_keys=[None],
        ),
    ]


def test_an_output_block_that_is_block_0_carries_the_salt_and_no_parent() -> None:
    driver = EventDriver(num_gpu_blocks=16)
    started, finished = serve_generating(driver, tokens(2), [50, 51, 52], salt="tenant-a")
    assert started == []
    assert finished == [
        BlockStored(
            block_hashes=block_hashes(array("I", [0, 1, 50, 51]), 4, cache_salt="tenant-a"),
            parent_block_hash=None,
            token_ids=[0, 1, 50, 51],
            block_size=4,
            extra_keys=[("tenant-a",)],
        )
    ]


def test_the_same_output_generated_again_is_stored_again() -> None:
    driver = EventDriver(num_gpu_blocks=16)
    toks, output = tokens(6), list(range(100, 104))
    _, first = serve_generating(driver, toks, output)
    # The prompt's block hits; the output block is computed anew: a second copy.
    started, again = serve_generating(driver, toks, output)
    assert started == []
    assert again == first and len(first) == 1


@pytest.mark.parametrize(
    ("adapter", "salt", "expected_keys", "lora_id"),
    [
        (None, None, [None, None], None),
        (None, "tenant-a", [("tenant-a",), None], None),
        ("sql-lora", None, [("sql-lora",), ("sql-lora",)], 1),
        ("sql-lora", "tenant-a", [("sql-lora", "tenant-a"), ("sql-lora",)], 1),
    ],
)
def test_extra_keys_carry_the_adapter_on_every_block_and_the_salt_on_the_first(
    adapter: str | None,
    salt: str | None,
    expected_keys: list[tuple[str, ...] | None],
    lora_id: int | None,
) -> None:
    driver = EventDriver()
    [stored] = driver.serve(tokens(8), adapter=adapter, salt=salt)
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == expected_keys
    assert (stored.lora_name, stored.lora_id) == (adapter, lora_id)
    assert (stored.medium, stored.group_idx) == ("GPU", 0)


def test_adapter_ids_follow_registration_order_like_vllm_lora_int_id() -> None:
    driver = EventDriver()
    driver.engine.load_adapter("first")
    driver.engine.load_adapter("second")
    [stored] = driver.serve(tokens(4, start=5), adapter="second")
    assert isinstance(stored, BlockStored)
    assert stored.lora_id == 2


def test_events_off_by_default_and_tokens_required_when_on() -> None:
    quiet = SimEngine(EngineConfig(block_size=4))
    toks = tokens(8)
    quiet.submit("a", block_hashes(toks, 4), 8, 1)
    quiet.start_ready(0.0)
    quiet.reset_prefix_cache()
    assert (quiet.kv_events_enabled, quiet.drain_kv_events()) == (False, [])
    loud = SimEngine(EngineConfig(block_size=4), kv_events=True)
    with pytest.raises(ValueError, match="token ids"):
        loud.submit("a", block_hashes(toks, 4), 8, 1)


def test_hashes_are_the_engines_own_unsigned_64_bit_ints() -> None:
    driver = EventDriver()
    [stored] = driver.serve(tokens(8))
    assert isinstance(stored, BlockStored)
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored.block_hashes)
    assert stored.block_hashes == [BlockHash(h) for h in driver.hashes(tokens(8))]


@pytest.mark.parametrize(("adapter", "salt"), [(None, None), ("sql-lora", "tenant-a")])
def test_a_subscriber_recomputes_every_stored_hash_from_the_event_alone(
    adapter: str | None, salt: str | None
) -> None:
    # vLLM's BlockStored carries what each hash was made of: the parent, the blocks'
    # token ids and their extra keys. Prompt blocks, a run after a reused prefix, and
    # output blocks alike.
    driver = EventDriver(num_gpu_blocks=32)
    events = driver.serve(tokens(10), adapter, salt)
    events += driver.serve(tokens(18), adapter, salt)
    driver.engine.submit(
        "gen",
        driver.hashes(tokens(6, 50), adapter, salt),
        6,
        9,
        adapter,
        prompt_token_ids=tokens(6, 50),
        cache_salt=salt,
    )
    driver.engine.start_ready(0.0)
    driver.engine.finish("gen", 9, output_token_ids=list(range(900, 909)))
    events += driver.engine.drain_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    # 2 prompt blocks; the 2 after them; a 1-block prompt; its 2 output blocks, 1 each.
    assert [len(e.block_hashes) for e in stored] == [2, 2, 1, 1, 1]
    for event in stored:
        assert event.extra_keys is not None
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            ids = event.token_ids[index * 4 : (index + 1) * 4]
            parent = hash_block_tokens(parent, ids, event.extra_keys[index])
            assert parent == block_hash


# -- wire format -------------------------------------------------------------------------


def test_our_encoding_of_the_fixture_events_decodes_like_vllms_payload() -> None:
    stored = FIXTURE_EVENTS[0]
    assert isinstance(stored, BlockStored)
    events = [msgspec.structs.replace(stored, kv_cache_spec_kind="full_attention")]
    ours = msgspec.msgpack.decode(encode_event_batch(events + FIXTURE_EVENTS[1:], FIXTURE_TS, 0))
    theirs = msgspec.msgpack.decode(MAP_PAYLOAD)
    # vLLM 0.32 adds kv_cache_spec_kind, last; the rest is the fixture's, in its order.
    assert list(ours[1][0]) == [*theirs[1][0], "kv_cache_spec_kind"]
    assert ours[1][0].pop("kv_cache_spec_kind") == "full_attention"
    assert ours == theirs


def test_block_stored_fields_are_vllm_032s_in_its_order() -> None:
    # As docs/benchmarks/sim-vs-vllm/vllm.json recorded them from vLLM 0.32's publisher.
    payload = encode_event_batch([EventDriver().serve(tokens(4))[0]], 1.0, 0)
    [event] = msgspec.msgpack.decode(payload)[1]
    assert list(event) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert event["kv_cache_spec_kind"] == "full_attention"


@pytest.mark.parametrize("payload", [MAP_PAYLOAD, POSITIONAL_PAYLOAD], ids=["map", "positional"])
def test_both_vllm_layouts_decode_to_the_same_typed_batch(payload: bytes) -> None:
    batch = decode_event_batch(payload)
    assert (batch.ts, batch.events, batch.data_parallel_rank) == (FIXTURE_TS, FIXTURE_EVENTS, 0)


def test_encode_then_decode_round_trips_every_field() -> None:
    events: list[KvEvent] = [
        BlockStored(
            block_hashes=[2**64 - 1, 5],
            parent_block_hash=3,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=2,
            lora_name="sql",
            extra_keys=[("sql", "salt"), ("sql",)],
        ),
        BlockRemoved(block_hashes=[2**64 - 1]),
        AllBlocksCleared(),
    ]
    batch = decode_event_batch(encode_event_batch(events, 12.5, None))
    assert (batch.ts, batch.events, batch.data_parallel_rank) == (12.5, events, None)


def test_byte_hashes_keep_their_low_64_bits_and_unknown_fields_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {
                    "type": "BlockRemoved",
                    "block_hashes": [b"\x00" * 24 + (9).to_bytes(8, "big")],
                    "medium": "CPU",
                    "kv_cache_spec_kind": "full",
                }
            ],
            None,
        ]
    )
    assert decode_event_batch(payload).events == [BlockRemoved(block_hashes=[9], medium="CPU")]


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0, [{"type": "X"}]])],
)
def test_garbage_payloads_are_refused(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_event_batch(payload)


def test_sequence_numbers_are_8_bytes_big_endian() -> None:
    assert encode_seq(5).hex() == "0000000000000005"  # the fixture's example
    assert decode_seq(encode_seq(2**40 + 3)) == 2**40 + 3
    assert REPLAY_END_SEQ.hex() == "ff" * 8
    with pytest.raises(ValueError):
        decode_seq(b"\x00")
