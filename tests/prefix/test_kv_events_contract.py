"""The KV-event decoder's contract, field by field: what a real vLLM batch decodes to in
every layout the decoder reads (map with int or bytes hashes, the pre-0.26 positional
layout, and a batch the typed decoders refuse, read event by event), the bounds
(`DecodeLimits`, defaults included: production passes only the payload cap), the problem
counters and the warning an operator reads, and how `split_events` cuts large events.

The real events are vLLM 0.32's (docs/benchmarks/sim-vs-vllm/vllm.json, captured by
tools/vllm_check); a test that needs a value vLLM did not send there (a LoRA id, another
medium or KV cache group) changes that one field of a real event. The field names come
from vLLM 0.32's own source (tests/fixtures/upstream/vllm-0.32.0), read with `ast`: a
field vLLM renames, adds or reorders fails here."""

from __future__ import annotations

import ast
import copy
import functools
import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog

from epp.prefix.kv_events import (
    MASK64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    EventBatch,
    KvEventDecoder,
    KvEventStats,
    decode_seq,
    encode_seq,
    event_blocks,
    split_events,
)
from epp.prefix.kv_events.layouts import build_layouts
from vllm_sim import kv_events as sim_events

ROOT = Path(__file__).resolve().parents[2]
VLLM_CAPTURE = ROOT / "docs" / "benchmarks" / "sim-vs-vllm" / "vllm.json"
VLLM_KV_EVENTS = (
    ROOT
    / "tests"
    / "fixtures"
    / "upstream"
    / "vllm-0.32.0"
    / "vllm"
    / "distributed"
    / "kv_events.py"
)
# What vLLM 0.32 sends that the router does not read: KV locality and offload tiers,
# sessions, and sliding-window sizes (a sliding-window group is skipped by its kind).
NOT_READ = {
    "BlockStored": ("kv_cache_spec_sliding_window", "locality", "ownership", "session_id"),
    "BlockRemoved": ("locality", "ownership"),
    "AllBlocksCleared": (),
}


