"""The committed tiny-llama tokenizer fixture is the tokenizer of the model
tools/vllm_check builds (where it was built on this machine)."""

from __future__ import annotations

import pytest
from tokenizer_fixtures import FIXTURES, TINY_LLAMA


def test_the_tiny_llama_fixture_is_the_built_models_tokenizer() -> None:
    """The copy equals the model tools/vllm_check builds, where that was built here."""
    if not (TINY_LLAMA / "tokenizer.json").exists():
        pytest.skip("no .bench/tiny-llama to compare with (tools/vllm_check/build_model.py)")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (FIXTURES / "tiny-llama" / name).read_bytes() == (TINY_LLAMA / name).read_bytes()
