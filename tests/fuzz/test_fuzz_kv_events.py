"""vLLM's KV-event batches as the EPP decodes them (epp.prefix.kv_events), fuzzed.

Contract (epp.prefix.kv_events.decoder's docstring): the decoder never raises on input; a payload that is
not a batch (or over the limits) gives None; a kept event obeys every rule (a hash is an
unsigned 64-bit value, token ids fill the blocks exactly, block counts and sizes within
`DecodeLimits`). Valid batches as the simulator publishes them (vllm_sim.kv_events, the
map layout, the pre-0.26 positional layout, bytes hashes) decode to the same blocks.
"""

from __future__ import annotations

import msgspec
from fuzz.budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.prefix.kv_events import (
    MASK64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeLimits,
    EventBatch,
    KvEventDecoder,
)
from vllm_sim import kv_events as sim

LIMITS = DecodeLimits(
    max_payload_bytes=64 * 1024, max_events=6, max_blocks_per_event=8, max_block_size=16
)


def decode(payload: bytes, limits: DecodeLimits = LIMITS) -> EventBatch | None:
    batch = KvEventDecoder(limits).decode(payload, pod="p")  # raising fails the property
    if batch is None:
        return None
    assert len(batch.events) <= limits.max_events
    for event in batch.events:
        assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
        if isinstance(event, AllBlocksCleared):
            continue
        n = len(event.block_hashes)
        assert 1 <= n <= limits.max_blocks_per_event
        assert all(type(h) is int and 0 <= h <= MASK64 for h in event.block_hashes)
        if isinstance(event, BlockStored):
            assert 1 <= event.block_size <= limits.max_block_size
            assert len(event.token_ids) == n * event.block_size
            assert all(type(t) is int for t in event.token_ids)
            parent = event.parent_block_hash
            assert parent is None or (type(parent) is int and 0 <= parent <= MASK64)
            assert event.extra_keys is None or len(event.extra_keys) == n
    return batch


@settings(max_examples=examples(200))
@given(payload=st.binary(max_size=512))
def test_arbitrary_bytes_never_raise(payload):
    decode(payload)


SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=10)
)
ANY = st.recursive(
    SCALAR,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
U64 = st.integers(0, MASK64)
HASH = st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=12) | ANY
KINDS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]) | ANY


def _mostly(draw, valid, garbage):
    """A valid value three times in four: garbage anywhere else."""
    return draw(valid) if draw(st.integers(0, 3)) else draw(garbage)


@st.composite
def raw_events(draw):
    kind = _mostly(
        draw, st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]), KINDS
    )
    n = draw(st.integers(0, 10))
    size = _mostly(draw, st.integers(0, 20), ANY)
    tokens = n * size if type(size) is int and 0 <= size <= 64 else n  # garbage sizes may be huge
    fields = {
        "block_hashes": _mostly(
            draw,
            st.lists(st.integers(-(2**63), 2**64 - 1), min_size=n, max_size=n),
            st.lists(HASH, min_size=n, max_size=n) | ANY,
        ),
        "parent_block_hash": _mostly(draw, st.none() | U64, HASH),
        "token_ids": _mostly(
            draw,
            st.builds(lambda d: [7] * max(0, tokens + d), st.sampled_from([-1, 0, 0, 1])),
            st.lists(st.integers(-(2**40), 2**40), max_size=n * 17) | ANY,
        ),
        "block_size": size,
        "lora_name": _mostly(draw, st.none() | st.text(max_size=5), ANY),
        "medium": _mostly(draw, st.sampled_from([None, "GPU", "CPU"]), ANY),
        "extra_keys": _mostly(
            draw, st.none() | st.just([None] * n), st.lists(ANY, min_size=n, max_size=n) | ANY
        ),
    }
    dropped = draw(st.sets(st.sampled_from(sorted(fields)), max_size=1))
    fields = {k: v for k, v in fields.items() if k not in dropped}
    if draw(st.booleans()):
        return {"type": kind, **fields}
    order = sim._POSITIONAL_FIELDS.get(kind, ()) if isinstance(kind, str) else ()
    return [kind, *(fields.get(name) for name in order)]


@st.composite
def payloads(draw):
    events = draw(st.lists(raw_events(), max_size=8))
    ts = _mostly(draw, st.floats(0, 2e9), st.floats() | st.integers(-(2**63), 2**63) | ANY)
    rank = _mostly(draw, st.none() | st.integers(0, 8), st.integers(-(2**63), 2**63) | ANY)
    batch = [ts, events, rank]
    payload = msgspec.msgpack.encode(batch[: _mostly(draw, st.just(3), st.integers(0, 3))])
    if draw(st.integers(0, 3)) == 0:
        payload = payload[: draw(st.integers(0, len(payload)))]  # truncated
    return payload


@settings(max_examples=examples(300))
@given(payload=payloads())
def test_structured_garbage_and_truncations_never_raise_and_keep_only_valid_events(payload):
    decode(payload)


# -- round trips of what the simulator publishes ---------------------------------------------


@st.composite
def sim_events(draw):
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "cleared":
        return sim.AllBlocksCleared()
    n = draw(st.integers(1, LIMITS.max_blocks_per_event))
    hashes = draw(st.lists(U64, min_size=n, max_size=n))
    if kind == "removed":
        return sim.BlockRemoved(hashes)
    size = draw(st.integers(1, LIMITS.max_block_size))
    return sim.BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | U64),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * size, max_size=n * size)),
        block_size=size,
        lora_name=draw(st.none() | st.text(max_size=8)),
        extra_keys=draw(st.none() | st.just([None] * n)),
    )


def blocks(event) -> tuple:
    """What the index applies from an event."""
    if isinstance(event, sim.BlockStored | BlockStored):
        return (
            "stored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_name,
            event.medium,
            None
            if event.extra_keys is None
            else [None if k is None else list(k) for k in event.extra_keys],
        )
    if isinstance(event, sim.BlockRemoved | BlockRemoved):
        return ("removed", list(event.block_hashes), event.medium)
    return ("cleared",)


def _as_bytes(value: int, draw) -> bytes:
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: a hash is bytes whose last 8 are the value.
    return draw(st.binary(max_size=4)) + value.to_bytes(8, "big")


@settings(max_examples=examples(150))
@given(
    events=st.lists(sim_events(), max_size=LIMITS.max_events),
    ts=st.floats(0, 2e9),
    rank=st.none() | st.integers(0, 8),
    layout=st.sampled_from(["map", "positional", "bytes"]),
    data=st.data(),
)
def test_the_simulators_batches_decode_to_the_same_blocks(events, ts, rank, layout, data):
    payload = sim.encode_event_batch(events, ts, rank)
    if layout != "map":
        raw = msgspec.msgpack.decode(payload)
        for i, event in enumerate(raw[1]):
            if layout == "positional":
                raw[1][i] = sim.positional_event(event)
            elif event["type"] != "AllBlocksCleared":
                event["block_hashes"] = [_as_bytes(h, data.draw) for h in event["block_hashes"]]
                if event.get("parent_block_hash") is not None:
                    event["parent_block_hash"] = _as_bytes(event["parent_block_hash"], data.draw)
        payload = msgspec.msgpack.encode(raw)
    batch = decode(payload)
    assert batch is not None
    assert (batch.ts, batch.data_parallel_rank) == (ts, rank)
    assert [blocks(e) for e in batch.events] == [blocks(e) for e in events]
