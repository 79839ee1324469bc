"""prompt_blocks: bounded work per request (at most max_blocks blocks tokenized, hashed,
looked up and recorded), the whole prompt's token count kept for load accounting."""

from __future__ import annotations

from array import array

import pytest
from tokenizer_fixtures import tokenizer_dir

from epp.config import PrefixConfig
from epp.prefix.blocks import PromptBlocks, encode_head, prompt_blocks
from epp.prefix.hashing import BlockHash, block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import Prompt, RequestRejected
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.hf import load_tokenizer_dir
from epp.tokenization.protocol import ChatMessage, ChatOptions, Encoded, encode_head_by_slicing

TOK = ByteEstimateTokenizer()
SEED = chain_seed("m")


def test_default_cap_covers_a_128k_token_prompt():
    config = PrefixConfig()
    assert config.max_blocks_per_request * config.block_size >= 128 * 1024


def test_long_text_prompt_hashes_only_its_head_but_counts_every_token():
    text = "abcd" * (2 * 1024 * 1024)  # 8 MiB: 2M pseudo-tokens, 131,072 blocks
    blocks = prompt_blocks(Prompt(text=text), TOK, 16, SEED, max_blocks=8192)
    assert isinstance(blocks, PromptBlocks)
    assert len(blocks.hashes) == 8192
    assert blocks.prompt_tokens == 2 * 1024 * 1024 and blocks.exact
    assert blocks.total_blocks == 131_072 and blocks.truncated
    # The head is exactly what a full encode + hash would give: long and short prompts
    # with the same start share blocks.
    assert blocks.hashes == block_hashes(TOK.encode(text[: 8192 * 64]), 16, SEED)


def test_the_tokenizer_encodes_no_more_than_the_head():
    text = "é" * 1_000_000 + "x" * 1_000_000  # not ASCII: the rest is estimated
    encoded = TOK.encode_prefix(text, 1000)
    assert len(encoded.ids) == 1000
    assert list(encoded.ids) == list(TOK.encode(text)[:1000])
    exact = len(TOK.encode(text))
    assert not encoded.exact and abs(encoded.total_tokens - exact) / exact < 0.5


def test_short_prompts_are_unchanged_and_exact():
    for prompt in (
        Prompt(text="hello world" * 10),
        Prompt(messages=(ChatMessage("system", "s" * 300), ChatMessage("user", "u"))),
        Prompt(token_ids=array("I", range(100))),
    ):
        blocks = prompt_blocks(prompt, TOK, 16, SEED, max_blocks=8192)
        if prompt.text is not None:
            full = TOK.encode(prompt.text)
        elif prompt.messages is not None:
            full = TOK.encode_chat(prompt.messages)
        else:
            full = prompt.token_ids
        assert blocks.prompt_tokens == len(full) and blocks.exact
        assert blocks.hashes == block_hashes(full, 16, SEED)
        assert not blocks.truncated


def test_long_chat_renders_only_the_turns_the_head_needs():
    history = tuple(ChatMessage("user" if i % 2 else "assistant", "t" * 1000) for i in range(5000))
    blocks = prompt_blocks(Prompt(messages=history), TOK, 16, SEED, max_blocks=64)
    full = TOK.encode_chat(history)
    assert blocks.hashes == block_hashes(full, 16, SEED)[:64]
    assert abs(blocks.prompt_tokens - len(full)) / len(full) < 0.01


def test_token_id_prompts_are_cut_and_counted_exactly():
    ids = array("I", range(100_000))
    blocks = prompt_blocks(Prompt(token_ids=ids), TOK, 16, SEED, max_blocks=10)
    assert blocks.hashes == block_hashes(ids, 16, SEED)[:10]
    assert blocks.prompt_tokens == 100_000 and blocks.exact


def test_no_prompt_has_no_blocks():
    assert prompt_blocks(Prompt(), TOK, 16, SEED, 10) == PromptBlocks(0, [], 16)


class _PlainTokenizer:
    """A tokenizer with only the original protocol (no prefix methods)."""

    name = "plain"

    def encode(self, text: str) -> array:
        return TOK.encode(text)

    def encode_chat(self, messages) -> array:
        return TOK.encode_chat(messages)