@functools.cache
def vllm_structs() -> dict[str, ast.ClassDef]:
    tree = ast.parse(VLLM_KV_EVENTS.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def vllm_fields(name: str) -> dict[str, str]:
    """The fields vLLM declares on struct `name` (its bases' first, as msgspec orders
    them), in order, each with its annotation's source."""
    structs = vllm_structs()
    node = structs[name]
    fields: dict[str, str] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in structs:
            fields.update(vllm_fields(base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = ast.unparse(stmt.annotation)
    return fields


def read_fields(name: str) -> tuple[str, ...]:
    """vLLM's fields of event `name` that the decoder reads, in vLLM's order."""
    return tuple(field for field in vllm_fields(name) if field not in NOT_READ[name])


STORED_FIELDS = read_fields("BlockStored")
REMOVED_FIELDS = read_fields("BlockRemoved")

enc = msgspec.msgpack.encode


@functools.cache
def capture() -> str:
    return VLLM_CAPTURE.read_text()


def messages() -> list[dict[str, Any]]:
    return json.loads(capture())["kv_events"]["messages"]


def real_events() -> list[dict[str, Any]]:
    """Every event of the capture, hashes as ints (what vLLM sends by default)."""
    out = []
    for message in messages():
        for event in message["events"]:
            event = dict(event)
            if "block_hashes" in event:
                event["block_hashes"] = [int(h, 16) for h in event["block_hashes"]]
            if event.get("parent_block_hash") is not None:
                event["parent_block_hash"] = int(event["parent_block_hash"], 16)
            out.append(event)
    return out


REAL_EVENTS = tuple(real_events())


def real_stored(**changes: Any) -> dict[str, Any]:
    """The capture's first BlockStored with a parent (vLLM 0.32, block size 32)."""
    event = next(e for e in real_events() if e["type"] == "BlockStored" and e["parent_block_hash"])
    event = copy.deepcopy(event)
    event.update(changes)
    return event


def real_removed(**changes: Any) -> dict[str, Any]:
    event = copy.deepcopy(next(e for e in real_events() if e["type"] == "BlockRemoved"))
    event.update(changes)
    return event


def as_bytes(value: int | bytes | None) -> bytes | None:
    """A hash as vLLM sends it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: a 32-byte digest
    whose last 8 bytes, big-endian, are the value (bytes are kept as they are)."""
    if value is None or isinstance(value, bytes):
        return value
    return b"\x5a" * 24 + value.to_bytes(8, "big")


def hash_fields(name: str) -> dict[str, bool]:
    """The fields of event `name` that vLLM types as block hashes (int, or bytes with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), each with whether it is a list of them."""
    return {
        field: annotation.startswith("list[")
        for field, annotation in vllm_fields(name).items()
        if "ExternalBlockHash" in annotation
    }


def with_bytes_hashes(event: dict[str, Any]) -> dict[str, Any]:
    event = dict(event)
    for field, is_list in hash_fields(event["type"]).items():
        if field in event:
            value = event[field]
            event[field] = [as_bytes(h) for h in value] if is_list else as_bytes(value)
    return event


def positional(event: dict[str, Any]) -> list[Any]:
    # The engine model's encoder of the pre-0.26 layout (vllm_sim), which has no
    # kv_cache_spec_kind.
    return sim_events.positional_event(event)


UNKNOWN = {"type": "BlockMovedToTier", "block_hashes": [1]}  # a future vLLM event


# Each layout, and the path the decoder takes for it.
LAYOUTS = {
    "map": lambda e: e,
    "map-bytes-hashes": with_bytes_hashes,
    "positional": positional,
}


def decode(*events: object, rank: object = 0, ts: object = 1795945046.25, **limits: int):
    dec = KvEventDecoder(DecodeLimits(**limits), KvEventStats())
    return dec, dec.decode(enc([ts, list(events), rank]), pod="pod-a")


def fields_of(event: BlockStored | BlockRemoved) -> dict[str, Any]:
    names = STORED_FIELDS if isinstance(event, BlockStored) else REMOVED_FIELDS
    return {name: getattr(event, name) for name in names}


def expected(event: dict[str, Any], layout: str) -> dict[str, Any]:
    names = STORED_FIELDS if event["type"] == "BlockStored" else REMOVED_FIELDS
    want = {name: event.get(name) for name in names}
    if layout == "positional" and "kv_cache_spec_kind" in want:
        want["kv_cache_spec_kind"] = None  # not in that layout
    return want


# -- every field of a real event, in every layout -------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_field_of_the_real_vllm_events_survives_decoding(layout):
    events = real_events()
    encode = LAYOUTS[layout]
    dec, got = decode(*(encode(e) for e in events), rank=0, ts=1795945046.052701)
    assert got is not None
    assert got.ts == 1795945046.052701 and got.data_parallel_rank == 0
    assert [type(e).__name__ for e in got.events] == [e["type"] for e in events]
    for event, want in zip(got.events, events, strict=True):
        if not isinstance(event, AllBlocksCleared):
            assert fields_of(event) == expected(want, layout)
    counts = dec.stats.counts
    assert counts["events"] == len(events) and counts["batches"] == 1
    assert counts["positional_layout"] == (layout == "positional")
    # One count per event that carries bytes hashes.
    with_hashes = sum(1 for e in events if e["type"] != "AllBlocksCleared")
    assert counts["bytes_hashes"] == (with_hashes if layout == "map-bytes-hashes" else 0)
    assert counts["invalid_event"] == counts["unknown_event_type"] == 0


LORA_ON_CPU_GROUP_1 = {"lora_id": 3, "lora_name": "sql-lora", "medium": "CPU", "group_idx": 1}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_medium_and_group_of_a_real_event_are_kept_in_every_layout(layout):
    """The index skips other tiers and KV cache groups and keys LoRA blocks by their
    adapter: these fields must reach it as sent."""
    stored = real_stored(**LORA_ON_CPU_GROUP_1, extra_keys=[["sql-lora"]])
    removed = real_removed(medium="CPU", group_idx=1)
    encode = LAYOUTS[layout]
    _, got = decode(encode(stored), encode(removed), rank=7, ts=12.5)
    assert got is not None
    assert got.ts == 12.5 and got.data_parallel_rank == 7
    assert fields_of(got.events[0]) == expected(stored, layout)
    assert fields_of(got.events[1]) == expected(removed, layout)


def test_a_batch_with_an_unknown_event_is_read_event_by_event_and_keeps_the_others():
    """A future event type makes the typed decoders refuse the batch: the events are then
    read one by one, and the real ones decode to what the typed path gives."""
    events = [*real_events()[:3], real_removed(), {"type": "AllBlocksCleared"}]
    dec, got = decode(UNKNOWN, *events, rank=2, ts=99)
    assert got is not None
    assert got.ts == 99.0 and type(got.ts) is float and got.data_parallel_rank == 2
    assert [type(e).__name__ for e in got.events] == [e["type"] for e in events]
    for event, want in zip(got.events, events, strict=True):
        if isinstance(event, BlockStored):
            for name in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
                assert getattr(event, name) == want[name], name
            assert (event.medium, event.lora_name, event.extra_keys) == (
                "GPU",
                None,
                want["extra_keys"],
            )
            assert event.kv_cache_spec_kind == "full_attention"
        elif isinstance(event, BlockRemoved):
            assert (event.block_hashes, event.medium) == (want["block_hashes"], "GPU")
    assert dec.stats.counts["unknown_event_type"] == 1
    assert dec.stats.counts["events"] == len(events)


def test_read_event_by_event_the_positional_layout_and_bytes_hashes_still_decode():
    stored = with_bytes_hashes(real_stored(lora_name="sql-lora", extra_keys=[["sql-lora"]]))
    removed = with_bytes_hashes(real_removed(medium="CPU"))
    want = real_stored()
    dec, got = decode(UNKNOWN, positional(stored), positional(removed), rank="zero")
    assert got is not None
    assert got.data_parallel_rank is None  # not an int: unknown
    first, second = got.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockRemoved)
    assert first.block_hashes == want["block_hashes"]
    assert first.parent_block_hash == want["parent_block_hash"]
    assert (first.lora_name, first.extra_keys, first.medium) == ("sql-lora", [["sql-lora"]], "GPU")
    assert second.block_hashes == real_removed()["block_hashes"] and second.medium == "CPU"
    # Counted once per event whose hashes are bytes.
    assert dec.stats.counts["bytes_hashes"] == 2


def test_a_batch_without_a_rank_has_none():
    _, got = decode(real_removed(), rank=None)
    assert got is not None and got.data_parallel_rank is None
    got = KvEventDecoder().decode(enc([5.0, [real_removed()]]))
    assert got is not None and got.data_parallel_rank is None and got.ts == 5.0
    got = KvEventDecoder().decode(enc([5.0, [UNKNOWN, real_removed()]]))
    assert got is not None and got.data_parallel_rank is None and len(got.events) == 1


# -- vLLM's own declarations ------------------------------------------------------------------


@pytest.mark.parametrize("event", [BlockStored, BlockRemoved, AllBlocksCleared])
def test_each_event_declares_vllms_fields_in_vllms_order(event):
    """The map layout reads fields by name, the positional one by position: the decoder's
    fields are vLLM's first ones, in vLLM's order; vLLM's others are not read."""
    ours = [info.name for info in msgspec.structs.fields(event)]
    theirs = list(vllm_fields(event.__name__))
    assert ours == theirs[: len(ours)]
    assert tuple(theirs[len(ours) :]) == NOT_READ[event.__name__]


def test_a_batch_and_its_events_are_laid_out_as_vllm_declares_them():
    """vLLM's EventBatch is an array `[ts, events, data_parallel_rank]`; its events are
    tagged structs (msgspec's `tag=True`: the class name, under the key "type")."""
    structs = vllm_structs()
    options = {
        name: {kw.arg: ast.literal_eval(kw.value) for kw in structs[name].keywords}
        for name in ("EventBatch", "KVCacheEvent")
    }
    assert options["EventBatch"]["array_like"] is True
    assert [info.name for info in msgspec.structs.fields(EventBatch)] == list(
        vllm_fields("EventBatch")
    )
    assert options["KVCacheEvent"]["tag"] is True and "tag_field" not in options["KVCacheEvent"]
    for event in (BlockStored, BlockRemoved, AllBlocksCleared):
        assert structs[event.__name__].bases[0].id == "KVCacheEvent"  # type: ignore[attr-defined]
        config = event.__struct_config__
        assert (config.tag, config.tag_field) == (event.__name__, "type")


def test_each_layout_built_from_the_declarations_reads_a_real_batch_sent_in_it():
    """The layouts are built from events.py's declarations when the module loads; built
    again here, each reads a real batch sent in its layout into the events the decoder
    keeps, every field as sent, and the layouts tried before it refuse that batch. What a
    publisher leaves out (msgspec's omit_defaults; an older vLLM's shorter arrays) is None;
    what a newer one adds at the end of an array is ignored."""
    layouts = build_layouts()
    assert [(layout.name, layout.bytes_hashes, layout.counter) for layout in layouts] == [
        ("map", False, None),
        ("map, bytes hashes", True, None),
        ("positional", False, "positional_layout"),
    ]
    stored = real_stored(**LORA_ON_CPU_GROUP_1, extra_keys=[["sql-lora"]])
    events = [
        *real_events(),
        stored,
        real_removed(medium="CPU", group_idx=1),
        {"type": "BlockStored", **{field: stored[field] for field in STORED_FIELDS[:4]}},
        {"type": "BlockRemoved", "block_hashes": stored["block_hashes"]},
    ]
    classes = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
    for at, (layout, name) in enumerate(zip(layouts, LAYOUTS, strict=True)):
        # The map layout's decoder yields the events the router keeps: nothing to convert.
        assert (layout.converters is None) == (name == "map")
        sent = [LAYOUTS[name](event) for event in events]
        if name == "positional":
            sent = [[*event, "a later field", None] for event in sent[:-2]]
            sent += [positional(events[-2])[:5], positional(events[-1])[:2]]
        payload = enc([12.5, sent, 7])
        for earlier in layouts[:at]:
            with pytest.raises(msgspec.ValidationError):
                earlier.decoder.decode(payload)
        raw = layout.decoder.decode(payload)
        assert (raw.ts, raw.data_parallel_rank) == (12.5, 7)
        converters = layout.converters
        got = raw.events if converters is None else [converters[type(e)](e) for e in raw.events]
        assert [type(event) for event in got] == [classes[event["type"]] for event in events]
        for event, want in zip(got, events, strict=True):
            if not isinstance(event, AllBlocksCleared):
                assert fields_of(event) == expected(want, name)
        # A required field left out: the typed decoder refuses the batch.
        partial = LAYOUTS[name]({k: v for k, v in stored.items() if k != "block_size"})
        if name == "positional":
            partial = partial[:4]
        with pytest.raises(msgspec.ValidationError, match=r"block_size|at least length 5"):
            layout.decoder.decode(enc([12.5, [partial], 7]))


# -- the typed decoders and the event-by-event reader agree -------------------------------------


def random_event(rng: random.Random, signed: bool) -> dict[str, Any]:
    """A real event with its fields drawn at random (every medium, group, LoRA and hash
    range); about one in ten breaks a bound."""
    event = dict(rng.choice(REAL_EVENTS))  # every field but the type is replaced
    kind = event["type"]
    if kind == "AllBlocksCleared":
        return event
    n = rng.randrange(1, 5)

    def hash_() -> int:
        value = rng.randrange(1 << 64)
        return value - (1 << 64) if signed and value >> 63 and rng.random() < 0.5 else value

    event.update(
        block_hashes=[hash_() for _ in range(n)],
        medium=rng.choice(["GPU", "CPU", None]),
        group_idx=rng.choice([0, 1, 2, None]),
    )
    if kind == "BlockStored":
        size = rng.choice([1, 2, 16])
        lora = rng.choice([(None, None), (3, "sql-lora")])
        event.update(
            parent_block_hash=rng.choice([None, hash_()]),
            block_size=size,
            token_ids=[rng.randrange(200_000) for _ in range(n * size)],
            lora_id=lora[0],
            lora_name=lora[1],
            extra_keys=rng.choice([None, [None] * n, [[lora[1]]] * n]),
            kv_cache_spec_kind=rng.choice(["full_attention", "sliding_window", None]),
        )
        if rng.random() < 0.1:
            event["token_ids"] = event["token_ids"][1:]
    if rng.random() < 0.05:
        event["block_hashes"] = []
    return event


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_decodes_the_same_typed_and_event_by_event(layout):
    """Random batches of real events in each layout decode to equal events, every field
    compared, whether the layout's typed decoder reads the batch or one unknown event
    makes the decoder read it event by event."""
    rng = random.Random(f"kv-events {layout}")
    encode = LAYOUTS[layout]
    signed = layout != "map-bytes-hashes"
    for _ in range(1500):
        events = [encode(random_event(rng, signed)) for _ in range(rng.randrange(1, 8))]
        if layout == "positional" and rng.random() < 0.5:
            events = [[*e, "a later field", None] for e in events]  # ignored
        typed_decoder, typed = decode(*events)
        by_hand_decoder, by_hand = decode(UNKNOWN, *events)
        assert typed is not None and by_hand is not None
        assert by_hand.events == typed.events
        typed_counts = typed_decoder.stats.counts
        by_hand_counts = by_hand_decoder.stats.counts
        # Which path read the batch.
        assert typed_counts["unknown_event_type"] == 0
        assert by_hand_counts["unknown_event_type"] == 1
        assert typed_counts["positional_layout"] == (layout == "positional")
        assert by_hand_counts["positional_layout"] == 0
        for reason in ("events", "invalid_event", "bytes_hashes"):
            assert typed_counts[reason] == by_hand_counts[reason], reason


# -- hashes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["map", "positional", "event-by-event"])
def test_signed_hashes_read_as_their_64_bits(layout):
    stored = real_stored(block_hashes=[-1], parent_block_hash=-2)
    removed = real_removed(block_hashes=[-3, 4])
    events: list[object]
    if layout == "positional":
        events = [positional(stored), positional(removed)]
    elif layout == "event-by-event":
        events = [UNKNOWN, stored, removed]
    else:
        events = [stored, removed]
    _, got = decode(*events)
    assert got is not None
    first, second = got.events
    assert first.block_hashes == [MASK64] and first.parent_block_hash == MASK64 - 1  # type: ignore[union-attr]
    assert second.block_hashes == [MASK64 - 2, 4]


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b"\x01", 1),
        (b"\x01\x02", 0x0102),
        (bytes(range(1, 9)), 0x0102030405060708),
        (b"\xff" * 24 + bytes(range(1, 9)), 0x0102030405060708),
    ],
)
@pytest.mark.parametrize("path", ["typed", "event-by-event"])
def test_a_bytes_hash_is_its_last_8_bytes_big_endian(raw, value, path):
    removed = {"type": "BlockRemoved", "block_hashes": [raw, 5]}
    stored = real_stored(parent_block_hash=raw)
    events = [stored, removed] if path == "typed" else [UNKNOWN, stored, removed]
    _, got = decode(*events)
    assert got is not None
    assert got.events[0].parent_block_hash == value  # type: ignore[union-attr]
    assert got.events[1].block_hashes == [value, 5]  # type: ignore[union-attr]


