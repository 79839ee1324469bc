"""The sequence frame of a publisher's ZMQ message `[topic, seq, payload]`."""

from __future__ import annotations

from epp.prefix.kv_events.fields import MASK64

SEQ_BYTES = 8
REPLAY_END_SEQ = MASK64  # the replay stream ends with seq ff..ff (-1 as signed)


def decode_seq(frame: bytes) -> int | None:
    """A sequence number frame (8 bytes, big-endian); None if it is not one."""
    if len(frame) != SEQ_BYTES:
        return None
    return int.from_bytes(frame, "big")


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")
