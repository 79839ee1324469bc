"""The kinds of field a KV event carries: for each, its type when hashes may be bytes and
how a value is read by hand (type-checked, hashes turned into unsigned 64-bit ints).

An event struct (events.py) annotates each field with its kind, so that the typed
decoders and the by-hand reader get every field's rule from that one declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MASK64 = (1 << 64) - 1


class Invalid(Exception):
    """One event breaks the rules (the message says which)."""


@dataclass(frozen=True, slots=True)
class Kind:
    """How one field is read. `read(name, value)` checks a value decoded without a type
    and returns what the event holds, or raises Invalid. Where the publisher may send
    hashes as bytes, the typed decoders declare the field as `with_bytes` and turn the
    value into the event's with `from_bytes`; for the other kinds both are None."""

    read: Callable[[str, object], Any]
    with_bytes: Any = None
    from_bytes: Callable[[Any], Any] | None = None


def hash_value(value: object) -> int:
    """A block hash as an unsigned 64-bit int: an int's low 64 bits (a signed int64
    publisher sends the same bits), or bytes' last 8 bytes, big-endian (vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends a digest)."""
    if isinstance(value, bytes):
        if not value:
            raise Invalid("an empty bytes hash")
        return int.from_bytes(value[-8:], "big")
    if type(value) is int:
        return value & MASK64
    raise Invalid(f"a block hash must be an int or bytes, not {type(value).__name__}")


def _hashes(values: list[int | bytes]) -> list[int]:
    return [hash_value(value) for value in values]


def _read_hashes(name: str, value: object) -> list[int]:
    if not isinstance(value, list):
        raise Invalid(f"{name} must be a list")
    return _hashes(value)


def _hash_or_none(value: int | bytes | None) -> int | None:
    return None if value is None else hash_value(value)


def _read_hash_or_none(name: str, value: object) -> int | None:
    return None if value is None else hash_value(value)


def _read_ints(name: str, value: object) -> list[int]:
    # `type(...) is int`: a bool is no token id (the typed decoders refuse it too).
    if not isinstance(value, list) or not all(type(item) is int for item in value):
        raise Invalid(f"{name} must be a list of ints")
    return value


def _read_int(name: str, value: object) -> int:
    if type(value) is not int:
        raise Invalid(f"{name} must be an int")
    return value


def _read_int_or_none(name: str, value: object) -> int | None:
    if value is not None and type(value) is not int:
        raise Invalid(f"{name} must be an int or null")
    return value


def _read_str_or_none(name: str, value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise Invalid(f"expected a string, got {type(value).__name__}")


def _read_name_or_none(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Invalid(f"{name} must be a string or null")
    return value


def _read_list_or_none(name: str, value: object) -> list[Any] | None:
    if value is not None and not isinstance(value, list):
        raise Invalid(f"{name} must be a list or null")
    return value


HASHES = Kind(_read_hashes, list[int | bytes], _hashes)
HASH_OR_NONE = Kind(_read_hash_or_none, int | bytes | None, _hash_or_none)
INTS = Kind(_read_ints)
INT = Kind(_read_int)
INT_OR_NONE = Kind(_read_int_or_none)
STR_OR_NONE = Kind(_read_str_or_none)
# The same type as STR_OR_NONE; its message names the field ("lora_name must be ...").
NAME_OR_NONE = Kind(_read_name_or_none)
LIST_OR_NONE = Kind(_read_list_or_none)