# -- what is dropped, counted and logged ------------------------------------------------------


INVALID = [
    (real_stored(token_ids=list(range(31))), "31 token ids for 1 blocks of 32"),
    (real_stored(block_size=0, token_ids=[]), "block_size 0"),
    (real_stored(block_size=-32), "block_size -32"),
    (real_stored(block_size=4097, token_ids=[0] * 4097), "block_size 4097"),
    (real_stored(block_hashes=[]), "no block hashes"),
    (real_removed(block_hashes=[]), "no block hashes"),
    (real_stored(extra_keys=[None, None]), "2 extra_keys for 1 blocks"),
    (real_stored(block_hashes=[b""]), "an empty bytes hash"),
    (real_stored(parent_block_hash=b""), "an empty bytes hash"),
    (real_removed(block_hashes=[b"\x01", b""]), "an empty bytes hash"),
]
INVALID_BY_HAND = [
    (real_stored(block_hashes=["ab"]), "a block hash must be an int or bytes, not str"),
    (real_stored(parent_block_hash=1.5), "a block hash must be an int or bytes, not float"),
    (real_removed(block_hashes=[True]), "a block hash must be an int or bytes, not bool"),
    (real_removed(block_hashes=5), "block_hashes must be a list"),
    (real_stored(block_hashes=None), "block_hashes must be a list"),
    (real_stored(token_ids="abc"), "token_ids must be a list of ints"),
    (real_stored(token_ids=[1.0] * 32), "token_ids must be a list of ints"),
    (real_stored(block_size="32"), "block_size must be an int"),
    (real_stored(block_size=True), "block_size must be an int"),
    (real_stored(extra_keys="salt"), "extra_keys must be a list or null"),
    (real_stored(lora_name=7), "lora_name must be a string or null"),
    (real_stored(lora_id="3"), "lora_id must be an int or null"),
    (real_stored(group_idx=True), "group_idx must be an int or null"),
    (real_removed(group_idx=1.5), "group_idx must be an int or null"),
    (real_stored(medium=7), "expected a string, got int"),
    (real_stored(kv_cache_spec_kind=["x"]), "expected a string, got list"),
    (real_removed(medium=b"GPU"), "expected a string, got bytes"),
    (["BlockStored"], "block_hashes must be a list"),
    ("BlockStored", "an event is neither a map nor a non-empty array"),
    ([], "an event is neither a map nor a non-empty array"),
    (17, "an event is neither a map nor a non-empty array"),
]


