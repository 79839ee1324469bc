"""The KV event decoder: both layouts, int and bytes hashes, real vLLM payloads, strict
bounds, and no input that makes it raise."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from epp.prefix.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    EventBatch,
    KvEventDecoder,
    KvEventStats,
    decode_seq,
    encode_seq,
    split_events,
)
from vllm_sim import kv_events as sim_events

ROOT = Path(__file__).resolve().parents[2]
VLLM_CAPTURE = ROOT / "docs" / "benchmarks" / "sim-vs-vllm" / "vllm.json"

# ../shared/fixtures/vllm-kv-events.md: one BlockStored (tokens 0..15, hash
# 0xDEADBEEF12345678, no parent), one BlockRemoved (hash 7), one AllBlocksCleared.
MAP_PAYLOAD = bytes.fromhex(
    "93cb41da30549810000093de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7391cfdeadbeef12345678b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0010"
    "000102030405060708090a0b0c0d0e0faa626c6f636b5f73697a6510a76c6f72615f6964c0a66d65646975"
    "6da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f6964780084a474"
    "797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107a66d656469756da3475055a9"
    "67726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400"
)
POSITIONAL_PAYLOAD = bytes.fromhex(
    "93cb41da30549810000093dc0010ab426c6f636b53746f72656491cfdeadbeef12345678c0dc0010000102"
    "030405060708090a0b0c0d0e0f10c0a3475055c091c000c0c0c0c0c0c096ac426c6f636b52656d6f766564"
    "9107a347505500c0c091b0416c6c426c6f636b73436c656172656400"
)

enc = msgspec.msgpack.encode


def decoder(**limits: int) -> KvEventDecoder:
    return KvEventDecoder(DecodeLimits(**limits), KvEventStats())


def stored_map(**fields: object) -> dict[str, object]:
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
    }
    event.update(fields)
    return event


def batch(*events: object) -> bytes:
    return enc([1757500000.25, list(events), 0])


@pytest.mark.parametrize("payload", [MAP_PAYLOAD, POSITIONAL_PAYLOAD], ids=["map", "positional"])
def test_both_layouts_of_the_reference_payload_decode_to_the_same_events(payload: bytes):
    dec = decoder()
    got = dec.decode(payload)
    assert got is not None
    assert got.ts == 1757500000.25 and got.data_parallel_rank == 0
    stored, removed, cleared = got.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [0xDEADBEEF12345678]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(16)) and stored.block_size == 16
    assert stored.medium == "GPU" and stored.extra_keys == [None]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [7]
    assert isinstance(cleared, AllBlocksCleared)
    assert dec.stats.counts["positional_layout"] == (payload is POSITIONAL_PAYLOAD)
    assert dec.stats.counts["invalid_event"] == 0


def _vllm_messages() -> list[dict]:
    return json.loads(VLLM_CAPTURE.read_text())["kv_events"]["messages"]


def _reencode(event: dict, hashes_as: str, layout: str) -> object:
    def value(h: str | None) -> object:
        if h is None:
            return None
        return int(h, 16) if hashes_as == "int" else bytes.fromhex(h).rjust(32, b"\x5a")

    fields = dict(event)
    if "block_hashes" in fields:
        fields["block_hashes"] = [value(h) for h in fields["block_hashes"]]
    if "parent_block_hash" in fields:
        fields["parent_block_hash"] = value(fields["parent_block_hash"])
    if layout == "map":
        return fields
    # The engine model's encoder (vllm_sim), plus trailing fields the decoder must ignore.
    return [*sim_events.positional_event(fields), None, None]


@pytest.mark.parametrize("layout", ["map", "positional"])
@pytest.mark.parametrize("hashes_as", ["int", "bytes"])
def test_every_batch_a_real_vllm_published_decodes_with_its_hashes(layout, hashes_as):
    """vLLM 0.32's own events (tools/vllm_check capture), in either layout, with hashes as
    ints or as 32-byte digests whose last 8 bytes are the value."""
    dec = decoder()
    messages = _vllm_messages()
    assert len(messages) >= 10
    for message in messages:
        payload = enc(
            [message["ts"], [_reencode(e, hashes_as, layout) for e in message["events"]], 0]
        )
        got = dec.decode(payload)
        assert got is not None
        assert len(got.events) == len(message["events"])
        for event, want in zip(got.events, message["events"], strict=True):
            assert type(event).__name__ == want["type"]
            if not isinstance(event, AllBlocksCleared):
                assert event.block_hashes == [int(h, 16) for h in want["block_hashes"]]
            if isinstance(event, BlockStored):
                parent = want["parent_block_hash"]
                assert event.parent_block_hash == (None if parent is None else int(parent, 16))
                assert event.token_ids == want["token_ids"]
                assert event.block_size == 32
                assert event.extra_keys == want["extra_keys"]
    assert dec.stats.counts["invalid_event"] == dec.stats.counts["malformed_payload"] == 0
    assert (dec.stats.counts["bytes_hashes"] > 0) == (hashes_as == "bytes")


def test_what_the_simulator_publishes_decodes():
    events = [
        sim_events.BlockStored(
            block_hashes=[2**64 - 1, 5],
            parent_block_hash=9,
            token_ids=list(range(32)),
            block_size=16,
            lora_name="sql",
            extra_keys=[("sql", "salt"), ("sql",)],
        ),
        sim_events.BlockRemoved(block_hashes=[5]),
        sim_events.AllBlocksCleared(),
    ]
    got = decoder().decode(sim_events.encode_event_batch(events, ts=3.0))
    assert got is not None
    stored = got.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [2**64 - 1, 5] and stored.parent_block_hash == 9
    assert stored.lora_name == "sql" and stored.extra_keys == [["sql", "salt"], ["sql"]]
    assert stored.kv_cache_spec_kind == "full_attention"
    assert [type(e).__name__ for e in got.events] == [
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]


def test_unknown_fields_are_ignored_and_signed_hashes_read_as_their_64_bits():
    payload = batch(stored_map(block_hashes=[-1, 3], future_field={"x": 1}, group_idx=0))
    got = decoder().decode(payload)
    assert got is not None
    assert got.events[0].block_hashes == [2**64 - 1, 3]  # type: ignore[union-attr]


def test_an_unknown_event_type_is_dropped_and_the_rest_kept():
    dec = decoder()
    got = dec.decode(
        batch({"type": "BlockMoved", "x": 1}, {"type": "BlockRemoved", "block_hashes": [4]})
    )
    assert got is not None
    assert [type(e).__name__ for e in got.events] == ["BlockRemoved"]
    assert dec.stats.counts["unknown_event_type"] == 1


@pytest.mark.parametrize(
    "bad",
    [
        stored_map(token_ids=list(range(31))),  # tokens do not fill the blocks
        stored_map(block_size=0),
        stored_map(block_size=10_000),
        stored_map(block_hashes=[]),
        stored_map(block_hashes=["ab", 1]),
        stored_map(block_hashes=[b"", 1]),
        stored_map(extra_keys=[None]),  # one per block
        stored_map(token_ids="not a list"),
        stored_map(lora_name=7),
        {"type": "BlockRemoved", "block_hashes": 5},
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        ["BlockStored"],
        "BlockStored",
        17,
        {"no": "type"},
    ],
)
def test_an_event_breaking_the_rules_is_dropped_counted_and_the_rest_kept(bad: object):
    dec = decoder()
    got = dec.decode(batch(bad, {"type": "AllBlocksCleared"}))
    assert got is not None
    assert [type(e).__name__ for e in got.events] == ["AllBlocksCleared"]
    assert dec.stats.counts["invalid_event"] + dec.stats.counts["unknown_event_type"] == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all",
        enc({"ts": 1, "events": []}),
        enc([1.0]),
        enc([1.0, "events", 0]),
        enc(["ts", [], 0]),
        enc([True, [], 0]),
        enc([1.0, [], 0])[:-1],  # truncated
    ],
)
def test_a_payload_that_is_not_a_batch_returns_none_and_is_counted(payload: bytes):
    dec = decoder()
    assert dec.decode(payload) is None
    assert dec.stats.counts["malformed_payload"] == 1


def test_oversized_payloads_and_batches_are_refused_whole():
    dec = decoder(max_payload_bytes=1000, max_events=3)
    assert dec.decode(batch(*[{"type": "AllBlocksCleared"}] * 4)) is None
    assert dec.stats.counts["oversized_batch"] == 1
    big = batch(stored_map(block_hashes=list(range(100)), token_ids=list(range(1600))))
    assert len(big) > 1000
    assert dec.decode(big) is None
    assert dec.stats.counts["oversized_payload"] == 1
    wide = decoder(max_blocks_per_event=4)
    got = wide.decode(
        batch(stored_map(block_hashes=list(range(5)), token_ids=list(range(80)), extra_keys=None))
    )
    assert got is not None and got.events == []
    assert wide.stats.counts["invalid_event"] == 1


def test_problems_are_logged_at_a_bounded_rate_and_all_counted(capsys):
    now = [0.0]
    stats = KvEventStats(log_burst=3, log_per_second=1.0, clock=lambda: now[0])
    dec = KvEventDecoder(stats=stats)
    for _ in range(50):
        dec.decode(b"\xc1")
    assert stats.counts["malformed_payload"] == 50
    assert stats.suppressed["malformed_payload"] == 47
    now[0] = 10.0
    dec.decode(b"\xc1")
    assert "malformed_payload" not in stats.suppressed  # reported with the next line


def test_sequence_frames():
    assert decode_seq(encode_seq(5)) == 5
    assert decode_seq(b"\xff" * 8) == 2**64 - 1
    assert decode_seq(b"\x00" * 7) is None


def test_split_events_cuts_large_events_into_chained_pieces():
    stored = BlockStored(
        block_hashes=list(range(100, 110)),
        parent_block_hash=None,
        token_ids=list(range(40)),
        block_size=4,
        lora_name="a",
        extra_keys=[["a", "salt"]] + [["a"]] * 9,
    )
    removed = BlockRemoved(block_hashes=[1, 2, 3])
    slices = list(split_events([removed, stored, AllBlocksCleared()], 4))
    assert all(sum(len(getattr(e, "block_hashes", [0])) for e in s) <= 4 for s in slices)
    pieces = [e for s in slices for e in s if isinstance(e, BlockStored)]
    assert [p.block_hashes for p in pieces] == [
        [100, 101, 102, 103],
        [104, 105, 106, 107],
        [108, 109],
    ]
    assert [p.parent_block_hash for p in pieces] == [None, 103, 107]
    assert pieces[1].token_ids == list(range(16, 32))
    assert pieces[0].extra_keys == [["a", "salt"]] + [["a"]] * 3
    assert pieces[2].extra_keys == [["a"]] * 2
    flat = [e for s in slices for e in s]
    assert isinstance(flat[0], BlockRemoved) and isinstance(flat[-1], AllBlocksCleared)


def _check_invariants(got: EventBatch) -> None:
    for event in got.events:
        if isinstance(event, AllBlocksCleared):
            continue
        assert event.block_hashes
        assert all(type(h) is int and 0 <= h < 2**64 for h in event.block_hashes)
        if isinstance(event, BlockStored):
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert event.parent_block_hash is None or 0 <= event.parent_block_hash < 2**64


def test_fuzz_random_bytes_and_mutated_payloads_never_raise():
    rng = random.Random(20261201)
    dec = decoder(max_payload_bytes=1 << 16)
    seeds = [
        MAP_PAYLOAD,
        POSITIONAL_PAYLOAD,
        batch(stored_map(), {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]}),
    ]
    decoded = 0
    for i in range(6000):
        if i % 3 == 0:
            payload = rng.randbytes(rng.randrange(0, 300))
        else:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randrange(1, 6)):
                action = rng.randrange(4)
                pos = rng.randrange(len(data)) if data else 0
                if action == 0 and data:
                    data[pos] = rng.randrange(256)
                elif action == 1:
                    data.insert(pos, rng.randrange(256))
                elif action == 2 and data:
                    del data[pos]
                else:
                    data = data[: rng.randrange(len(data) + 1)]
            payload = bytes(data)
        got = dec.decode(payload)
        if got is not None:
            decoded += 1
            _check_invariants(got)
    assert decoded > 100  # the mutations keep many payloads valid: the checks ran
    counts = dec.stats.counts
    assert counts["malformed_payload"] > 0 and counts["invalid_event"] > 0
