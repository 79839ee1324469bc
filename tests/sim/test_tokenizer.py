"""The simulator's tokenizer and chat template."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epp.tokenization.estimate import ByteEstimateTokenizer
from epp_bench.workloads import catalog
from vllm_sim.tokenizer import (
    BEGIN_OF_TEXT,
    END_HEADER,
    END_OF_TURN,
    MAX_PIECE_BYTES,
    START_HEADER,
    VOCAB_SIZE,
    ChatMessage,
    SimTokenizer,
    piece_chunks,
    split_pieces,
)

TOKENIZER = SimTokenizer()

TEXTS = [
    "Route me to the pod that already has my prefix, please.",
    "I'm sure they'll say it's 12345 tokens_long!\n\n  indented\tline\r\n",
    "héllo wörld, naïve café",
    "日本語のテキストです。",
    "emoji 🚀🚀 and combining e\u0301 marks",
    "snake_case_name = value_2 + __dunder__",
    "",
    "   ",
    "\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_and_chunks_cover_the_text_exactly(text: str) -> None:
    pieces = split_pieces(text)
    assert "".join(pieces) == text
    for piece in pieces:
        chunks = piece_chunks(piece)
        assert "".join(chunks) == piece
        sizes = [len(c.encode()) for c in chunks]
        assert all(0 < size <= MAX_PIECE_BYTES for size in sizes)
    assert len(TOKENIZER.encode(text)) == sum(len(piece_chunks(p)) for p in pieces)


def test_pieces_follow_words_numbers_and_punctuation() -> None:
    assert split_pieces("I'm at pod-12345, ok?\n\nYes") == [
        "I", "'m", " at", " pod", "-", "123", "45", ",", " ok", "?\n\n", "Yes",
    ]  # fmt: skip
    # Runs of spaces: the last one joins the next word.
    assert split_pieces("a   b") == ["a", "  ", " b"]


def test_long_pieces_split_into_even_chunks_of_at_most_5_bytes() -> None:
    assert piece_chunks(" pods") == [" pods"]
    assert piece_chunks(" hello") == [" he", "llo"]
    assert piece_chunks(" extraordinary") == [" extr", "aordi", "nary"]
    # Multi-byte characters are never cut: one CJK character (3 bytes) per chunk here.
    assert piece_chunks("日本語") == ["日", "本", "語"]
    assert piece_chunks("éé") == ["éé"]  # 4 bytes


def test_ids_are_deterministic_in_range_and_the_same_in_every_process() -> None:
    text = " ".join(TEXTS)
    ids = list(TOKENIZER.encode(text))
    assert ids == list(SimTokenizer().encode(text))
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    code = (
        f"from vllm_sim.tokenizer import SimTokenizer; print(list(SimTokenizer().encode({text!r})))"
    )
    for seed in ("0", "1"):
        result = subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        assert result.stdout.strip() == str(ids)


def test_special_tokens_never_come_out_of_text() -> None:
    ids = TOKENIZER.encode("<|begin_of_text|><|start_header_id|>user<|eot_id|>")
    assert all(i < VOCAB_SIZE for i in ids)


def test_unicode_and_stray_surrogates_encode() -> None:
    assert len(TOKENIZER.encode("日本語のテキスト")) == 8  # one token per character
    assert len(TOKENIZER.encode("\ud800 lone")) >= 2  # no UnicodeEncodeError


def test_a_completion_prompt_starts_with_bos() -> None:
    plain = TOKENIZER.encode("hello there")
    assert list(TOKENIZER.encode("hello there", add_special_tokens=True)) == [
        BEGIN_OF_TEXT,
        *plain,
    ]


def test_chat_template_renders_headers_turn_ends_and_the_generation_prompt() -> None:
    enc = TOKENIZER.encode
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Which pod?")]
    expected = [
        BEGIN_OF_TEXT,
        START_HEADER, *enc("system"), END_HEADER, *enc("\n\nBe brief."), END_OF_TURN,
        START_HEADER, *enc("user"), END_HEADER, *enc("\n\nWhich pod?"), END_OF_TURN,
    ]  # fmt: skip
    generation_prompt = [START_HEADER, *enc("assistant"), END_HEADER, *enc("\n\n")]
    assert list(TOKENIZER.encode_chat(messages)) == expected + generation_prompt
    assert list(TOKENIZER.encode_chat(messages, add_generation_prompt=False)) == expected


def test_chat_rendering_is_prefix_stable_and_a_reply_continues_the_generation_prompt() -> None:
    conversation = [ChatMessage("system", "You route requests. " * 5)]
    previous: list[int] = []
    for turn in range(3):
        conversation.append(ChatMessage("user", f"Question {turn}?"))
        prompt = list(TOKENIZER.encode_chat(conversation))
        # The last prompt, generation prompt included, starts this one.
        assert prompt[: len(previous)] == previous
        reply = " sed sit est"
        conversation.append(ChatMessage("assistant", reply))
        answered = list(TOKENIZER.encode_chat(conversation, add_generation_prompt=False))
        assert answered == prompt + list(TOKENIZER.encode(reply)) + [END_OF_TURN]
        previous = answered


def test_benchmark_workloads_keep_their_sizes_in_tokens() -> None:
    # The workloads are sized in the router's pseudo-tokens (4 bytes); the simulator's
    # tokens come within a few percent of them (the module docstring's figures).
    router = ByteEstimateTokenizer()
    for workload in (
        catalog.shared_prefix(catalog.QUICK, seed=3),
        catalog.multi_turn(conversations=8, seed=3),
    ):
        ours = theirs = 0
        for request in workload.requests:
            if request.messages is not None:
                messages = [ChatMessage(m.role, m.content) for m in request.messages]
                ours += len(TOKENIZER.encode_chat(messages))
                theirs += len(router.encode_chat(request.messages))
            else:
                assert request.prompt is not None
                ours += len(TOKENIZER.encode(request.prompt, add_special_tokens=True))
                theirs += len(router.encode(request.prompt))
        assert ours / theirs == pytest.approx(1.0, abs=0.03), workload.name