@pytest.mark.parametrize(("bad", "error"), INVALID + INVALID_BY_HAND)
def test_an_event_breaking_the_rules_is_dropped_with_a_warning_naming_the_rule(bad, error):
    good = real_removed()
    with structlog.testing.capture_logs() as logs:
        dec, got = decode(bad, good)
    assert got is not None
    (kept,) = got.events
    assert isinstance(kept, BlockRemoved) and kept.block_hashes == good["block_hashes"]
    assert dec.stats.counts["invalid_event"] == 1 and dec.stats.counts["events"] == 1
    assert logs == [
        {
            "event": "kv_event_problem",
            "log_level": "warning",
            "reason": "invalid_event",
            "count": 1,
            "pod": "pod-a",
            "error": error,
        }
    ]


@pytest.mark.parametrize(("bad", "error"), INVALID)
def test_an_event_breaking_the_rules_is_dropped_whatever_the_path(bad, error):
    """The same rules in the positional layout and read event by event."""
    good = real_removed()
    for events in (
        [UNKNOWN, bad, good],
        [positional(bad), positional(good)],
        [with_bytes_hashes(bad), with_bytes_hashes(good)],
    ):
        with structlog.testing.capture_logs() as logs:
            dec, got = decode(*events)
        assert got is not None and len(got.events) == 1
        assert dec.stats.counts["invalid_event"] == 1
        invalid = [log for log in logs if log["reason"] == "invalid_event"]
        assert [(log["error"], log["pod"]) for log in invalid] == [(error, "pod-a")]


