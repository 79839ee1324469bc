"""The compiled ASCII split and piece cache (epp/tokenization/_kernels.c) against their
references: Python's `re` on the translated pattern for the split, the pure-Python twin
in fast.py for the ids, and HF `tokenizers` for both."""

from __future__ import annotations

import gc
import os
import random
import re
import subprocess
import sys
import sysconfig
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

import pytest
from tokenizer_fixtures import tokenizer_dir
from tokenizers import Tokenizer

from epp import kernels
from epp.tokenization import fast, load_tokenizer_dir
from epp.tokenization.fast import (
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    FastByteLevelBpe,
    translate_pattern,
)

KERNELS = kernels.TOKENIZATION
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the tokenization kernel is not built")

# Characters where the patterns' alternatives meet: contractions in both cases, quotes,
# runs of spaces, tabs and line breaks, digit runs, punctuation, controls.
ASCII = [
    *"aZq09'sStTrReEvVmMlLdD !?.,_-()\"\t\n\r\x0b\x0c\x1c\x1f\x7f\x00",
    *["  ", "   ", "\r\n", "\n\n", "'ll", "'LL", "'RE", "'ve", " 's", "12345", "word", " Word"],
]


# Letters, decimal digits, spaces and marks of other scripts, in 1-, 2- and 4-byte
# strings; SAFE_OTHER is what fast.py's `safe` lets through to the fast path, RISKY where
# Python's classes and the tokenizer's differ (the kernel follows `re` on those too).
SAFE_OTHER = [*"éßÀÿΩж中文ح٣१\u00a0\u3000\u0301\u2014\u2019😀👍🏽", " é", " 中", " ٣٣٣٣"]
RISKY = [*"½²Ⅻ\u017f\u180e\U0001d400\x85\u2028", "'\u017f", "'\u017fT"]


def ascii_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ASCII) for _ in range(n))


def mixed_text(rng: random.Random, n: int, alphabet: list[str] | None = None) -> str:
    """ASCII text with other scripts' characters in it (and, by default, risky ones)."""
    return "".join(rng.choice(alphabet or [*ASCII, *SAFE_OTHER, *RISKY]) for _ in range(n))


def families() -> list[tuple[str, int, int]]:
    assert KERNELS is not None
    return [
        (GPT2_PATTERN, KERNELS.GPT2, 1),
        (LLAMA3_PATTERN, KERNELS.LLAMA3, 3),
        (QWEN2_PATTERN, KERNELS.LLAMA3, 1),
    ]


def ids_of(piece: str) -> bytes:
    """A stand-in BPE: one id per character (its code), enough to check the joins."""
    return array("I", [ord(c) for c in piece]).tobytes()


@needs_kernels
@pytest.mark.parametrize("index", range(3), ids=["gpt2", "llama3", "qwen2"])
def test_the_split_equals_re_on_the_translated_pattern(index: int) -> None:
    pattern, family, digits = families()[index]
    reference = re.compile(translate_pattern(pattern) or "")
    cache = KERNELS.PieceCache(family, digits, ids_of, 1000, 256)
    rng = random.Random(index)
    for i in range(40_000):
        text = (ascii_text if i % 2 else mixed_text)(rng, rng.randint(0, 30))
        pos = rng.randint(0, len(text))
        end = rng.randint(pos, len(text))
        assert cache.split(text, pos, end) == reference.findall(text, pos, end), (
            text,
            pos,
            end,
        )


@needs_kernels
@pytest.mark.parametrize("index", range(3), ids=["gpt2", "llama3", "qwen2"])
def test_encode_joins_the_ids_of_all_but_the_kept_back_pieces(index: int) -> None:
    pattern, family, digits = families()[index]
    reference = re.compile(translate_pattern(pattern) or "")
    cache = KERNELS.PieceCache(family, digits, ids_of, 50, 256)  # small: starts over often
    rng = random.Random(10 + index)
    for i in range(6_000):
        text = (ascii_text if i % 2 else mixed_text)(rng, rng.randint(0, 60))
        pos = rng.randint(0, len(text))
        end = rng.randint(pos, len(text))
        # 7, 8, 9: the ring of piece starts on the stack (8), or allocated
        keep_back = rng.choice([0, 0, 1, 2, 3, 7, 8, 9, 10**9])
        pieces = reference.findall(text, pos, end)
        kept = pieces[: max(len(pieces) - keep_back, 0)]
        want = (b"".join(map(ids_of, kept)), len(pieces), pos + sum(map(len, kept)))
        assert cache.encode(text, pos, end, keep_back) == want, (text, pos, end, keep_back)
        assert len(cache) <= 50


