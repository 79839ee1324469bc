"""The wire format between EPP replicas: length-prefixed msgpack frames.

A frame is a 4-byte big-endian length, then that many bytes of one msgpack message
(msgspec, a tagged union encoded as an array: the tag first, then the fields in order).
A connection carries frames one way, from the replica that made the decisions (the
sender, who dialled) to a peer (the receiver), after one exchange of `Hello` frames:

    sender   --Hello-->    receiver      who I am, protocol version, block size
    sender   <--Hello--    receiver      who I am (the sender learns a self-connection)
    sender   --Decision--> receiver      one per request routed by the sender
    sender   --Completion->receiver      a response end the sender learnt (access log, observer)
                                         for a decision the receiver made
    sender   --Ping-->     receiver      nothing else to send for a while (see below)

Idle connections: a receiver closes a connection that has sent no frame for its
`replicas.idle_timeout_s` (so connections that hold a slot and say nothing end), and
announces it in its Hello (`idle_timeout_s`, a trailing field like `nonce`). A sender that
has written nothing for a third of that writes a `Ping`, which changes nothing. Only a
receiver that announced a timeout gets pings: an older one knows no such message. An older
sender never pings, so a receiver of this version closes its idle connection and the
sender reconnects at once (rolling upgrades lose nothing but the reconnect).

With a shared secret (`replicas.secret_file`, auth.py) the handshake is a
challenge-response before any Decision: each Hello carries a fresh random `nonce`, the
receiver's Hello also its `proofs` (HMAC-SHA256 over both nonces, both replica ids and
the protocol version), and the sender answers with its own proof (`Auth`):

    sender   --Hello(nonce_s)-->                  receiver
    sender   <--Hello(nonce_r, proofs)--          receiver   the sender checks a proof
    sender   --Auth(proof)-->                     receiver   the receiver checks it
    sender   --Decision-->...                     receiver

Why an extension of Hello and no version bump: a version bump would make every replica
of this version refuse older ones as "incompatible" even with no secret set, breaking
rolling upgrades of deployments that never set one. `nonce` and `proofs` are optional
trailing fields of the array-encoded Hello, and msgspec ignores trailing elements a
struct does not declare, so an older replica reads a Hello from this version as before.
Older replicas never announce a nonce; a replica with a secret refuses one without
("unauthenticated"), whatever its version, and sends `Auth` only to a receiver that
announced a nonce (one that knows the message). A replica without a secret that gets a
Hello with a nonce refuses it too: the two must not exchange decisions.

Everything a receiver reads is bounded and validated before use: the length prefix
against `max_frame_bytes`, the message against these types (a block hash is an unsigned
64-bit integer, counts are non-negative, names are short, nonces and proofs have their
exact lengths). A frame that fails is a `ProtocolError`, and the receiver closes that
connection.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Annotated

import msgspec

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
# Default bound of one frame: a Decision carries at most prefix.max_blocks_per_request
# hashes (8,192 by default, about 74 KB in msgpack); see `frame_limit`.
MAX_FRAME_BYTES = 1024 * 1024

ReplicaId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z_.-]+$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
# msgpack integers stop at 2**64 - 1: non-negative is the whole check.
Hash64 = Annotated[int, msgspec.Meta(ge=0)]
NONCE_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Proof = Annotated[bytes, msgspec.Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
# A receiver proves with its current secret and, while a rotation settles, the previous.
MAX_PROOFS = 2
MAX_IDLE_TIMEOUT_S = 3600.0


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """The first frame each way on a connection."""

    replica: ReplicaId
    version: int
    # Replicas hash prompts in blocks of this many tokens; hashes of another size never
    # match, so a peer configured differently is refused rather than polluting the index.
    block_size: Count
    # Shared-secret authentication (auth.py): a fresh random nonce from a replica that has
    # a secret, None from one without (and from older versions, which lack the field).
    nonce: Nonce | None = None
    # Only in the receiver's Hello, and only when the sender sent a nonce: one proof per
    # secret the receiver accepts, over both Hellos' ids and nonces.
    proofs: Annotated[tuple[Proof, ...], msgspec.Meta(max_length=MAX_PROOFS)] = ()
    # Read from the receiver's Hello: it closes a connection silent for this long, so the
    # sender pings within it. 0: no idle timeout (older versions, which lack the field).
    idle_timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_IDLE_TIMEOUT_S)] = 0.0


class Auth(msgspec.Struct, tag="auth", array_like=True, frozen=True):
    """The sender's proof, right after the receiver's Hello when both have a secret."""

    proof: Proof


class Decision(msgspec.Struct, tag="decision", array_like=True, frozen=True, gc=False):
    """A request the sending replica routed to `pod`."""

    replica: ReplicaId
    pod: Name
    # The prompt's chained block hashes as the sender recorded them in its prefix index.
    hashes: list[Hash64]
    prompt_tokens: Count
    # Leading blocks of `hashes` the index said the pod held when the sender chose it.
    matched: Count
    # Prompt tokens the pod must compute (the sender's reservation).
    uncached: Count
    # The sender's wall clock (time.time()) at the dispatch.
    at: float
    # These types bound what a frame can hold; what a real request can carry (prompt
    # tokens within replicas.max_prompt_tokens, uncached <= prompt tokens, a finite time)
    # is checked by the receiver (inbox.py), which drops and counts the rest.


class Completion(msgspec.Struct, tag="completion", array_like=True, frozen=True):
    """A request the receiver routed ended, reported to the sender (access log or observer
    stream): the route token, the response status (None: no response), the upstream that
    served. Its first byte and size are not forwarded: the upstream series miss them."""

    token: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    status: Annotated[int, msgspec.Meta(ge=0, le=999)] | None
    served: Annotated[str, msgspec.Meta(max_length=256)] | None


class Ping(msgspec.Struct, tag="ping", array_like=True, frozen=True):
    """Nothing to send: the connection is alive (see "Idle connections")."""


Message = Hello | Auth | Decision | Completion | Ping


class ProtocolError(Exception):
    """A frame that is too large, not msgpack, or not one of the messages above."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """One frame: length prefix and message."""
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad message: {exc}") from None


def frame_limit(max_blocks_per_request: int) -> int:
    """The largest frame a receiver accepts: a Decision with every hash the configuration
    allows (9 bytes each in msgpack, plus names), and at least MAX_FRAME_BYTES."""
    return max(MAX_FRAME_BYTES, 9 * max_blocks_per_request + 4096)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """The next frame's message bytes. Raises asyncio.IncompleteReadError at end of
    stream, ProtocolError when the announced length is 0 or above `max_bytes` (nothing
    of such a frame is read or buffered)."""
    header = await reader.readexactly(HEADER.size)
    (length,) = HEADER.unpack(header)
    if length == 0 or length > max_bytes:
        raise ProtocolError(f"frame length {length} outside 1..{max_bytes}")
    return await reader.readexactly(length)