def test_an_unknown_event_type_is_dropped_with_its_type_in_the_warning():
    long_name = "BlockMoved" + "x" * 100
    with structlog.testing.capture_logs() as logs:
        dec, got = decode({"type": "BlockMoved"}, ["Unheard", 1, 2], {"type": long_name})
    assert got is not None and got.events == []
    assert dec.stats.counts["unknown_event_type"] == 3
    assert [log["type"] for log in logs] == [
        "'BlockMoved'",
        "'Unheard'",
        repr(long_name)[:80] + "...",  # long values are cut at 80 characters
    ]
    assert {(log["reason"], log["pod"]) for log in logs} == {("unknown_event_type", "pod-a")}


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (enc({"ts": 1, "events": []}), "not [ts, events, rank]"),
        (enc([1.0]), "not [ts, events, rank]"),
        (enc([1.0, "events", 0]), "not [ts, events, rank]"),
        (enc([None, [], 0]), "not [ts, events, rank]"),
        (enc([False, [], 0]), "not [ts, events, rank]"),
        (b"\xc1", "MessagePack data is malformed: invalid opcode '\\xc1' (byte 0)"),
    ],
)
def test_a_payload_that_is_not_a_batch_is_warned_about_once(payload, error):
    with structlog.testing.capture_logs() as logs:
        dec = KvEventDecoder()
        assert dec.decode(payload, pod="pod-a") is None
    assert logs == [
        {
            "event": "kv_event_problem",
            "log_level": "warning",
            "reason": "malformed_payload",
            "count": 1,
            "pod": "pod-a",
            "error": error,
        }
    ]
    assert dec.stats.counts["batches"] == 0


