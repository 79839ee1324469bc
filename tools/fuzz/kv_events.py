"""atheris harness: the KV-event decoder (epp.prefix.kv_events). Contract: any payload
decodes to events within the rules and limits, or to None; the decoder never raises."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from epp.prefix.kv_events import (
        MASK64,
        AllBlocksCleared,
        BlockStored,
        DecodeLimits,
        KvEventDecoder,
    )

from harness import run

from vllm_sim import kv_events as sim

LIMITS = DecodeLimits(
    max_payload_bytes=64 * 1024, max_events=16, max_blocks_per_event=8, max_block_size=16
)
DECODER = KvEventDecoder(LIMITS)


def test_one_input(data: bytes) -> None:
    batch = DECODER.decode(data, pod="p")
    if batch is None:
        return
    if len(batch.events) > LIMITS.max_events:
        raise AssertionError("too many events kept")
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            continue
        n = len(event.block_hashes)
        if not 1 <= n <= LIMITS.max_blocks_per_event:
            raise AssertionError(f"{n} blocks")
        if not all(type(h) is int and 0 <= h <= MASK64 for h in event.block_hashes):
            raise AssertionError("a hash out of range")
        if isinstance(event, BlockStored):
            if not 1 <= event.block_size <= LIMITS.max_block_size:
                raise AssertionError(f"block size {event.block_size}")
            if len(event.token_ids) != n * event.block_size:
                raise AssertionError("token ids do not fill the blocks")
            parent = event.parent_block_hash
            if parent is not None and not 0 <= parent <= MASK64:
                raise AssertionError("parent out of range")
            if event.extra_keys is not None and len(event.extra_keys) != n:
                raise AssertionError("extra keys")


def seeds() -> list[bytes]:
    stored = sim.BlockStored(
        [1, 2**64 - 1], None, list(range(8)), 4, lora_name="a", extra_keys=[None, ("a",)]
    )
    removed = sim.BlockRemoved([5])
    payload = sim.encode_event_batch([stored, removed, sim.AllBlocksCleared()], 1.5, 0)
    import msgspec

    raw = msgspec.msgpack.decode(payload)
    positional = [raw[0], [sim.positional_event(e) for e in raw[1]], raw[2]]
    raw[1][0]["block_hashes"] = [b"\x00" * 24 + b"\x01" * 8]
    return [payload, msgspec.msgpack.encode(positional), msgspec.msgpack.encode(raw)]


if __name__ == "__main__":
    sys.exit(run("kv_events", test_one_input, seeds()))