@needs_kernels
@pytest.mark.parametrize("name", ["llama3", "tiny-llama"])
def test_the_compiled_path_gives_the_twins_ids_and_hfs(name: str) -> None:
    directory = tokenizer_dir(name)
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bpe = FastByteLevelBpe.build(hf, load_tokenizer_dir(directory)._anchors)
    assert bpe is not None and bpe._compiled is not None
    rng = random.Random(3)
    for i in range(400):
        if i % 2:
            text = ascii_text(rng, rng.randint(0, 200))
        else:
            text = mixed_text(rng, rng.randint(0, 200), [*ASCII, *SAFE_OTHER])
        if not bpe.safe(text):
            continue  # \x1c-\x1f: HF's path
        pattern = bpe._ascii_pattern if text.isascii() else bpe._pattern
        end = len(text)
        for keep_back in (0, 2):
            compiled = bpe._encode_span(text, 0, end, keep_back, pattern, bpe._compiled)
            twin = bpe._encode_span(text, 0, end, keep_back, pattern, None)
            assert compiled == twin, (text, keep_back)
        ids = array("I")
        bpe.encode_into(ids, text, None)
        assert list(ids) == hf.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("name", ["llama3", "tiny-llama"])
def test_text_heads_equal_hf_with_either_implementation(name: str, kernels_used: str) -> None:
    directory = tokenizer_dir(name)
    tok = load_tokenizer_dir(directory, cache_bytes=0)
    assert tok._fast is not None
    assert (tok._fast._compiled is not None) == (kernels_used == "compiled")
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rng = random.Random(5)
    chunks = [*ASCII, *SAFE_OTHER, "x" * 300, " " * 700, "\n" * 40, "1" * 50, "é" * 90]
    for _ in range(150):
        text = "".join(rng.choice(chunks) for _ in range(rng.randint(0, 400)))
        want = hf.encode(text, add_special_tokens=False).ids
        assert list(tok.encode_text_head(text, None).ids) == want
        cut = rng.randint(1, len(want) + 2)
        assert list(tok.encode_text_head(text, cut).ids) == want[:cut], (text, cut)


@needs_kernels
def test_a_split_that_differs_from_re_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split is checked against `re` at load: given the wrong family for a pattern
    (GPT-2's split for Llama 3's pattern), the kernel is left out and the ids are still
    HF's."""
    assert KERNELS is not None
    wrong = {translate_pattern(LLAMA3_PATTERN): (KERNELS.GPT2, 1)}
    monkeypatch.setattr(fast, "_compiled_families", lambda _kernels: wrong)
    tok = load_tokenizer_dir(tokenizer_dir("llama3"), cache_bytes=0)
    assert tok._fast is not None and tok._fast._compiled is None
    text = "Don't stop: 12345 words\n\n  and 'LL more"
    hf = Tokenizer.from_file(str(tokenizer_dir("llama3") / "tokenizer.json"))
    assert (
        list(tok.encode_text_head(text, None).ids) == hf.encode(text, add_special_tokens=False).ids
    )


@needs_kernels
def test_a_pattern_it_does_not_write_out_leaves_the_python_split() -> None:
    assert fast._compiled_cache(object(), r"\S+|\s+") is None


@needs_kernels
def test_long_pieces_are_not_kept_and_the_cache_is_bounded() -> None:
    calls: list[str] = []

    def missing(piece: str) -> bytes:
        calls.append(piece)
        return ids_of(piece)

    cache = KERNELS.PieceCache(KERNELS.GPT2, 1, missing, 3, 4)
    assert cache.encode("abcde abcde", 0, 11, 0)[0] == ids_of("abcde abcde")
    assert calls == ["abcde", " abcde"] and len(cache) == 0  # longer than max_key: not kept
    calls.clear()
    cache.encode("ab ab ab", 0, 8, 0)
    assert calls == ["ab", " ab"] and len(cache) == 2  # " ab" the second time: a hit
    cache.encode("a b c d", 0, 7, 0)
    assert len(cache) <= 3  # started over when full
    cache.clear()
    assert len(cache) == 0