def test_an_integer_timestamp_and_an_empty_event_list_are_a_batch():
    _, got = decode(rank=0, ts=1795945046)
    assert got == EventBatch(1795945046.0, [], 0)
    dec = KvEventDecoder()
    # Two elements (no rank) read by hand: still a batch.
    got = dec.decode(enc([3, [UNKNOWN]]))
    assert got == EventBatch(3.0, [], None)
    assert dec.stats.counts["batches"] == 1 and dec.stats.counts["malformed_payload"] == 0


# -- bounds -----------------------------------------------------------------------------------


def test_the_default_limits_hold_an_engine_steps_batch_and_refuse_beyond():
    """Production passes only max_payload_bytes: the other bounds are these defaults."""
    limits = DecodeLimits(max_payload_bytes=1 << 24)
    dec = KvEventDecoder(limits, KvEventStats())
    cleared = [["AllBlocksCleared"]] * 100_000
    got = dec.decode(enc([1.0, cleared, 0]))
    assert got is not None and len(got.events) == 100_000
    assert dec.decode(enc([1.0, [*cleared, ["AllBlocksCleared"]], 0])) is None
    assert dec.stats.counts["oversized_batch"] == 1
    removed = {"type": "BlockRemoved", "block_hashes": list(range(65_536))}
    got = dec.decode(enc([1.0, [removed], 0]))
    assert got is not None and len(got.events) == 1
    removed["block_hashes"].append(1)
    got = dec.decode(enc([1.0, [removed], 0]))
    assert got is not None and got.events == []
    stored = real_stored(block_size=4096, token_ids=[1] * 4096)
    got = dec.decode(enc([1.0, [stored], 0]))
    assert got is not None and got.events[0].block_size == 4096  # type: ignore[union-attr]


def test_the_default_payload_cap_is_one_mebibyte():
    def payload_of(size: int) -> bytes:
        pad = "x" * (size - 100)  # a str32 in msgpack: the header stays the same size
        for _ in range(3):
            data = enc([1.0, [real_removed(pad=pad)], 0])
            if len(data) == size:
                return data
            pad = "x" * (len(pad) + size - len(data))
        raise AssertionError("no payload of that size")

    dec = KvEventDecoder()
    assert dec.decode(payload_of(1024 * 1024)) is not None
    with structlog.testing.capture_logs() as logs:
        assert dec.decode(payload_of(1024 * 1024 + 1), pod="pod-a") is None
    assert dec.stats.counts["oversized_payload"] == 1
    assert logs == [
        {
            "event": "kv_event_problem",
            "log_level": "warning",
            "reason": "oversized_payload",
            "count": 1,
            "pod": "pod-a",
            "bytes": 1024 * 1024 + 1,
        }
    ]


def test_a_payload_nested_past_the_decoders_depth_is_refused_not_raised():
    # Nesting inside extra_keys (list[Any]) passes the typed decoder's checks and makes it
    # raise RecursionError rather than a msgspec error.
    event = real_stored(extra_keys=[None])
    payload = enc([1.0, [event], 0])
    at = payload.index(b"\x91\xc0")  # extra_keys: [None]
    deep = payload[:at] + b"\x91" * 100_000 + b"\xc0" + payload[at + 2 :]
    dec = KvEventDecoder()
    with structlog.testing.capture_logs() as logs:
        assert dec.decode(deep, pod="pod-a") is None
    assert dec.stats.counts["malformed_payload"] == 1
    assert [(log["reason"], log["pod"]) for log in logs] == [("malformed_payload", "pod-a")]


