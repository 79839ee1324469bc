"""Where the test tokenizers are (tests/fixtures/tokenizer, tools/make_test_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "tokenizer"
TINY_LLAMA = ROOT / ".bench" / "tiny-llama"


def tokenizer_dir(name: str) -> Path:
    """A test tokenizer's directory; `tiny-llama` skips the test when it was not built."""
    if name == "tiny-llama":
        if not (TINY_LLAMA / "tokenizer.json").exists():
            pytest.skip("no .bench/tiny-llama (tools/vllm_check/build_model.py builds it)")
        return TINY_LLAMA
    return FIXTURES / name