def test_a_tokenizer_without_prefix_methods_still_gets_bounded_hashing():
    text = "z" * 40_000
    blocks = prompt_blocks(Prompt(text=text), _PlainTokenizer(), 16, SEED, max_blocks=5)
    assert len(blocks.hashes) == 5 and blocks.prompt_tokens == 10_000
    sliced = encode_head_by_slicing(_PlainTokenizer().encode, text, 80)
    assert list(sliced.ids) == list(TOK.encode(text)[:80]) and sliced.total_tokens == 10_000


class _SpyTokenizer(_PlainTokenizer):
    def __init__(self) -> None:
        self.asked: list[int | None] = []

    def encode_prefix(self, text: str, max_tokens: int | None = None) -> Encoded:
        self.asked.append(max_tokens)
        return TOK.encode_prefix(text, max_tokens)

    def encode_chat_prefix(self, messages, max_tokens: int | None = None) -> Encoded:
        self.asked.append(max_tokens)
        return TOK.encode_chat_prefix(messages, max_tokens)


def test_prompt_blocks_asks_the_tokenizer_for_the_head_only():
    spy = _SpyTokenizer()
    prompt_blocks(Prompt(text="a" * 1_000_000), spy, 16, SEED, max_blocks=100)
    assert spy.asked == [1600]
    turns = tuple(ChatMessage("user", "b" * 1000) for _ in range(1000))
    blocks = prompt_blocks(Prompt(messages=turns), spy, 16, SEED, max_blocks=100)
    assert spy.asked == [1600, 1600]  # the chat's head too, not a full render
    assert blocks.hashes == block_hashes(TOK.encode_chat(turns), 16, SEED)[:100]
    assert len(encode_head(Prompt(text="a" * 1_000_000), spy, None).ids) == 250_000


def test_block_hashes_max_blocks():
    ids = array("I", range(160))
    assert block_hashes(ids, 16, 1, max_blocks=3) == block_hashes(ids, 16, 1)[:3]
    assert block_hashes(ids, 16, 1, max_blocks=0) == []


def test_one_huge_prompt_does_not_evict_what_the_index_holds_for_the_pod():
    index = PrefixIndex(1000)  # default rule: one request records <= 50% of capacity
    others = [[hash((p, b)) for b in range(10)] for p in range(80)]  # 800 blocks
    for prefix in others:
        index.record("pod", prefix)
    huge = [hash(("huge", b)) for b in range(50_000)]
    index.record("pod", huge)
    assert index.record_limit("pod") == 500
    assert index.blocks("pod") == 1000
    assert index.match(huge) == {"pod": 500}  # its head is kept
    kept = sum(index.match(prefix).get("pod", 0) == 10 for prefix in others)
    assert kept >= 50  # 300 blocks evicted at most: the 30 oldest prefixes


def test_record_limit_follows_the_pods_reported_capacity():
    index = PrefixIndex.from_config(PrefixConfig(capacity_per_pod=1000, max_record_fraction=0.5))
    index.set_capacity("pod", 100)
    index.record("pod", list(range(1000)))
    assert index.blocks("pod") == 50 and index.match(list(range(1000))) == {"pod": 50}


def test_record_fraction_is_validated():
    with pytest.raises(ValueError):
        PrefixIndex(10, max_record_fraction=0.0)


# -- real chat templates (tests/fixtures/tokenizer/chatml): options, refusals ---------------

CHATML = load_tokenizer_dir(tokenizer_dir("chatml"))
TURNS = (ChatMessage("system", "You are terse. " * 40), ChatMessage("user", "Hi " * 60))


class _PlainChatml:
    """The chatml tokenizer seen through the original protocol only (encode, encode_chat):
    prompt_blocks falls back to a full encode and cuts it."""

    name = "plain-chatml"

    def encode(self, text: str) -> array:
        return CHATML.encode(text)

    def encode_chat(self, messages, options=None) -> array:
        return CHATML.encode_chat(messages, options)


@pytest.mark.parametrize("tokenizer", [CHATML, _PlainChatml()], ids=["prefix", "plain"])
def test_a_chat_the_template_refuses_is_a_400_naming_messages(tokenizer):
    refused = (ChatMessage("user", "hi"), ChatMessage("system", "late"))
    with pytest.raises(RequestRejected) as caught:
        prompt_blocks(Prompt(messages=refused), tokenizer, 16, SEED, max_blocks=64)
    rejected = caught.value
    assert (rejected.status, rejected.reason, rejected.param) == (
        400,
        "invalid-request",
        "messages",
    )
    assert rejected.message == "System message must be at the beginning."


