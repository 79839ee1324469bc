"""atheris harness: the replicas' peers frames (epp.replicas.protocol). Contract: any frame
decodes to a message within the bounds protocol.py promises, or raises ProtocolError."""

from __future__ import annotations

import re
import sys

import atheris

with atheris.instrument_imports():
    from epp.replicas.protocol import (
        MAX_IDLE_TIMEOUT_S,
        Auth,
        Completion,
        Decision,
        Hello,
        ProtocolError,
        decode,
        encode,
    )

from harness import run

REPLICA_ID = re.compile(r"[0-9A-Za-z_.-]{1,64}")


def _bounded(message: object) -> bool:
    if isinstance(message, Hello):
        return (
            bool(REPLICA_ID.fullmatch(message.replica))
            and 0 <= message.block_size <= 2**31
            and (message.nonce is None or len(message.nonce) == 16)
            and len(message.proofs) <= 2
            and all(len(p) == 32 for p in message.proofs)
            and 0 <= message.idle_timeout_s <= MAX_IDLE_TIMEOUT_S
        )
    if isinstance(message, Auth):
        return len(message.proof) == 32
    if isinstance(message, Decision):
        counts = (message.prompt_tokens, message.matched, message.uncached)
        return (
            bool(REPLICA_ID.fullmatch(message.replica))
            and 1 <= len(message.pod) <= 253
            and all(0 <= h < 2**64 for h in message.hashes)
            and all(0 <= c <= 2**31 for c in counts)
        )
    if isinstance(message, Completion):
        return (message.status is None or 0 <= message.status <= 999) and 1 <= len(
            message.token
        ) <= 128
    return True


def test_one_input(data: bytes) -> None:
    try:
        message = decode(data)
    except ProtocolError:
        return
    if not _bounded(message):
        raise AssertionError(f"out of bounds: {message!r}"[:300])


def seeds() -> list[bytes]:
    messages = [
        Hello("replica-a", 1, 16, b"\x01" * 16, (b"\x02" * 32,), 30.0),
        Auth(b"\x03" * 32),
        Decision("replica-a", "pod-1", [1, 2**64 - 1], 4096, 1, 4000, 1.7e9),
        Completion("tok-1", 200, "10.0.0.1:8000"),
    ]
    return [encode(m)[4:] for m in messages]


if __name__ == "__main__":
    sys.exit(run("peers_protocol", test_one_input, seeds()))
