"""The wire format: frames round-trip, and everything a receiver reads is bounded and
validated before use."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from epp.replicas.protocol import (
    HEADER,
    MAX_FRAME_BYTES,
    NONCE_BYTES,
    PROOF_BYTES,
    Auth,
    Completion,
    Decision,
    Hello,
    Ping,
    ProtocolError,
    decode,
    encode,
    frame_limit,
    read_frame,
)


def decision(**fields) -> Decision:
    values = {
        "replica": "r1",
        "pod": "pod-0",
        "hashes": [0, 1, 2**64 - 1],
        "prompt_tokens": 100,
        "matched": 2,
        "uncached": 36,
        "at": 1700000000.5,
    }
    values.update(fields)
    return Decision(**values)


def body(frame: bytes) -> bytes:
    (length,) = HEADER.unpack(frame[: HEADER.size])
    assert length == len(frame) - HEADER.size
    return frame[HEADER.size :]


@pytest.mark.parametrize(
    "message",
    [
        Hello("abc123", 1, 16),
        Hello("abc123", 1, 16, nonce=b"n" * NONCE_BYTES),
        Hello("abc123", 1, 16, nonce=b"n" * NONCE_BYTES, proofs=(b"p" * PROOF_BYTES,) * 2),
        Auth(b"p" * PROOF_BYTES),
        decision(),
        decision(hashes=[]),
        Completion("r1.00ff", 200, "10.0.0.1:8000"),
        Completion("r1.00ff", None, None),
        Hello("abc123", 1, 16, idle_timeout_s=30.0),
        Ping(),
    ],
)
def test_every_message_round_trips_through_one_frame(message):
    assert decode(body(encode(message))) == message


def test_a_decision_with_8192_hashes_fits_the_default_frame_bound():
    frame = encode(decision(hashes=[2**64 - 1 - i for i in range(8192)]))
    assert len(frame) <= frame_limit(8192) == MAX_FRAME_BYTES
    assert frame_limit(1_000_000) > 9 * 1_000_000  # a larger configuration raises the bound


def raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        b"\x92\xa5hello",  # truncated array
        raw(["nonsense", 1]),  # unknown tag
        raw({"replica": "x"}),  # a map, not the tagged array
        raw(["decision", "r1", "pod-0", [-1], 1, 0, 0, 0.0]),  # negative hash
        raw(["decision", "r1", "pod-0", ["ab"], 1, 0, 0, 0.0]),  # hash of the wrong type
        raw(["decision", "r1", "pod-0", [1], -5, 0, 0, 0.0]),  # negative count
        raw(["decision", "r1", "p" * 300, [1], 1, 0, 0, 0.0]),  # pod name too long
        raw(["decision", "r1", "pod-0", [1], 1, 0, 0]),  # field missing
        raw(["decision", "bad id!", "pod-0", [1], 1, 0, 0, 0.0]),  # replica id charset
        raw(["hello", "r1", "1", 16]),  # version as text
        raw(["completion", "t" * 500, 200, None]),  # token too long
        raw(["completion", "t", 7000, None]),  # status out of range
    ],
)
def test_a_malformed_message_is_a_protocol_error(payload):
    with pytest.raises(ProtocolError):
        decode(payload)


async def feed(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_read_frame_refuses_a_length_above_the_bound_without_reading_it():
    reader = await feed(HEADER.pack(1000) + b"x" * 10)
    with pytest.raises(ProtocolError, match="outside"):
        await read_frame(reader, max_bytes=999)
    # Nothing of the announced body was consumed or buffered for it.
    assert await reader.read() == b"x" * 10


async def test_read_frame_refuses_an_empty_frame_and_reports_a_truncated_one():
    with pytest.raises(ProtocolError):
        await read_frame(await feed(HEADER.pack(0)), max_bytes=100)
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(await feed(HEADER.pack(50) + b"short"), max_bytes=100)


async def test_read_frame_returns_consecutive_frames():
    frames = encode(Hello("a", 1, 16)) + encode(decision())
    reader = await feed(frames)
    assert decode(await read_frame(reader, 4096)) == Hello("a", 1, 16)
    assert decode(await read_frame(reader, 4096)) == decision()


class HelloV1(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """Hello as replicas before shared-secret authentication declare it."""

    replica: str
    version: int
    block_size: int


def test_replicas_of_the_previous_version_read_the_extended_hello_and_it_theirs():
    """No version bump (protocol.py): the authentication fields trail the Hello, so an
    older replica reads it as before, and its Hello reads as one without a secret."""
    old_reader = msgspec.msgpack.Decoder(HelloV1 | Decision | Completion)
    extended = Hello("abc", 1, 16, nonce=b"n" * NONCE_BYTES, proofs=(b"p" * PROOF_BYTES,))
    assert old_reader.decode(body(encode(extended))) == HelloV1("abc", 1, 16)
    announcing = Hello("abc", 1, 16, idle_timeout_s=30.0)  # the idle timeout trails too
    assert old_reader.decode(body(encode(announcing))) == HelloV1("abc", 1, 16)
    assert old_reader.decode(body(encode(Hello("abc", 1, 16)))) == HelloV1("abc", 1, 16)
    old = msgspec.msgpack.encode(HelloV1("abc", 1, 16))
    assert decode(old) == Hello("abc", 1, 16, nonce=None, proofs=())
    assert decode(old).idle_timeout_s == 0.0  # an older listener: no pings for it


@pytest.mark.parametrize(
    "message",
    [
        Hello("abc", 1, 16, nonce=b"n" * (NONCE_BYTES - 1)),
        Hello("abc", 1, 16, nonce=b"n" * (NONCE_BYTES + 1)),
        Hello("abc", 1, 16, nonce=b"n" * NONCE_BYTES, proofs=(b"p" * (PROOF_BYTES - 1),)),
        Hello("abc", 1, 16, nonce=b"n" * NONCE_BYTES, proofs=(b"p" * PROOF_BYTES,) * 3),
        Auth(b"p" * (PROOF_BYTES + 1)),
        Auth(b""),
        Hello("abc", 1, 16, idle_timeout_s=-1.0),
        Hello("abc", 1, 16, idle_timeout_s=float("nan")),
        Hello("abc", 1, 16, idle_timeout_s=1e9),
    ],
    ids=[
        "short-nonce",
        "long-nonce",
        "short-proof",
        "three-proofs",
        "long-auth",
        "empty-auth",
        "negative-idle",
        "nan-idle",
        "huge-idle",
    ],
)
def test_nonces_and_proofs_have_their_exact_sizes(message):
    with pytest.raises(ProtocolError):
        decode(body(encode(message)))