@pytest.mark.parametrize("layout", ["map", "map-bytes-hashes", "positional", "event-by-event"])
def test_limits_apply_in_every_layout(layout):
    stored = real_stored()  # 1 block of 32
    if layout == "map-bytes-hashes":
        stored = with_bytes_hashes(stored)
    elif layout == "positional":
        stored = positional(stored)
    at_limit = dict(max_events=2, max_blocks_per_event=1, max_block_size=32)
    prefix = [UNKNOWN] if layout == "event-by-event" else []
    # max_events counts what was sent (an unknown event included).
    dec, got = decode(*prefix, *[stored] * (2 - len(prefix)), **at_limit)
    assert got is not None and len(got.events) == 2 - len(prefix)
    with structlog.testing.capture_logs() as logs:
        dec, got = decode(*prefix, *[stored] * (3 - len(prefix)), **at_limit)
    assert got is None
    assert dec.stats.counts["oversized_batch"] == 1 and dec.stats.counts["batches"] == 0
    assert logs == [
        {
            "event": "kv_event_problem",
            "log_level": "warning",
            "reason": "oversized_batch",
            "count": 1,
            "pod": "pod-a",
            "events": 3,
        }
    ]
    for limits, error in (
        (dict(max_blocks_per_event=0), "1 blocks in one event"),
        (dict(max_block_size=31), "block_size 32"),
    ):
        with structlog.testing.capture_logs() as logs:
            dec, got = decode(*prefix, stored, **limits)
        assert got is not None and got.events == []
        assert [log["error"] for log in logs if log["reason"] == "invalid_event"] == [error]


# -- the warning's rate -----------------------------------------------------------------------


def test_warnings_are_rate_limited_per_reason_and_the_suppressed_are_reported():
    now = [0.0]
    stats = KvEventStats(clock=lambda: now[0])  # the defaults: 10 lines, then 1 a second
    with structlog.testing.capture_logs() as logs:
        for _ in range(15):
            stats.problem("gaps", pod="a")
        stats.problem("resyncs", 3)  # another reason has its own budget
        now[0] = 0.5
        stats.problem("gaps")  # half a line refilled: still suppressed
        now[0] = 1.5
        stats.problem("gaps")
        stats.problem("gaps")
        now[0] = 1000.0  # the budget refills up to the burst, not beyond
        for _ in range(12):
            stats.problem("gaps")
    gaps = [log for log in logs if log["reason"] == "gaps"]
    assert len(gaps) == 10 + 1 + 10
    assert all(log["event"] == "kv_event_problem" and log["count"] == 1 for log in gaps)
    assert gaps[0] == {
        "event": "kv_event_problem",
        "log_level": "warning",
        "reason": "gaps",
        "count": 1,
        "pod": "a",
    }
    assert gaps[10]["suppressed"] == 6  # 5 at t=0, 1 at t=0.5
    assert gaps[11]["suppressed"] == 1  # the second line at t=1.5
    assert all("suppressed" not in log for log in gaps[:10] + gaps[12:])
    assert stats.suppressed == {"gaps": 2}  # the last 2 at t=1000: 10 lines, not 1000
    assert next(log for log in logs if log["reason"] == "resyncs")["count"] == 3
    assert stats.counts["gaps"] == 15 + 1 + 2 + 12 and stats.counts["resyncs"] == 3


def test_counters_start_at_zero_for_every_reason_and_add_counts():
    stats = KvEventStats()
    assert set(stats.counts.values()) == {0}
    stats.add("gaps")
    stats.add("gaps", 4)
    stats.add("a_new_reason")
    stats.problem("another_new_reason", 2)
    assert stats.counts["gaps"] == 5 and stats.counts["a_new_reason"] == 1
    assert stats.counts["another_new_reason"] == 2


# -- sequence frames ---------------------------------------------------------------------------


def test_sequence_frames_are_8_bytes_big_endian():
    assert encode_seq(5) == b"\x00" * 7 + b"\x05"
    assert encode_seq(MASK64) == b"\xff" * 8
    assert decode_seq(bytes(range(1, 9))) == 0x0102030405060708
    assert decode_seq(b"\x00" * 9) is None and decode_seq(b"") is None


# -- split_events ------------------------------------------------------------------------------


def test_pieces_of_a_large_event_keep_every_field_but_the_blocks():
    stored = BlockStored(
        block_hashes=[10, 11, 12],
        parent_block_hash=9,
        token_ids=list(range(6)),
        block_size=2,
        lora_id=3,
        medium="GPU",
        lora_name="sql",
        extra_keys=[["sql", "salt"], ["sql"], ["sql"]],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
    )
    removed = BlockRemoved([1, 2, 3], medium="CPU", group_idx=2)
    slices = list(split_events([stored, removed], 2))
    assert slices == [
        [
            BlockStored(
                [10, 11],
                9,
                [0, 1, 2, 3],
                2,
                3,
                "GPU",
                "sql",
                [["sql", "salt"], ["sql"]],
                1,
                "full_attention",
            )
        ],
        [BlockStored([12], 11, [4, 5], 2, 3, "GPU", "sql", [["sql"]], 1, "full_attention")],
        [BlockRemoved([1, 2], "CPU", 2)],
        [BlockRemoved([3], "CPU", 2)],
    ]
    no_extra = BlockStored([1, 2, 3], None, [0] * 3, 1)
    assert [piece.extra_keys for (piece,) in split_events([no_extra], 2)] == [None, None]


