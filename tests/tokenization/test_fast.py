"""The fast byte-level BPE path gives exactly HF's ids, or is not used."""

from __future__ import annotations

import json
import random
from array import array

import pytest
from tokenizer_fixtures import tokenizer_dir
from tokenizers import Tokenizer

from epp.tokenization import load_tokenizer_dir
from epp.tokenization.fast import GPT2_PATTERN, FastByteLevelBpe, translate_pattern

ALPHABET = [
    *"abcdefghijklmnopqrstuvwxyzABCXYZ0123456789_'\".,;:!?()[]{}<>|/\\-+=*&^%$#@~`",
    *[" ", "  ", "\n", "\n\n", "\t", "\r\n", "   "],
    *["é", "ß", "Ω", "中", "文", "😀", "👍🏽", "\u2014", "\u2019", "\u00a0", "\u3000", "\u0301"],
    *["½", "²", "Ⅻ", "\x1c", "\x1f", "\u017f", "\u180e", "\u200b", "\U0001d400", "\ufffd", "\x85"],
    *["'s", "'S", "'ll", "don't", "<|", "|>", "<|eot_id|>", "<|start_header_id|>"],
]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.mark.parametrize("name", ["llama3", "tiny-llama"])
def test_fast_path_equals_hf_on_random_text(name: str) -> None:
    directory = tokenizer_dir(name)
    fast = load_tokenizer_dir(directory, cache_bytes=0)
    assert fast._fast is not None
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rng = random.Random(11)
    for _ in range(400):
        text = random_text(rng, rng.randint(0, 300))
        want = hf.encode(text, add_special_tokens=False).ids
        assert list(fast.encode_text_head(text, None).ids) == want, text
        cut = rng.randint(1, len(want) + 2)
        head = fast.encode_text_head(text, cut)
        assert list(head.ids) == want[:cut], (text, cut)
        if head.exact:
            assert head.total_tokens == len(want)


def test_fast_path_on_a_whole_rendered_chat_with_cache_boundaries() -> None:
    fast = load_tokenizer_dir(tokenizer_dir("llama3"))
    slow = load_tokenizer_dir(tokenizer_dir("llama3"), cache_bytes=0, fast_path=False)
    rng = random.Random(2)
    from epp.tokenization.protocol import ChatMessage

    for _ in range(60):
        messages = [ChatMessage("system", random_text(rng, 200))]
        for i in range(rng.randint(1, 6)):
            messages.append(
                ChatMessage("user" if i % 2 == 0 else "assistant", random_text(rng, 80))
            )
            assert list(fast.encode_chat(messages)) == list(slow.encode_chat(messages))


@pytest.mark.parametrize("name", ["llama3", "tiny-llama"])
def test_ascii_text_encoded_in_place_equals_hf(name: str, kernels_used: str) -> None:
    """ASCII prompts (most of them) skip the per-segment slice and check: each segment
    between special tokens is read in place, whole or up to a head's cut."""
    directory = tokenizer_dir(name)
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ascii_only = [piece for piece in ALPHABET if piece.isascii() and piece not in "\x1c\x1f"]
    rng = random.Random(12)
    taken = 0
    tok = load_tokenizer_dir(directory, cache_bytes=0)
    # Where a head stops and what it estimates come from segment by segment, sliced.
    sliced = load_tokenizer_dir(directory, cache_bytes=0)
    assert tok._fast is not None and sliced._fast is not None
    sliced._fast.takes_whole = lambda _text: False  # type: ignore[method-assign]
    for _ in range(150):
        text = "".join(rng.choice(ascii_only) for _ in range(rng.randint(1, 600)))
        taken += tok._fast.takes_whole(text)
        want = hf.encode(text, add_special_tokens=False).ids
        assert list(tok.encode_text_head(text, None).ids) == want, text
        for cut in (1, len(want) // 2 + 1, len(want)):
            head = tok.encode_text_head(text, cut)
            assert list(head.ids) == want[:cut], (text, cut)
            other = sliced.encode_text_head(text, cut)
            assert (head.total_tokens, head.exact) == (other.total_tokens, other.exact)
            assert tok._fast_from(text, 0, cut).end == sliced._fast_from(text, 0, cut).end
    assert taken == 150
    fast = load_tokenizer_dir(directory)._fast
    assert fast is not None
    assert not fast.takes_whole("ascii \x1e text") and not fast.takes_whole("café")


def test_risky_characters_go_to_hf() -> None:
    fast = load_tokenizer_dir(tokenizer_dir("llama3"))._fast
    assert fast is not None
    assert fast.safe("plain ascii, 123") and fast.safe("café 中文 😀")
    for risky in ("½", "Ⅻ", "\x1c", "\u017f", "\U0001d400", "\U000e0001"):
        assert not fast.safe(f"text {risky} text"), repr(risky)


@pytest.mark.parametrize(
    ("pattern", "ok"),
    [
        (GPT2_PATTERN, True),
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}", True),
        (r"[\p{Lu}\p{Lt}]+", False),  # properties it does not translate
        (r"[\p{L}]+", False),
        (r"\P{L}", False),
    ],
)
def test_pattern_translation_knows_its_limits(pattern: str, ok: bool) -> None:
    assert (translate_pattern(pattern) is not None) == ok


