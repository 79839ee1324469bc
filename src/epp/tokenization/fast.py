"""A faster exact encoder for byte-level BPE tokenizers (Llama 3, Qwen 2, GPT-2 style).

HF `tokenizers` spends most of an encode in its pre-tokenizer (a regex split with offset
bookkeeping): about 1-2 us per token, so a cold 4,096-token prompt costs several
milliseconds. For the common shape of tokenizer this module produces the same ids with
less work, in three steps that are each exact:

1. The text between special tokens is split into pieces by the tokenizer's own
   pre-tokenizer pattern, translated to Python's `re` (`\\p{L}` -> `[^\\W\\d_]`, `\\p{N}`
   -> `\\d`, `[^...\\p{L}\\p{N}]` -> `(?:[^...\\w]|_)`; on ASCII text `A-Za-z` and
   `0-9`); patterns it cannot translate leave the tokenizer on the HF path.
2. Each piece's ids come from a dictionary (natural text repeats its pieces), filled on a
   miss by the tokenizer's own BPE model on the piece's byte-level form: the BPE works
   piece by piece, so this is what the full encode computes.
3. The translation is exact only where Python's character classes agree with the
   tokenizer's Unicode ones: a segment holding a character where they may not (numbers
   that are not decimal digits such as "½", unassigned or newer code points, the
   separators U+001C-U+001F that Python counts as spaces, the long s (U+017F) under
   `(?i)`, astral characters other than emoji) is encoded by HF instead (`safe`).

When the pattern is GPT-2's, Llama 3's or Qwen 2's, steps 1 and 2 run compiled
(`_kernels.c`: the split written out for those patterns with `re`'s own character classes,
and a cache keyed by the piece's UTF-8 bytes, so no str is made per piece); the Python code
here stays the reference, and the compiled split is checked against `re` at load.

Only tokenizers with no normalizer or NFC alone (applied per segment, as HF does), a
ByteLevel pre-tokenizer without prefix space (with its own regex or after one Split), a
plain BPE model and added tokens that split cleanly qualify, and each one must pass a self-test at load (a corpus with ASCII, Latin, CJK,
emoji and digits, encoded both ways) or it is not used.
"""

from __future__ import annotations

import json
import math
import random
import re
import unicodedata
from array import array
from collections.abc import Mapping
from functools import cache, partial
from typing import Any

import tokenizers

from epp.kernels import TOKENIZATION as COMPILED

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
PIECE_CACHE_LIMIT = 200_000  # distinct pieces remembered before the cache starts over
MAX_KEPT_PIECE = 256  # characters: longer pieces rarely repeat, and are not remembered
SELF_TEST = [
    "Hello world! The router's cache, 12345 tokens; don't re-encode 3.14159.",
    "  leading spaces\n\n\ttabs\r\nand CRLF   trailing   ",
    "café naïve über Ωmega ß résumé \u2014 \u201cquotes\u201d \u2018single\u2019 \u2026 ¿qué? ¡sí!",
    "中文 日本語のテキスト 한국어 текст на русском עברית العربية",
    "emoji 😀🚀👍🏽 and symbols ©®™ €£¥ ±\u00d7÷ →←",
    "snake_case __dunder__ camelCase HTTP2 x86_64 a1b2c3 ____ 1_000_000",
    "'S 'T 'RE 'VE 'M 'LL 'D 's't're've'm'll'd",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n<tool_call>',
    "    def f(x):\n        return x ** 2  # comment\n\n\n",
    "decomposed e\u0301 and composed \u00e9, A\u030a \u212b \ufb01 \u1e9b\u0323",
]


@cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's bytes-to-unicode table: the character each byte becomes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return tuple(chr(table[b]) for b in range(256))