def test_slices_fill_to_the_budget_and_a_whole_event_is_never_cut_if_it_fits():
    def removed(n: int, first: int = 0) -> BlockRemoved:
        return BlockRemoved(list(range(first, first + n)))

    def shape(slices: list[list[Any]]) -> list[list[int]]:
        return [[event_blocks(e) for e in s] for s in slices]

    # Exactly the budget: a slice ends there.
    assert shape(list(split_events([removed(2), removed(2), removed(1)], 4))) == [[2, 2], [1]]
    # What fits goes whole into the current slice.
    assert shape(list(split_events([removed(1), removed(3), removed(1)], 4))) == [[1, 3], [1]]
    # Too big for what is left: cut, the first piece starting a new slice only if the
    # current one has something in it.
    assert shape(list(split_events([removed(3), removed(3)], 4))) == [[3], [3]]
    assert shape(list(split_events([removed(9)], 4))) == [[4], [4], [1]]
    assert shape(list(split_events([removed(1), removed(5)], 4))) == [[1], [4], [1]]
    cleared = AllBlocksCleared()
    assert shape(list(split_events([cleared, cleared, cleared], 2))) == [[1, 1], [1]]
    assert shape(list(split_events([cleared], 1))) == [[1]]
    assert list(split_events([], 4)) == []
    with pytest.raises(ValueError, match=r"^max_blocks must be at least 1$"):
        list(split_events([cleared], 0))


def test_an_event_costs_its_blocks_and_at_least_one():
    assert event_blocks(AllBlocksCleared()) == 1
    assert event_blocks(BlockRemoved([1, 2, 3])) == 3
    assert event_blocks(BlockRemoved([])) == 1


def test_read_event_by_event_lora_id_and_group_are_kept():
    """A batch with one unknown event is read event by event: its other events keep their
    LoRA id and KV cache group (a group-1 block must not look full-attention)."""
    stored = real_stored(**LORA_ON_CPU_GROUP_1, extra_keys=[["sql-lora"]])
    removed = real_removed(medium="CPU", group_idx=1)
    _, got = decode(UNKNOWN, stored, removed)
    assert got is not None
    assert fields_of(got.events[0]) == expected(stored, "map")
    assert fields_of(got.events[1]) == expected(removed, "map")


def test_counters_add_up_over_batches():
    dec = KvEventDecoder()
    stored = real_stored()
    for events in ([stored, real_removed()], [positional(stored)], [positional(stored)]):
        assert dec.decode(enc([1.0, events, 0])) is not None
    counts = dec.stats.counts
    assert (counts["batches"], counts["events"], counts["positional_layout"]) == (3, 4, 2)
    for events in ([UNKNOWN, stored], [with_bytes_hashes(stored)], [with_bytes_hashes(stored)]):
        assert dec.decode(enc([1.0, events, 0])) is not None
    assert (counts["batches"], counts["events"], counts["bytes_hashes"]) == (6, 7, 2)


def test_the_smallest_block_size_is_one_token():
    stored = real_stored(block_size=1, token_ids=[42])
    for events in ([stored], [positional(stored)], [UNKNOWN, stored]):
        _, got = decode(*events)
        assert got is not None and got.events[-1].block_size == 1  # type: ignore[union-attr]


def test_an_event_whose_type_is_no_string_is_an_unknown_type():
    with structlog.testing.capture_logs() as logs:
        dec, got = decode(
            [17, [1], None],
            {"type": 5},
            {"type": ["BlockStored"]},  # unhashable: no lookup may raise
            [{"type": "BlockRemoved"}, [1]],
            real_removed(),
        )
    assert got is not None and len(got.events) == 1
    assert dec.stats.counts["unknown_event_type"] == 4
    assert [log["type"] for log in logs] == [
        "17",
        "5",
        "['BlockStored']",
        "{'type': 'BlockRemoved'}",
    ]


def test_a_type_name_is_cut_only_past_80_characters():
    exact = "B" * 78  # its repr, quotes included, is 80 characters
    with structlog.testing.capture_logs() as logs:
        decode({"type": exact}, {"type": exact + "C"})
    assert [log["type"] for log in logs] == [repr(exact), repr(exact + "C")[:80] + "..."]


def test_a_warning_is_logged_as_soon_as_one_whole_line_has_refilled():
    now = [0.0]
    stats = KvEventStats(log_burst=1.0, log_per_second=2.0, clock=lambda: now[0])
    with structlog.testing.capture_logs() as logs:
        stats.problem("gaps")
        stats.problem("gaps")  # suppressed
        now[0] = 0.5  # exactly one line refilled at 2 a second
        stats.problem("gaps")
    assert len(logs) == 2 and logs[1]["suppressed"] == 1