@pytest.mark.parametrize("tokenizer", [CHATML, _PlainChatml()], ids=["prefix", "plain"])
def test_the_requests_chat_options_reach_the_template(tokenizer):
    options = ChatOptions(add_generation_prompt=False)
    with_options = CHATML.encode_chat(TURNS, options)
    assert with_options != CHATML.encode_chat(TURNS)  # the option changes the rendering
    blocks = prompt_blocks(Prompt(messages=TURNS, chat=options), tokenizer, 4, SEED, 8192)
    assert blocks.prompt_tokens == len(with_options)
    assert blocks.hashes == block_hashes(with_options, 4, SEED)
    default = prompt_blocks(Prompt(messages=TURNS), tokenizer, 4, SEED, 8192)
    assert default.hashes == block_hashes(CHATML.encode_chat(TURNS), 4, SEED)


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_tokenizer_without_prefix_methods_cuts_at_the_head_exactly(kind):
    plain = _PlainChatml()
    if kind == "text":
        prompt = Prompt(text="the quick brown fox " * 50)
        full = CHATML.encode(prompt.text)
    else:
        prompt = Prompt(messages=TURNS)
        full = CHATML.encode_chat(TURNS)
    n = len(full)
    for cap in (None, n + 1, n):  # no cap, or the whole prompt fits: nothing is cut
        head = encode_head(prompt, plain, cap)
        assert list(head.ids) == list(full) and head.total_tokens == n and head.exact
    head = encode_head(prompt, plain, n - 1)
    assert list(head.ids) == list(full[: n - 1]) and head.total_tokens == n
    # Whole blocks only, counted over the whole prompt.
    blocks = prompt_blocks(prompt, plain, 4, SEED, max_blocks=n // 4 - 1)
    assert blocks.hashes == block_hashes(full, 4, SEED)[: n // 4 - 1]
    assert blocks.prompt_tokens == n and blocks.exact and blocks.truncated


def test_token_id_heads_are_cut_at_the_cap_and_counted_whole():
    ids = array("I", range(50))
    for cap in (None, 50, 51):
        head = encode_head(Prompt(token_ids=ids), TOK, cap)
        assert list(head.ids) == list(ids) and head.total_tokens == 50 and head.exact
    head = encode_head(Prompt(token_ids=ids), TOK, 49)
    assert list(head.ids) == list(range(49)) and head.total_tokens == 50


def test_what_the_parser_left_out_is_counted_exact_only_for_token_ids():
    ids = array("I", range(64))
    blocks = prompt_blocks(Prompt(token_ids=ids, omitted_tokens=1000), TOK, 16, SEED, 8192)
    assert blocks.prompt_tokens == 1064 and blocks.exact  # ids are counted, not estimated
    assert blocks.hashes == block_hashes(ids, 16, SEED) and blocks.truncated
    chat = Prompt(messages=TURNS, omitted_tokens=1000)
    head = TOK.encode_chat(TURNS)
    blocks = prompt_blocks(chat, TOK, 16, SEED, 8192)
    assert blocks.prompt_tokens == len(head) + 1000 and not blocks.exact  # turns: estimated
    assert prompt_blocks(Prompt(messages=TURNS), TOK, 16, SEED, 8192).exact


def test_an_estimated_encoding_makes_the_count_inexact():
    text = "é" * 10_000  # not ASCII: the tokenizer estimates what it did not encode
    blocks = prompt_blocks(Prompt(text=text), TOK, 16, SEED, max_blocks=4)
    assert not blocks.exact and blocks.prompt_tokens > 64


@pytest.mark.parametrize(
    ("tokens", "hashed", "total", "truncated"),
    [(32, 2, 2, False), (47, 2, 2, False), (48, 2, 3, True), (0, 0, 0, False), (15, 0, 0, False)],
)
def test_total_blocks_counts_the_whole_prompts_full_blocks(tokens, hashed, total, truncated):
    blocks = PromptBlocks(tokens, [BlockHash(i) for i in range(hashed)], 16)
    assert blocks.total_blocks == total and blocks.truncated is truncated
    assert blocks.exact  # the default: a count with nothing estimated
