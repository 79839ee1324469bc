"""The wire format between EPP replicas: length-prefixed msgpack frames.

A frame is a 4-byte big-endian length, then that many bytes of one msgpack message
(msgspec, a tagged union encoded as an array: the tag first, then the fields in order).
A connection carries frames one way, from the replica that made the decisions (the
sender, who dialled) to a peer (the receiver), after one exchange of `Hello` frames:

    sender   --Hello-->    receiver      who I am, protocol version, block size
    sender   <--Hello--    receiver      who I am (the sender learns a self-connection)
    sender   --Decision--> receiver      one per request routed by the sender
    sender   --Completion->receiver      a response end the sender's observer stream saw
                                         for a decision the receiver made

Everything a receiver reads is bounded and validated before use: the length prefix
against `max_frame_bytes`, the message against these types (a block hash is an unsigned
64-bit integer, counts are non-negative, names are short). A frame that fails is a
`ProtocolError`, and the receiver closes that connection.
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


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """The first frame each way on a connection."""

    replica: ReplicaId
    version: int
    # Replicas hash prompts in blocks of this many tokens; hashes of another size never
    # match, so a peer configured differently is refused rather than polluting the index.
    block_size: Count


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


class Completion(msgspec.Struct, tag="completion", array_like=True, frozen=True):
    """The observer stream for a request the receiver routed ended on the sender: the
    route token, the response status (None: no response), the upstream that served."""

    token: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    status: Annotated[int, msgspec.Meta(ge=0, le=999)] | None
    served: Annotated[str, msgspec.Meta(max_length=256)] | None


Message = Hello | Decision | Completion


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
