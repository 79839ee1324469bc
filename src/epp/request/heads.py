"""The head of a long JSON list of turns: what routing reads of a conversation.

Bounded work: routing uses at most `max_tokens` pseudo-tokens of a prompt, so a list of
turns keeps the first turns whose JSON holds twice their bytes (escapes make JSON longer
than its text). A list much longer than that is cut from a window of its first bytes; its
tail is measured, never split into elements, and counted as estimated pseudo-tokens.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate

import msgspec

from epp.request.body import is_null
from epp.request.parts import BASE64_RUN, STAND_IN_BYTES, sizes
from epp.request.types import bad
from epp.tokenization.estimate import BYTES_PER_PSEUDO_TOKEN

# A list longer than _WINDOWED x its head budget is cut from a window (_windowed_head) of
# at most _MAX_WINDOW budgets, trying at most _CUT_TRIES `},` candidates and checking at
# most _BRACE_CHECKS braces per window.
_WINDOWED = 4
_MAX_WINDOW = 8
_CUT_TRIES = 16
_BRACE_CHECKS = 4096
# A turn's JSON ({"role": "", "content": ""}, ~24 bytes) is ~12 bytes longer than its
# rendering (<||>\n<|end|>\n, 13): subtracted per omitted turn.
_JSON_TURN_EXTRA = 12
_MESSAGE_RAWS = msgspec.json.Decoder(list[msgspec.Raw])


def head_of_list(
    raw: msgspec.Raw, max_tokens: int, param: str, what: str
) -> tuple[bytes | msgspec.Raw, int]:
    """The list's head as a JSON list (the list itself when it is all head) and the
    estimated pseudo-tokens of the rest. Refuses a missing, empty or non-list `param`."""
    if is_null(raw):
        raise bad(f"{what} needs a non-empty '{param}' list", param)
    budget = 2 * BYTES_PER_PSEUDO_TOKEN * max_tokens
    if len(raw) <= budget and _opens_a_non_empty_list(raw):
        # All head: a turn's size (`sizes`) is at most its JSON's bytes (media parts count
        # as their shorter stand-ins), so turns in at most `budget` bytes all fit. Nothing
        # to split or measure (the common case, ~10 us of a 20 KB chat saved).
        return raw, 0
    found = _windowed_head(raw, budget) if len(raw) > _WINDOWED * budget else None
    tail: tuple[int, int] = (0, 0)
    if found is not None:
        raws, rest = found
        tail = _tail_bytes(memoryview(raw)[rest:-1], raws)
    else:
        try:
            raws = _MESSAGE_RAWS.decode(raw)
        except msgspec.ValidationError:
            raise bad(f"{what} needs a non-empty '{param}' list", param) from None
    if not raws:
        raise bad(f"{what} needs a non-empty '{param}' list", param)
    ends = list(accumulate(sizes(raws)))
    keep = min(len(raws), bisect_left(ends, budget) + 1)
    if found is None and keep == len(raws):
        return raw, 0
    head = b"[" + b",".join(raws[:keep]) + b"]"
    return head, _omitted(ends, keep, tail)


def _opens_a_non_empty_list(raw: msgspec.Raw) -> bool:
    """The value (valid JSON: the body decoded) is a list whose first element starts
    within its first 64 bytes; False when unsure (the full path then decides)."""
    opening = bytes(memoryview(raw)[:64])
    return opening[:1] == b"[" and opening[1:].lstrip(b" \t\r\n")[:1] not in (b"]", b"")


def _windowed_head(raw: msgspec.Raw, budget: int) -> tuple[list[msgspec.Raw], int] | None:
    """The leading elements of a long JSON list, decoded from a window of it, and where
    the rest starts; None when no cut is found cheaply (the whole list is split then).

    A cut is a `},` past the window whose prefix, closed with `]`, decodes as a list: a
    `},` inside a string or a nested value leaves a string or container open and fails
    to decode, so the first that decodes ends a top-level element. The window doubles
    until its turns cover `budget` bytes, up to _MAX_WINDOW budgets (one huge turn or
    image leaves no cut there: the list is short, split whole)."""
    view = memoryview(raw)
    window = budget
    while 2 * window < len(view) and window <= _MAX_WINDOW * budget:
        for close, rest in _element_ends(view, window, 2 * window):
            try:
                raws = _MESSAGE_RAWS.decode(bytes(view[: close + 1]) + b"]")
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            if sum(sizes(raws)) >= budget:
                return raws, rest
            break  # media made the window's turns short of the budget: widen it
        window *= 2
    return None


def _element_ends(view: memoryview, start: int, end: int) -> Iterator[tuple[int, int]]:
    """In view[start:end], up to _CUT_TRIES `}` followed (after whitespace) by `,`: the
    brace's offset and the offset past the comma. Searched with bytes.find (memchr): a
    base64 image holds no brace and is passed over at memory speed."""
    chunk = bytes(view[start:end])
    found = checked = 0
    at = chunk.find(b"}")
    while at >= 0 and found < _CUT_TRIES and checked < _BRACE_CHECKS:
        checked += 1
        after = chunk[at + 1 : at + 17]
        stripped = after.lstrip()
        if stripped[:1] == b",":
            found += 1
            yield start + at, start + at + 2 + len(after) - len(stripped)
        at = chunk.find(b"}", at + 1)


def _tail_bytes(tail: memoryview, head: list[msgspec.Raw]) -> tuple[int, int]:
    """(text bytes, turns) of the list's tail, no element of which is decoded: its size
    with each base64 media run counted as its stand-in, and as many turns as those bytes
    make at the head's mean turn size (an image's bytes hold no turns)."""
    media = sum(len(run.group()) - STAND_IN_BYTES for run in BASE64_RUN.finditer(tail))
    text = len(tail) - media  # each run leaves its stand-in's bytes: never negative
    mean = max(1, sum(map(len, head)) // len(head))
    return text, max(1, text // mean)


def _omitted(ends: list[int], keep: int, tail: tuple[int, int]) -> int:
    """Pseudo-tokens of the turns past `keep` (cumulative JSON sizes `ends`) and the
    measured tail, less each omitted turn's JSON overhead, rounded up."""
    tail_bytes, tail_turns = tail
    turns = len(ends) - keep + tail_turns
    omitted_bytes = max(0, ends[-1] - ends[keep - 1] + tail_bytes - _JSON_TURN_EXTRA * turns)
    return -(-omitted_bytes // BYTES_PER_PSEUDO_TOKEN)
