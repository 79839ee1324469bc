"""The replicas' peers protocol (epp.replicas.protocol, then epp.replicas.inbox), fuzzed.

Contract (protocol.py's docstring): any frame a receiver reads is bounded and validated
before use: a length prefix of 0 or over the limit, bytes that are not msgpack, or a
message outside the types is a `ProtocolError` and nothing else; a decoded message holds
values within the types' bounds (replica ids of 1-64 safe characters, names of 1-253,
counts in [0, 2^31], hashes unsigned 64-bit, nonces of 16 bytes, proofs of 32, an idle
timeout in [0, 3600] s, a status in [0, 999]). The inbox then drops, never applies, a
decision no real request could make (inbox.py), and never raises on one.
"""

from __future__ import annotations

import asyncio
import math
import re

import msgspec
from fuzz.budget import examples
from helpers import router_with
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.observability.replica_metrics import ReplicaMetrics
from epp.replicas.inbox import INVALID_REASONS, PeerInbox
from epp.replicas.protocol import (
    HEADER,
    MAX_IDLE_TIMEOUT_S,
    MAX_PROOFS,
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
    read_frame,
)

REPLICA_ID = re.compile(r"[0-9A-Za-z_.-]{1,64}")
COUNT_MAX = 2**31


def check(message) -> None:
    """The bounds protocol.py promises of every decoded message."""
    if isinstance(message, Hello | Decision):
        assert REPLICA_ID.fullmatch(message.replica)
    if isinstance(message, Hello):
        assert 0 <= message.block_size <= COUNT_MAX
        assert message.nonce is None or len(message.nonce) == NONCE_BYTES
        assert len(message.proofs) <= MAX_PROOFS
        assert all(len(p) == PROOF_BYTES for p in message.proofs)
        assert 0.0 <= message.idle_timeout_s <= MAX_IDLE_TIMEOUT_S
    elif isinstance(message, Auth):
        assert len(message.proof) == PROOF_BYTES
    elif isinstance(message, Decision):
        assert 1 <= len(message.pod) <= 253
        assert all(type(h) is int and 0 <= h < 2**64 for h in message.hashes)
        for count in (message.prompt_tokens, message.matched, message.uncached):
            assert type(count) is int and 0 <= count <= COUNT_MAX
        assert isinstance(message.at, float)
    elif isinstance(message, Completion):
        assert 1 <= len(message.token) <= 128
        assert message.status is None or 0 <= message.status <= 999
        assert message.served is None or len(message.served) <= 256
    else:
        assert isinstance(message, Ping)


def decoded(body: bytes):
    try:
        message = decode(body)
    except ProtocolError:
        return None
    check(message)
    return message


@settings(max_examples=examples(200))
@given(body=st.binary(max_size=300))
def test_arbitrary_bytes_decode_within_bounds_or_raise_protocol_error(body):
    decoded(body)


SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=70)
    | st.binary(max_size=40)
)
ANY = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=5), max_leaves=12)
TAGS = st.sampled_from(["hello", "auth", "decision", "completion", "ping"]) | SCALAR
# Values near every bound the types set.
EDGES = st.sampled_from(
    [
        *(0, -1, 1, 2**31, 2**31 + 1, 2**32, 2**63, 2**64 - 1, 999, 1000),
        *(3600.0, 3600.5, -0.0, float("nan"), float("inf")),
        *("a" * 64, "a" * 65, "a" * 253, "a" * 254, "", "a b"),
        *(b"\x00" * 15, b"\x00" * 16, b"\x00" * 32, b"\x00" * 33, [b"\x00" * 32] * 3),
    ]
)


@settings(max_examples=examples(400))
@given(tag=TAGS, fields=st.lists(EDGES | ANY, max_size=9))
def test_messages_of_any_shape_decode_within_bounds_or_raise_protocol_error(tag, fields):
    decoded(msgspec.msgpack.encode([tag, *fields]))


INTS = st.integers(0, 2**64 - 1) | EDGES  # garbage (negatives, ...) comes from _mostly
# Each message's fields in order, each a plausible value near its bounds.
FIELDS = {
    "hello": [
        st.from_regex(REPLICA_ID, fullmatch=True),
        INTS,
        INTS,
        st.none() | st.binary(min_size=14, max_size=18),
        st.lists(st.binary(min_size=30, max_size=34), max_size=3),
        st.floats() | INTS,
    ],
    "auth": [st.binary(min_size=30, max_size=34)],
    "decision": [
        st.from_regex(REPLICA_ID, fullmatch=True) | st.text(max_size=70),
        st.text(min_size=1, max_size=260),
        st.lists(st.integers(0, 2**64 - 1), max_size=5),
        INTS,
        INTS,
        INTS,
        st.floats() | INTS,
    ],
    "completion": [
        st.text(max_size=130),
        st.none() | INTS,
        st.none() | st.text(max_size=260),
    ],
}