@needs_kernels
def test_bad_input_is_refused_and_an_error_in_missing_leaves_the_cache_usable() -> None:
    cache = KERNELS.PieceCache(KERNELS.LLAMA3, 3, ids_of, 100, 256)
    for text, pos, end in [("café", -1, 2), ("abc", 2, 1), ("中文", 0, 3)]:
        with pytest.raises(ValueError):
            cache.encode(text, pos, end, 0)
    with pytest.raises(TypeError):
        cache.encode(b"abc", 0, 3, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cache.encode("abc", 0, 3, -1)
    with pytest.raises(ValueError):
        KERNELS.PieceCache(7, 3, ids_of, 100, 256)

    def failing(piece: str) -> Any:
        if piece == " boom":
            raise RuntimeError("model failed")
        return "not bytes" if piece == " text" else ids_of(piece)

    flaky = KERNELS.PieceCache(KERNELS.LLAMA3, 3, failing, 100, 256)
    with pytest.raises(RuntimeError):
        flaky.encode("a boom", 0, 6, 0)
    with pytest.raises(TypeError):
        flaky.encode("a text", 0, 6, 0)
    assert flaky.encode("a a", 0, 3, 0)[0] == ids_of("a a")


@needs_kernels
def test_the_cache_frees_what_it_holds() -> None:
    """Started over, cleared or dropped, the cache leaves no memory behind, and a cycle
    through `missing` is collected."""
    rng = random.Random(7)
    texts = [ascii_text(rng, 300) for _ in range(50)]
    tracemalloc.start()
    try:
        for _ in range(3):
            cache = KERNELS.PieceCache(KERNELS.LLAMA3, 3, ids_of, 200, 256)
            for text in texts:
                cache.encode(text, 0, len(text), 1)
                cache.split(text, 0, len(text))
            del cache
        gc.collect()
        baseline = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            cache = KERNELS.PieceCache(KERNELS.LLAMA3, 3, ids_of, 200, 256)
            for text in texts:
                cache.encode(text, 0, len(text), 2)
            cache.clear()
            del cache
        for _ in range(10):  # each holds a 24 KB table: a leaked cycle would show
            holder: dict[str, Any] = {}
            holder["cache"] = KERNELS.PieceCache(
                KERNELS.GPT2, 1, lambda p, h=holder: h and ids_of(p), 9, 9
            )
            del holder
        gc.collect()
        assert tracemalloc.get_traced_memory()[0] - baseline < 64 * 1024
    finally:
        tracemalloc.stop()


@needs_kernels
def test_a_piece_of_max_key_characters_is_kept_and_found() -> None:
    calls: list[str] = []

    def missing(piece: str) -> bytes:
        calls.append(piece)
        return ids_of(piece)

    cache = KERNELS.PieceCache(KERNELS.GPT2, 1, missing, 100, 4)
    cache.encode("abcd abc", 0, 8, 0)  # "abcd" is max_key long, " abc" too
    assert calls == ["abcd", " abc"] and len(cache) == 2
    assert cache.encode("abcd abc", 0, 8, 0)[0] == ids_of("abcd abc")
    assert calls == ["abcd", " abc"]  # both found: no second call


@needs_kernels
def test_pieces_are_found_after_the_table_grows() -> None:
    """A few thousand distinct pieces make the table grow (it starts at 1,024 slots, at
    most half full) several times: each is asked of `missing` once, kept once, and found
    afterwards wherever the growth put it."""
    calls: list[str] = []

    def missing(piece: str) -> bytes:
        calls.append(piece)
        return ids_of(piece)

    cache = KERNELS.PieceCache(KERNELS.LLAMA3, 3, missing, 100_000, 256)
    rng = random.Random(11)
    words = sorted({"".join(rng.choices("abcdefghij", k=rng.randint(1, 6))) for _ in range(6000)})
    text = " ".join(words)
    first = cache.encode(text, 0, len(text), 0)
    assert len(calls) == len(set(calls)) == len(cache) == len(words)
    calls.clear()
    assert cache.encode(text, 0, len(text), 0) == first
    assert calls == []


@needs_kernels
def test_a_piece_kept_while_missing_ran_is_kept_once() -> None:
    """`missing` may encode on the same cache (Python code runs there): the piece it
    keeps meanwhile is not kept a second time (a second copy would count twice and leak)."""
    cache: Any = None
    nested = [True]

    def missing(piece: str) -> bytes:
        if nested.pop() if nested else False:
            cache.encode(piece, 0, len(piece), 0)  # misses too, and keeps the piece
        return ids_of(piece)

    cache = KERNELS.PieceCache(KERNELS.GPT2, 1, missing, 100, 256)
    assert cache.encode("hello", 0, 5, 0)[0] == ids_of("hello")
    assert not nested and len(cache) == 1
    assert cache.encode("hello hello", 0, 11, 0)[0] == ids_of("hello hello")
    assert len(cache) == 2


def fnv1a(data: bytes) -> int:
    """The kernel's piece hash (FNV-1a, 64 bits), to build pieces that share a slot."""
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def pieces_sharing_a_slot(count: int, bits: int) -> list[str]:
    """GPT-2 pieces " " + 5 letters whose hashes agree in their low `bits` bits: the
    last letter b solves ((state ^ b) * P) = target (mod 2^bits), P odd."""
    prime, mask = 0x100000001B3, (1 << bits) - 1
    target = 12345 & mask
    wanted = target * pow(prime, -1, 1 << bits) & mask
    found = []
    for n in range(26**4):
        stem = " " + "".join(chr(97 + n // 26**k % 26) for k in range(4))
        last = (fnv1a(stem.encode()) ^ wanted) & mask
        if 97 <= last <= 122:
            found.append(stem + chr(last))
            if len(found) == count:
                return found
    raise AssertionError("not enough pieces")


@needs_kernels
def test_pieces_that_share_a_slot_cost_a_bounded_probe() -> None:
    """Prompt text chooses the pieces and FNV-1a is not keyed: a prompt made of pieces
    that share a home slot must not make every lookup scan all of them (the twin's dict
    hashes with Python's randomized hash). A piece is kept only within 64 slots of its
    home, so a lookup reads at most 64; the others are asked of `missing` each time, as
    new text is; the ids stay right."""
    pieces = pieces_sharing_a_slot(300, 10)  # 1,024 slots: the table at its start
    assert len({fnv1a(p.encode()) & 1023 for p in pieces}) == 1
    calls: list[str] = []

    def missing(piece: str) -> bytes:
        calls.append(piece)
        return ids_of(piece)

    cache = KERNELS.PieceCache(KERNELS.GPT2, 1, missing, 100_000, 256)
    text = "".join(pieces)
    want = ids_of(text)
    assert cache.encode(text, 0, len(text), 0) == (want, 300, len(text))
    assert len(cache) <= 64
    calls.clear()
    assert cache.encode(text, 0, len(text), 0) == (want, 300, len(text))
    assert len(calls) == 300 - len(cache)  # the kept ones found, the others asked again


@needs_kernels
def test_pieces_with_one_hash_keep_their_own_ids() -> None:
    """Two pieces of one length and one 64-bit hash (found by Pollard's rho on FNV-1a):
    the table compares the bytes, not just the hash, so each keeps its own ids."""
    first, second = "rrblyzkkfbiahh", "fflavphaiuqvtb"
    assert fnv1a(first.encode()) == fnv1a(second.encode())
    calls: list[str] = []

    def missing(piece: str) -> bytes:
        calls.append(piece)
        return ids_of(piece)

    cache = KERNELS.PieceCache(KERNELS.GPT2, 1, missing, 100, 256)
    for _ in range(2):
        assert cache.encode(first, 0, 14, 0)[0] == ids_of(first)
        assert cache.encode(second, 0, 14, 0)[0] == ids_of(second)
    assert calls == [first, second] and len(cache) == 2


# Hostile use of the kernel: each probe runs in its own process (a crash is a signal
# there, not the end of the test run) and prints what it saw.
HOSTILE = {
    "encode before __init__": """
c = k.PieceCache.__new__(k.PieceCache)
print(c.split("a b", 0, 3))
try:
    c.encode("a b", 0, 3, 0)
except TypeError as exc:
    print("refused:", exc)
""",
    "encode after clear() before __init__": """
c = k.PieceCache.__new__(k.PieceCache)
c.clear()
try:
    c.encode("a b", 0, 3, 0)
except TypeError as exc:
    print("refused:", exc)
""",
    "missing clears, re-inits and encodes on its own cache": """
import random
n = [0]
def m(p):
    n[0] += 1
    if n[0] % 3 == 0: c.clear()
    if n[0] % 5 == 0: c.encode("x y z " * 50 + p, 0, 300, 1)
    if n[0] % 7 == 0: c.__init__(n[0] % 2, 1 + n[0] % 3, m, 5, 3)
    return ids(p)
c = k.PieceCache(1, 3, m, 50, 256)
r = random.Random(1)
for _ in range(2000):
    t = "".join(r.choice("ab 1'\\n.") for _ in range(50))
    c.encode(t, 0, len(t), r.choice([0, 1, 2, 5, 100]))
""",
    "missing drops its own last reference while it runs": """
import functools
class Once:
    def __call__(self, p):
        c.__init__(0, 1, ids, 10, 10)  # the cache held the only reference to self
        self.__dict__.clear()
        return ids(p)
c = k.PieceCache(0, 1, ids, 10, 10)
c.__init__(0, 1, Once(), 10, 10)
assert c.encode("hello world", 0, 11, 0)[0] == ids("hello world")
c.__init__(0, 1, functools.partial(lambda _, p: (c.__init__(0, 1, ids, 10, 10), ids(p))[1], 0), 10, 10)
assert c.encode("hello world", 0, 11, 0)[0] == ids("hello world")
""",
    "edges: empty text, pos = end = len, keep_back past every bound": """
c = k.PieceCache(1, 3, ids, 10, 10)
assert c.encode("", 0, 0, 0) == (b"", 0, 0) and c.split("", 0, 0) == []
assert c.encode("abc", 3, 3, 2**63 - 1) == (b"", 0, 3)
assert c.encode("a b c", 0, 5, 2**63 - 1) == (b"", 3, 0)
assert c.encode("a b c", 1, 5, 1) == (ids(" b"), 2, 3)
for args in [("abc", 0, 2**63 - 1, 0), ("abc", 2**63 - 1, 2**63 - 1, 0), ("abc", 0, 3, -(2**63))]:
    try:
        c.encode(*args)
    except ValueError:
        pass
    else:
        raise AssertionError(args)
for args in [(None, 0, 0, 0), ("a", 0, 1), ("a", 0, 2**64, 0), ("a", 0.0, 1, 0)]:
    try:
        c.encode(*args)
    except (TypeError, OverflowError):
        pass
    else:
        raise AssertionError(args)
""",
    "missing returns a bytes subclass, empty bytes, odd lengths": """
class B(bytes): pass
c = k.PieceCache(0, 1, lambda p: B(p.encode()), 10, 10)
assert c.encode("a b", 0, 3, 0)[0] == b"a b"
c = k.PieceCache(0, 1, lambda p: b"", 10, 10)
assert c.encode("a b", 0, 3, 0) == (b"", 2, 3) and c.encode("a b", 0, 3, 0) == (b"", 2, 3)
class S(str): pass
c = k.PieceCache(1, 3, ids, 10, 10)
assert c.encode(S("a b"), 0, 3, 0)[0] == ids("a b")
""",
}

HOSTILE_PRELUDE = """
from array import array
from epp.tokenization import _kernels as k
def ids(p):
    return array("I", map(ord, p)).tobytes()
{body}
print("alive")
"""


@needs_kernels
@pytest.mark.parametrize("probe", sorted(HOSTILE))
def test_hostile_use_is_refused_or_survived(probe: str, tmp_path: Any) -> None:
    script = tmp_path / "probe.py"
    script.write_text(HOSTILE_PRELUDE.format(body=HOSTILE[probe].strip()))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{probe}: exit {done.returncode}\n{done.stderr[-2000:]}"
    assert done.stdout.strip().endswith("alive")
    if "before __init__" in probe:
        assert "refused: " in done.stdout, done.stdout


ASAN_SCRIPT = """
import importlib.util, random, re, sys
from array import array
spec = importlib.util.spec_from_file_location("_kernels", sys.argv[1])
k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)
from epp.tokenization.fast import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, translate_pattern
from test_kernels import ascii_text, ids_of, mixed_text, pieces_sharing_a_slot
rng = random.Random(2)
for pattern, family, digits in [(GPT2_PATTERN, 0, 1), (LLAMA3_PATTERN, 1, 3), (QWEN2_PATTERN, 1, 1)]:
    reference = re.compile(translate_pattern(pattern))
    cache = k.PieceCache(family, digits, ids_of, 40, 8)
    for i in range(1500):
        text = (ascii_text if i % 2 else mixed_text)(rng, rng.randint(0, 40))
        pos = rng.randint(0, len(text))
        end = rng.randint(pos, len(text))
        pieces = reference.findall(text, pos, end)
        assert cache.split(text, pos, end) == pieces
        keep_back = rng.choice([0, 1, 2, 6, 7, 8, 9, 10, 10**9])
        kept = pieces[: max(len(pieces) - keep_back, 0)]
        want = (b"".join(map(ids_of, kept)), len(pieces), pos + sum(map(len, kept)))
        assert cache.encode(text, pos, end, keep_back) == want
grown = k.PieceCache(0, 1, ids_of, 100_000, 256)
words = " ".join(str(i) + "x" for i in range(5000)) + "".join(pieces_sharing_a_slot(200, 10))
for _ in range(2):
    assert grown.encode(words, 0, len(words), 0)[0] == ids_of(words)
print("clean")
"""


@needs_kernels
def test_the_kernel_is_clean_under_addresssanitizer(tmp_path: Any) -> None:
    """Memory errors a plain build can absorb (a one-slot overrun of the stack ring of
    piece starts, a read past the text or a buffer) abort an AddressSanitizer build: the
    kernel is compiled with -fsanitize=address and run in a subprocess on the random
    splits and encodes of ASCII and other scripts' text (UTF-8 keys written to the
    scratch buffer; keep_back around the stack ring's 8 slots), the table's growth and
    pieces that share a slot."""
    source = Path(fast.__file__).with_name("_kernels.c")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    libasan = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not Path(libasan).is_absolute():
        pytest.skip(f"{compiler} has no libasan: the kernel's ASan run did not happen")
    library = tmp_path / f"_kernels{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    flags = ["-shared", "-fPIC", "-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    subprocess.run([compiler, *flags, f"-I{include}", str(source), "-o", str(library)], check=True)
    env = {
        **os.environ,
        "LD_PRELOAD": libasan,
        "ASAN_OPTIONS": "detect_leaks=0",  # the interpreter's own, at exit
        "PYTHONMALLOC": "malloc",  # PyMem_* through malloc, which ASan watches
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
    }
    done = subprocess.run(
        [sys.executable, "-c", ASAN_SCRIPT, str(library)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-3000:]


@needs_kernels
def test_a_piece_is_keyed_by_its_utf8_bytes_whatever_the_strings_storage() -> None:
    """The same piece in 1-, 2- and 4-byte strings is one entry (its UTF-8 bytes), asked
    of `missing` once, as a str; ASCII and non-ASCII pieces with the same characters
    never share one."""
    calls: list[str] = []

    def missing(piece: str) -> bytes:
        calls.append(piece)
        return ids_of(piece)

    cache = KERNELS.PieceCache(KERNELS.LLAMA3, 3, missing, 100, 256)
    texts = ["plain café", "plain café \u2014", "plain café 😀", "plain cafe"]
    for text in texts:
        assert cache.encode(text, 0, len(text), 0)[0] == ids_of(text)
    assert calls == ["plain", " café", " \u2014", " 😀", " cafe"]
    assert len(cache) == 5


@needs_kernels
def test_none_in_answers_as_the_risky_class_does() -> None:
    """`safe` on text that is not ASCII: the compiled bitmap lookup against the twin's
    regex class, at both ends of every risky range (and one past), in 1-, 2- and 4-byte
    strings; the bitmap itself agrees with the class on every code point."""
    bitmap = fast._risky_bitmap()
    risky = fast._risky()
    edges = sorted(
        {c for low, high in fast._risky_ranges() for c in (low - 1, low, high, high + 1)}
        & set(range(0x110000))
    )
    rng = random.Random(9)
    for base in ("plain ascii", "café", "中文 text", "😀 emoji"):
        for edge in edges:
            text = base + chr(edge) + rng.choice(["", " tail", "é"])
            assert KERNELS.none_in(text, bitmap) == (risky.search(text) is None), hex(edge)
    assert KERNELS.none_in("", bitmap)
    with pytest.raises(ValueError):
        KERNELS.none_in("text", bitmap[:-1])


def test_safe_is_the_same_with_either_implementation(kernels_used: str) -> None:
    tok = load_tokenizer_dir(tokenizer_dir("llama3"))
    assert tok._fast is not None
    rng = random.Random(12)
    for _ in range(2_000):
        text = mixed_text(rng, rng.randint(0, 20))
        assert tok._fast.safe(text) == (
            not any(c in text for c in "\x1c\x1d\x1e\x1f")
            if text.isascii()
            else fast._risky().search(text) is None
        ), text
