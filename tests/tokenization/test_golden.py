"""The EPP's tokens equal vLLM's for realistic request bodies.

tests/fixtures/tokenizer/golden.json was written by vLLM's own code
(tools/vllm_check/tokenizer_golden.py: vLLM 0.32's request models, message parsing,
Anthropic conversion and chat-template rendering, transformers' tokenizer); here the same
bodies go through `parse_request` and the EPP's tokenizer, with neither installed.
"""

from __future__ import annotations

import json

import pytest
from tokenizer_fixtures import FIXTURES, tokenizer_dir

from epp.request import parse_request
from epp.tokenization import HfTokenizer, load_tokenizer_dir

CASES = json.loads((FIXTURES / "cases.json").read_text())
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())
_LOADED: dict[str, HfTokenizer] = {}


def tokenizer(name: str) -> HfTokenizer:
    if name not in _LOADED:
        _LOADED[name] = load_tokenizer_dir(tokenizer_dir(name))
    return _LOADED[name]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_tokens_equal_vllms(case: dict) -> None:
    tok = tokenizer(case["tokenizer"])
    if case["name"] not in GOLDEN:
        pytest.skip("no golden ids for this case (its tokenizer was absent when they were made)")
    golden = GOLDEN[case["name"]]
    request = parse_request(case["path"], json.dumps(case["body"]).encode(), {})
    prompt = request.prompt
    if prompt.messages is not None:
        assert tok.render_chat(prompt.messages, prompt.chat) == golden["text"]
        ids = tok.encode_chat(prompt.messages, prompt.chat)
    else:
        assert prompt.text == golden["text"]
        ids = tok.encode(prompt.text)
    assert list(ids) == golden["ids"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bounded_heads_are_prefixes_of_vllms_ids(case: dict) -> None:
    """Heads cut at any length are exactly the first ids (cold cache each time)."""
    if case["name"] not in GOLDEN:
        pytest.skip("no golden ids for this case")
    golden = GOLDEN[case["name"]]["ids"]
    request = parse_request(case["path"], json.dumps(case["body"]).encode(), {})
    prompt = request.prompt
    for cut in sorted(
        {1, 2, 5, 16, len(golden) // 3, len(golden) - 1, len(golden), len(golden) + 7}
    ):
        tok = load_tokenizer_dir(tokenizer_dir(case["tokenizer"]))
        if prompt.messages is not None:
            head = tok.encode_chat_prefix(prompt.messages, cut, prompt.chat)
        else:
            assert prompt.text is not None
            head = tok.encode_prefix(prompt.text, cut)
        assert list(head.ids) == golden[: max(0, cut)], cut
        if head.exact:
            assert head.total_tokens == len(golden)