def _mostly(draw, valid, garbage):
    return draw(valid) if draw(st.integers(0, 9)) else draw(garbage)


@st.composite
def near_messages(draw):
    tag = draw(st.sampled_from(sorted(FIELDS)))
    values = [_mostly(draw, field, EDGES | ANY) for field in FIELDS[tag]]
    return [tag, *values[: _mostly(draw, st.just(len(values)), st.integers(0, len(values) + 2))]]


@settings(max_examples=examples(400))
@given(message=near_messages())
def test_messages_near_their_bounds_decode_within_bounds_or_raise_protocol_error(message):
    decoded(msgspec.msgpack.encode(message))


VALID = st.one_of(
    st.builds(
        Hello,
        replica=st.from_regex(REPLICA_ID, fullmatch=True),
        version=st.integers(0, 10),
        block_size=st.integers(0, COUNT_MAX),
        nonce=st.none() | st.binary(min_size=NONCE_BYTES, max_size=NONCE_BYTES),
        proofs=st.lists(
            st.binary(min_size=PROOF_BYTES, max_size=PROOF_BYTES), max_size=MAX_PROOFS
        ).map(tuple),
        idle_timeout_s=st.floats(0, MAX_IDLE_TIMEOUT_S),
    ),
    st.builds(Auth, proof=st.binary(min_size=PROOF_BYTES, max_size=PROOF_BYTES)),
    st.builds(
        Decision,
        replica=st.from_regex(REPLICA_ID, fullmatch=True),
        pod=st.text(min_size=1, max_size=253),
        hashes=st.lists(st.integers(0, 2**64 - 1), max_size=20),
        prompt_tokens=st.integers(0, COUNT_MAX),
        matched=st.integers(0, COUNT_MAX),
        uncached=st.integers(0, COUNT_MAX),
        at=st.floats(allow_nan=False),
    ),
    st.builds(
        Completion,
        token=st.text(min_size=1, max_size=128),
        status=st.none() | st.integers(0, 999),
        served=st.none() | st.text(max_size=256),
    ),
    st.just(Ping()),
)


@settings(max_examples=examples(150))
@given(message=VALID)
def test_valid_messages_round_trip(message):
    frame = encode(message)
    (length,) = HEADER.unpack(frame[: HEADER.size])
    assert length == len(frame) - HEADER.size
    assert decoded(frame[HEADER.size :]) == message


@settings(max_examples=examples(150))
@given(stream=st.binary(max_size=200), max_bytes=st.integers(1, 64), cut=st.integers(0, 8))
def test_frames_read_from_any_byte_stream_are_within_the_limit(stream, max_bytes, cut):
    async def read_all() -> list[bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(stream)
        reader.feed_eof()
        frames = []
        while True:
            try:
                frames.append(await read_frame(reader, max_bytes))
            except (asyncio.IncompleteReadError, ProtocolError):
                return frames

    frames = asyncio.run(read_all())
    assert all(1 <= len(f) <= max_bytes for f in frames)
    assert sum(HEADER.size + len(f) for f in frames) <= len(stream)


# -- the inbox: what a decoded decision may change --------------------------------------------

PODS = [{"name": "a", "address": "127.0.0.1:8001", "model": "m"}]
MAX_PROMPT_TOKENS = 1 << 20


def inbox() -> PeerInbox:
    router, store, index, metrics = router_with(PODS)
    return PeerInbox(
        "me", store, index, router.scheduler, router, ReplicaMetrics(metrics.registry),
        block_size=16, max_blocks=64, max_age_s=1.0, max_prompt_tokens=MAX_PROMPT_TOKENS,
    )  # fmt: skip


INBOX = inbox()


@settings(max_examples=examples(200))
@given(
    pod=st.sampled_from(["a", "b"]),
    hashes=st.lists(st.integers(0, 2**64 - 1), max_size=70),
    prompt_tokens=st.integers(0, COUNT_MAX)
    | st.sampled_from([MAX_PROMPT_TOKENS, MAX_PROMPT_TOKENS + 1]),
    matched=st.integers(0, 80) | st.integers(0, COUNT_MAX),
    uncached=st.integers(0, COUNT_MAX),
    at=st.floats(),
)
def test_the_inbox_drops_what_no_request_could_carry_and_never_raises(
    pod, hashes, prompt_tokens, matched, uncached, at
):
    message = Decision("peer", pod, hashes, prompt_tokens, matched, uncached, at)
    outcome = INBOX.decision(message)
    impossible = (
        prompt_tokens > MAX_PROMPT_TOKENS
        or uncached > prompt_tokens
        or matched > len(hashes)
        or not math.isfinite(at)
    )
    assert (outcome == "invalid") == impossible, (outcome, message)
    assert INBOX.invalid(message) in (*INVALID_REASONS, None)
