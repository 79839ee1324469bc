"""A /v1/completions `prompt`: a string, a batch of strings, token ids, or a batch of
token-id lists. A batch is one request to one pod: its first prompt leads.

Bounded memory: at most `max_tokens` ids are kept, the rest counted. A flat id list far
longer than that is decoded only up to a cut past its head; its tail is checked to hold
numbers only (the engine validates their values) and counted by its commas.
"""

from __future__ import annotations

import re
from array import array
from typing import Annotated

import msgspec

from epp.request.body import is_null
from epp.request.types import Prompt, bad

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]

IDS_MESSAGE = "'prompt' token ids must be integers in [0, 2^32)"
_PROMPT_TEXT = msgspec.json.Decoder(str)
_PROMPT_TEXTS = msgspec.json.Decoder(list[str])
_PROMPT_IDS = msgspec.json.Decoder(list[TokenId])
_PROMPT_ID_LISTS = msgspec.json.Decoder(list[list[TokenId]])
_NOT_JSON_SPACE = re.compile(rb"[^ \t\r\n]")
# The first window holds 12 bytes per id: room for the longest id ("4294967295,") and a
# space; a window short of `max_tokens` ids (pretty-printed JSON) doubles.
_WINDOW_BYTES_PER_ID = 12
_MIN_WINDOW = 64


def completion_prompt(raw: msgspec.Raw, max_tokens: int) -> Prompt:
    if is_null(raw):
        raise bad("a completion request needs 'prompt'", "prompt")
    opening = bytes(memoryview(raw)[:1])  # a Raw spans its value exactly: no whitespace
    if opening == b'"':
        return Prompt(text=_PROMPT_TEXT.decode(raw))
    if opening == b"[":
        # The first element says which form the list is: strings, ids, or lists of ids.
        first = _first_element_byte(raw)
        try:
            if first == b'"':
                return Prompt(text=_PROMPT_TEXTS.decode(raw)[0])
            if first == b"[":
                return _capped_ids(_PROMPT_ID_LISTS.decode(raw)[0], max_tokens)
            if first.isdigit() or first == b"-":
                return _token_ids_head(raw, max_tokens)
        except msgspec.ValidationError as exc:
            if first != b'"':
                raise bad(f"{IDS_MESSAGE}: {exc}", "prompt") from None
    raise bad("'prompt' must be a string, a list of strings, or token ids", "prompt")


def _first_element_byte(raw: msgspec.Raw) -> bytes:
    """The first byte after the list's `[` that is not JSON whitespace (`]` for an empty
    list). JSON allows any amount of whitespace there: no fixed window."""
    found = _NOT_JSON_SPACE.search(raw, 1)
    return b"" if found is None else found.group()


def _capped_ids(ids: list[int], max_ids: int) -> Prompt:
    """At most `max_ids` ids are kept (memory bounded by the cap); the rest are counted."""
    return Prompt(token_ids=array("I", ids[:max_ids]), omitted_tokens=max(0, len(ids) - max_ids))


def _token_ids_head(raw: msgspec.Raw, max_ids: int) -> Prompt:
    """A flat list of token ids: its first `max_ids` ids decoded (and validated), the rest
    counted. The decoded list is cut at a comma of a window that doubles until it holds
    more than `max_ids` ids (or the whole list)."""
    view = memoryview(raw)
    size = max(_MIN_WINDOW, max_ids * _WINDOW_BYTES_PER_ID)
    while True:
        chunk = bytes(view[:size])
        cut = chunk.rfind(b",") if size < len(view) else -1
        if cut < 0:  # the whole list is in the window: no head to cut
            return _capped_ids(_PROMPT_IDS.decode(raw), max_ids)
        ids = _PROMPT_IDS.decode(chunk[:cut] + b"]")
        if len(ids) > max_ids:
            break
        size *= 2
    # The head ends at the comma after id number `len(ids)`; the tail follows it.
    tail = bytes(view[cut + 1 :])
    if any(tail.find(c) >= 0 for c in (b'"', b"[", b"{")):
        raise bad(IDS_MESSAGE, "prompt")
    count = len(ids) + tail.count(b",") + 1
    return Prompt(token_ids=array("I", ids[:max_ids]), omitted_tokens=count - max_ids)