@cache
def _risky_ranges() -> tuple[tuple[int, int], ...]:
    """Characters where Python's `re` classes may disagree with the tokenizer's, as sorted
    code point ranges (both ends in)."""
    ranges: list[tuple[int, int]] = [(0x1C, 0x1F), (0x17F, 0x17F)]
    start = None
    for cp in range(0x80, 0x10000):
        category = unicodedata.category(chr(cp))
        bad = category in ("No", "Nl", "Cn", "Cs")
        if bad and start is None:
            start = cp
        elif not bad and start is not None:
            ranges.append((start, cp - 1))
            start = None
    if start is not None:
        ranges.append((start, 0xFFFF))
    ranges += [(0x10000, 0x1EFFF), (0x1FB00, 0x10FFFF)]  # astral, but for emoji
    return tuple(sorted(ranges))


@cache
def _risky() -> re.Pattern[str]:
    """The risky characters as a class (`safe`'s twin of the compiled `none_in`)."""
    body = "".join(
        f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in _risky_ranges()
    )
    return re.compile(f"[{body}]")


@cache
def _risky_bitmap() -> bytes:
    """The risky characters as one bit per code point (bit c % 8 of byte c // 8), for
    the compiled `none_in`."""
    bits = bytearray(0x110000 // 8)
    for low, high in _risky_ranges():
        while low <= high and low % 8:  # the first byte's bits
            bits[low >> 3] |= 1 << (low & 7)
            low += 1
        while high >= low and (high + 1) % 8:  # the last byte's bits
            bits[high >> 3] |= 1 << (high & 7)
            high -= 1
        if low <= high:  # whole bytes between
            bits[low >> 3 : (high >> 3) + 1] = b"\xff" * ((high >> 3) - (low >> 3) + 1)
    return bytes(bits)


def translate_pattern(pattern: str, *, ascii_only: bool = False) -> str | None:
    """A Unicode-property regex (Rust/Oniguruma syntax) in Python's `re`, valid on text
    without risky characters (`ascii_only`: on ASCII text, with plain ASCII classes,
    which match faster); None for what this does not know."""
    letters, numbers = ("A-Za-z", "0-9") if ascii_only else (None, None)
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith(r"\p{L}", i):
            out.append(f"[{letters}]" if letters else r"[^\W\d_]")
            i += 5
        elif pattern.startswith(r"\p{N}", i):
            out.append(f"[{numbers}]" if numbers else r"\d")
            i += 5
        elif pattern.startswith(r"\p", i) or pattern.startswith(r"\P", i):
            return None
        elif pattern[i] == "\\":
            out.append(pattern[i : i + 2])
            i += 2
        elif pattern[i] == "[":
            end = i + 1
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            if end >= len(pattern):
                return None
            body = pattern[i + 1 : end]
            i = end + 1
            if r"\p" not in body and r"\P" not in body:
                out.append(f"[{body}]")
                continue
            rest = body.replace(r"\p{L}", "").replace(r"\p{N}", "")
            if r"\p" in rest or r"\P" in rest:
                return None
            if letters and numbers:
                with_ascii = body.replace(r"\p{L}", letters).replace(r"\p{N}", numbers)
                out.append(f"[{with_ascii}]")
                continue
            # Only [^ ... \p{L}\p{N}]: neither a letter nor a number (nor the rest).
            if not body.startswith("^") or r"\p{L}" not in body or r"\p{N}" not in body:
                return None
            out.append(f"(?:[^{rest[1:]}\\w]|_)")
        else:
            out.append(pattern[i])
            i += 1
    translated = "".join(out)
    try:
        re.compile(translated)
    except re.error:
        return None
    return translated


def _bpe_ids(tokenize: Any, piece: str) -> bytes:
    """A piece's ids from the BPE model, on its byte-level form (the bytes of a uint32
    array: joining them is a memcpy)."""
    chars = _byte_chars()
    mapped = "".join([chars[b] for b in piece.encode("utf-8")])
    return array("I", [token.id for token in tokenize(mapped)]).tobytes()


def _compiled_families(kernels: Any) -> dict[str, tuple[int, int]]:
    """The patterns the compiled split writes out, by their translation (what it is
    compared with): (family, most digits in a number piece)."""
    known = [
        (GPT2_PATTERN, kernels.GPT2, 1),  # digits unbounded: the family ignores it
        (LLAMA3_PATTERN, kernels.LLAMA3, 3),
        (QWEN2_PATTERN, kernels.LLAMA3, 1),
    ]
    return {translate_pattern(p) or p: (f, d) for p, f, d in known}


def _split_check_corpus() -> list[str]:
    """Text on which the compiled split must equal `re`'s before it is used: the
    self-test's samples and seeded random strings of the characters where the pattern's
    alternatives meet (quotes and contractions, runs of spaces and line breaks, digits,
    punctuation, controls), ASCII alone and with letters, digits, spaces and marks of
    other scripts, in 1-, 2- and 4-byte strings."""
    rng = random.Random(1729)
    ascii_alphabet = [
        *"aZq09'sStTrReEvVmMlLdD !?.,_-\t\n\r\x0b\x0c\x1c\x7f\x00\"",
        *["  ", "\r\n", "'ll", "'RE", "'ve", " 's", "1234", "word"],
    ]
    # Latin-1, BMP and astral: letters, decimal digits of other scripts, spaces, marks.
    other_scripts = [*"éßÀÿΩж中文ح٣१\u00a0\u3000\u2028\u0301\u2014\u2019😀", " é", " 中"]
    random_text = [
        "".join(rng.choices(alphabet, k=rng.randint(1, 40)))
        for alphabet in (ascii_alphabet, ascii_alphabet + other_scripts)
        for _ in range(300)
    ]
    return [*SELF_TEST, *random_text]


def _compiled_cache(model: Any, pattern: str) -> Any | None:
    """The compiled split and piece cache for this (translated) pattern, or None (no
    kernel, a pattern it does not write out, or a split that differs from `re`'s
    anywhere)."""
    if COMPILED is None:
        return None
    family = _compiled_families(COMPILED).get(pattern)
    if family is None:
        return None
    kernel = COMPILED.PieceCache(
        *family, partial(_bpe_ids, model.tokenize), PIECE_CACHE_LIMIT, MAX_KEPT_PIECE
    )
    reference = re.compile(pattern)
    for text in _split_check_corpus():
        if kernel.split(text, 0, len(text)) != reference.findall(text):
            return None
    return kernel


class _PieceIds(dict[str, bytes]):
    """piece -> its ids (as the bytes of a uint32 array: joining them is a memcpy),
    filled on a miss by the BPE model (bounded: starts over when full; pieces longer than
    MAX_KEPT_PIECE characters are not kept, they rarely repeat)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self._tokenize = model.tokenize

    def __missing__(self, piece: str) -> bytes:
        ids = _bpe_ids(self._tokenize, piece)
        if len(piece) <= MAX_KEPT_PIECE:
            if len(self) >= PIECE_CACHE_LIMIT:
                self.clear()
            self[piece] = ids
        return ids


class FastByteLevelBpe:
    """Pieces by a Python regex, ids by a cache over the tokenizer's BPE model."""

    def __init__(self, model: Any, pattern: str, ascii_pattern: str, *, nfc: bool = False) -> None:
        self._nfc = nfc  # the tokenizer's normalizer is NFC (per segment, as HF applies it)
        self._pattern = re.compile(pattern)
        # On ASCII text, ASCII classes are the Unicode ones (U+001C-U+001F aside, which
        # `safe` sends to HF), and match faster.
        self._ascii_pattern = re.compile(ascii_pattern, re.ASCII)
        self._pieces = _PieceIds(model)
        # The split and the piece cache, compiled (their twin: the patterns and _pieces).
        self._compiled = _compiled_cache(model, pattern)
        self._risky = _risky()
        self._risky_bits = _risky_bitmap() if COMPILED is not None else b""
        self.chars_per_id = 4.0  # learnt from the windows read

    @classmethod
    def build(
        cls, tokenizer: tokenizers.Tokenizer, anchors: Mapping[str, int]
    ) -> FastByteLevelBpe | None:
        """The fast path for this tokenizer, or None when it does not qualify."""
        try:
            spec = json.loads(tokenizer.to_str())
        except ValueError:
            return None
        pattern = _qualifying_pattern(spec, anchors)
        if pattern is None:
            return None
        translated = translate_pattern(pattern)
        ascii_translated = translate_pattern(pattern, ascii_only=True)
        if translated is None or ascii_translated is None:
            return None
        nfc = spec.get("normalizer") is not None
        fast = cls(tokenizer.model, translated, ascii_translated, nfc=nfc)
        if not fast._passes_self_test(tokenizer):
            return None
        fast._pieces.clear()
        if fast._compiled is not None:
            fast._compiled.clear()
        return fast

    def _passes_self_test(self, tokenizer: tokenizers.Tokenizer) -> bool:
        """Whether, on every SELF_TEST sample this path takes, the pieces cover the text
        end to end and the ids are the tokenizer's own."""
        for sample in SELF_TEST:
            if not self.safe(sample):
                continue  # the HF path takes it anyway
            for compiled in (self._pattern, self._ascii_pattern):
                covers = "".join(compiled.findall(sample)) == sample
                if (sample.isascii() or compiled is self._pattern) and not covers:
                    return False  # pieces must cover the text end to end
            ids = array("I")
            try:
                self.encode_into(ids, sample, None)
            except HandOver:
                continue  # HF takes such text anyway
            if list(ids) != tokenizer.encode(sample, add_special_tokens=False).ids:
                return False
        return True

    def safe(self, segment: str) -> bool:
        """Whether the Python pattern splits this text as the tokenizer does."""
        if segment.isascii():
            return not any(c in segment for c in "\x1c\x1d\x1e\x1f")
        if COMPILED is not None:
            result: bool = COMPILED.none_in(segment, self._risky_bits)
            return result
        return self._risky.search(segment) is None

    def takes_whole(self, text: str) -> bool:
        """Whether every segment of `text` is `safe` without asking: ASCII without the
        control characters the tokenizer splits otherwise (so `encode_range_into` may
        encode its segments in place)."""
        return text.isascii() and not any(c in text for c in "\x1c\x1d\x1e\x1f")

    def encode_range_into(
        self, ids: array, text: str, pos: int, end: int, need: int | None
    ) -> int | None:
        """`encode_into(ids, text[pos:end], need)` for a text `takes_whole` accepted: the
        compiled cache reads the range in place when one span takes it (no slice, which
        at 20 KB of prompt costs as much as the encode of a short turn)."""
        compiled = self._compiled
        if compiled is not None:
            if need is None:
                ids.frombytes(compiled.encode(text, pos, end, 0)[0])
                return None
            if end - pos <= max(4096, math.ceil((need - len(ids)) * self.chars_per_id * 1.1)):
                # `_encode_windows`' first window holds the whole range: one span.
                ids.frombytes(compiled.encode(text, pos, end, 0)[0])
                return None if len(ids) < need else end - pos
        return self.encode_into(ids, text[pos:end], need)

    def encode_into(self, ids: array, segment: str, need: int | None) -> int | None:
        """Append the ids of a safe segment (no special tokens in it). With `need`, stop
        once `ids` holds that many and return the characters consumed (a piece end, so
        the ids so far are exact); None when the whole segment was encoded.

        Bounded work with `need`: the segment is read in windows of 8 characters per id
        still needed; a window's last two pieces are left for the next window (the
        pattern's greedy runs and lookahead may end them differently in the whole text),
        and the next window starts at a piece end, where the pattern restarts as it does
        in the whole text. A window holding a single piece (a "word" longer than the
        window), or text that the tokenizer's NFC normalizer would change, raises
        HandOver: the caller encodes the rest otherwise."""
        if segment.isascii():
            pattern = self._ascii_pattern  # ASCII text is its own NFC form
        else:
            pattern = self._pattern
            if self._nfc and not unicodedata.is_normalized("NFC", segment):
                raise HandOver(0)  # NFC would move characters: HF takes it from here
        # The compiled split follows the Unicode pattern; on ASCII text it equals the
        # ASCII one where `safe` lets text through (U+001C-U+001F aside).
        compiled = self._compiled
        if need is None:
            ids.frombytes(self._encode_span(segment, 0, len(segment), 0, pattern, compiled)[0])
            return None
        return self._encode_windows(ids, segment, need, pattern, compiled)

    def _encode_span(
        self,
        segment: str,
        pos: int,
        end: int,
        keep_back: int,
        pattern: re.Pattern[str],
        compiled: Any | None,
    ) -> tuple[bytes, int, int]:
        """The ids of the pieces of segment[pos:end] (`end` taken as the text's end) but
        the last `keep_back`, how many pieces there were, and where the last encoded one
        ends: by the compiled cache, or by its twin here."""
        if compiled is not None:
            result: tuple[bytes, int, int] = compiled.encode(segment, pos, end, keep_back)
            return result
        pieces = pattern.findall(segment, pos, end)
        count = len(pieces)
        kept = max(count - keep_back, 0)
        # The pieces cover the span end to end (checked at load): the kept ones end where
        # the kept-back ones begin.
        consumed = end - sum(map(len, pieces[kept:]))
        del pieces[kept:]
        return b"".join(map(self._pieces.__getitem__, pieces)), count, consumed

    def _encode_windows(
        self, ids: array, segment: str, need: int, pattern: re.Pattern[str], compiled: Any | None
    ) -> int | None:
        """`encode_into` with `need`: window by window (its docstring)."""
        pos = 0
        while True:
            # About the characters the ids still needed take, and a tenth more.
            window = max(4096, math.ceil((need - len(ids)) * self.chars_per_id * 1.1))
            if len(segment) - pos <= window:
                data = self._encode_span(segment, pos, len(segment), 0, pattern, compiled)[0]
                ids.frombytes(data)
                return None if len(ids) < need else len(segment)
            data, count, consumed_to = self._encode_span(
                segment, pos, pos + window, 2, pattern, compiled
            )
            if count < 3:
                raise HandOver(pos)
            before = len(ids)
            ids.frombytes(data)
            if len(ids) > before:
                consumed = consumed_to - pos
                self.chars_per_id = 0.5 * self.chars_per_id + 0.5 * consumed / (len(ids) - before)
            pos = consumed_to
            if len(ids) >= need:
                return pos


class HandOver(Exception):  # a signal, not an error
    """The fast path stops at `consumed` characters of the segment (a piece end)."""

    def __init__(self, consumed: int) -> None:
        super().__init__(consumed)
        self.consumed = consumed


def _qualifying_pattern(spec: dict[str, Any], anchors: Mapping[str, int]) -> str | None:
    """The pre-tokenizer's split pattern of a tokenizer the fast path can reproduce (its
    normalizer none or NFC, its added tokens all anchors, a plain BPE model, a ByteLevel
    pre-tokenizer); None for any other."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer != {"type": "NFC"}:
        return None  # NFC alone (Qwen 2) is reproduced; anything else is not
    added = spec.get("added_tokens") or []
    if any(token.get("content") not in anchors for token in added):
        return None  # an added token with strip or word rules
    model = spec.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("dropout") not in (None, 0.0)
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
        or model.get("byte_fallback")
    ):
        return None
    return _byte_level_pattern(spec.get("pre_tokenizer"))


def _byte_level_pattern(spec: Any) -> str | None:
    """The split pattern of a ByteLevel pre-tokenizer without prefix space: its own
    (GPT-2's), or the one Split before it."""
    if not isinstance(spec, dict):
        return None
    if spec.get("type") == "ByteLevel":
        if spec.get("add_prefix_space") or not spec.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if spec.get("type") != "Sequence":
        return None
    parts = spec.get("pretokenizers") or []
    if len(parts) != 2:
        return None
    split, level = parts
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or not isinstance(split.get("pattern"), dict)
        or "Regex" not in split["pattern"]
        or level.get("type") != "ByteLevel"
        or level.get("add_prefix_space")
        or level.get("use_regex", True)
    ):
        return None
    pattern = split["pattern"]["Regex"]
    return pattern if isinstance(pattern, str) else None