def test_a_tokenizer_the_fast_path_gets_wrong_is_left_to_hf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A translation that splits differently fails the self-test at load.
    monkeypatch.setattr("epp.tokenization.fast.translate_pattern", lambda _, **__: r"\S+|\s+")
    assert load_tokenizer_dir(tokenizer_dir("llama3"))._fast is None
    # Metaspace (sentencepiece-style) tokenizers never qualify.
    assert load_tokenizer_dir(tokenizer_dir("chatml"))._fast is None


def test_piece_cache_is_bounded(monkeypatch: pytest.MonkeyPatch, kernels_used: str) -> None:
    """The dictionary (the twin) and the compiled cache alike, on ASCII and other text."""
    monkeypatch.setattr("epp.tokenization.fast.PIECE_CACHE_LIMIT", 10)
    fast = FastByteLevelBpe.build(
        Tokenizer.from_file(str(tokenizer_dir("llama3") / "tokenizer.json")),
        load_tokenizer_dir(tokenizer_dir("llama3"))._anchors,
    )
    assert fast is not None
    cache = fast._pieces if kernels_used == "python" else fast._compiled
    assert cache is not None
    ids = array("I")
    for words in ([f"wé{i}" for i in range(100)], [f"w{i}" for i in range(100)]):
        cache.clear()
        fast.encode_into(ids, " ".join(words), None)
        assert 0 < len(cache) <= 10


@pytest.mark.parametrize("name", ["llama3", "tiny-llama"])
def test_bounded_heads_of_long_segments_equal_hf(name: str) -> None:
    """Windows of a long segment (no special token in 50k characters) resume at piece
    ends exactly as the whole text splits, whitespace runs and long words included."""
    directory = tokenizer_dir(name)
    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rng = random.Random(4)
    chunks = ["word", " ", "    ", "\n\n\n", "\t", "x" * 300, " " * 700, "12345678", "é中", "!?"]
    for _ in range(12):
        text = "".join(rng.choice(chunks) for _ in range(rng.randint(2000, 6000)))
        want = hf.encode(text, add_special_tokens=False).ids
        for cut in (1, 50, 517, 2000):
            tok = load_tokenizer_dir(directory, cache_bytes=0)
            assert list(tok.encode_text_head(text, cut).ids) == want[:cut]


def test_a_single_huge_word_costs_a_bounded_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = load_tokenizer_dir(tokenizer_dir("llama3"), cache_bytes=0)
    seen: list[int] = []
    encode = tok._encode

    def spy(text: str, add_special_tokens: bool = True) -> object:
        seen.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    tok._encode = spy  # type: ignore[method-assign]
    word = "abcdefghij" * 200_000  # 2 million letters, one pre-tokenizer piece
    head = tok.encode_text_head(word, 1000)
    assert len(head.ids) == 1000 and not head.exact
    assert sum(seen) < 1000 * 16 * 4  # slices of the head only, never the whole word


def test_an_nfc_normalizer_keeps_the_fast_path_exact(tmp_path) -> None:
    """Qwen 2's tokenizers normalize with NFC: text NFC leaves alone takes the fast path,
    text it changes goes to HF, and both equal HF's ids."""
    spec = json.loads((tokenizer_dir("llama3") / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer_dir(tmp_path, cache_bytes=0)
    assert tok._fast is not None
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rng = random.Random(8)
    alphabet = [*ALPHABET, "e\u0301", "A\u030a", "\u212b", "\ufb01", "\u1e9b\u0323"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        want = hf.encode(text, add_special_tokens=False).ids
        assert list(tok.encode_text_head(text, None).ids) == want
        cut = rng.randint(1, len(want) + 1)
        assert list(tok.encode_text_head(text, cut).ids) == want[:cut]
    other = dict(spec, normalizer={"type": "NFKC"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(other))
    assert load_tokenizer_dir(tmp_path)._fast is None  # NFKC: not reproduced
