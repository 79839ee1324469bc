"""Content parts and their sizes, without decoding what routing does not need.

A part larger than BIG_PART that is media (a base64 image, say) is never turned into a
Python string: it stands in by the hash of its JSON as sent (HashedMedia), and counts as
its stand-in's bytes, not its own, wherever a turn's size estimates pseudo-tokens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from itertools import compress
from typing import Any

import msgspec
import xxhash

from epp.conversation import MEDIA_MODALITY, HashedMedia
from epp.request.body import ANY

BIG_PART = 16 * 1024
STAND_IN_BYTES = 24  # "<image:" + 16 hex digits + ">"
# Media kinds of both APIs (Anthropic's image blocks are "image").
_MEDIA_TYPES = frozenset(MEDIA_MODALITY) | {"image", "audio", "video", "document"}
# A base64 run as long as a big part: in a tail never decoded, it counts as a stand-in.
BASE64_RUN = re.compile(rb";base64,[A-Za-z0-9+/=]{%d,}" % BIG_PART)
# A part's type read from its first bytes when it leads the object (as every SDK writes
# it): no scan of a multi-megabyte part. The body was validated as JSON already.
_LEADING_TYPE = re.compile(rb'\{\s*"type"\s*:\s*"([A-Za-z_]{1,32})"')


class _PartType(msgspec.Struct, gc=False):
    """A content part's type: every other field is checked as JSON and skipped. A type that
    is not a string names no media kind (the part is then decoded in full)."""

    type: str | None = None


class _TurnParts(msgspec.Struct, gc=False):
    """A turn whose content is a list of parts (a string content fails at its first byte)."""

    content: list[msgspec.Raw] | None = None


_PART_TYPE = msgspec.json.Decoder(_PartType)
_TURN_PARTS = msgspec.json.Decoder(_TurnParts)


def turn_parts(turn: msgspec.Raw) -> list[msgspec.Raw] | None:
    """A turn's content parts, undecoded; None when its content is a string or absent, or
    the turn is not an object (it is then decoded whole, and refused there if bad)."""
    try:
        return _TURN_PARTS.decode(turn).content
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def content_parts(raws: list[msgspec.Raw], media: Mapping[str, str] = MEDIA_MODALITY) -> list[Any]:
    """A turn's content parts: decoded, except large media parts (their types -> modality
    in `media`), which become their stand-in's hash without a string made of them."""
    parts: list[Any] = []
    for part in raws:
        if len(part) > BIG_PART:
            kind = _part_type(part)
            modality = None if kind is None else media.get(kind)
            if modality is not None:
                parts.append(HashedMedia(modality, xxhash.xxh64_hexdigest(part)))
                continue
        parts.append(ANY.decode(part))
    return parts


def _part_type(part: msgspec.Raw) -> str | None:
    leading = _LEADING_TYPE.match(bytes(memoryview(part)[:128]))
    if leading is not None:
        return leading.group(1).decode()
    try:
        return _PART_TYPE.decode(part).type
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None  # not an object or no string type: decoded in full, checked there


def sizes(raws: list[msgspec.Raw]) -> list[int]:
    """Each turn's JSON bytes, the media parts of large turns counted as their stand-ins."""
    out = list(map(len, raws))
    # Only large turns are looked into (in C up to here: many tiny turns stay cheap).
    for i in compress(range(len(out)), map(BIG_PART.__lt__, out)):
        out[i] = _turn_bytes(raws[i])
    return out


def _turn_bytes(turn: msgspec.Raw) -> int:
    size = len(turn)
    for part in turn_parts(turn) or ():
        if len(part) > BIG_PART and _part_type(part) in _MEDIA_TYPES:
            size -= len(part) - STAND_IN_BYTES
    return size
