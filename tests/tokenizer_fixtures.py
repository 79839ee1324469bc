"""Where the test tokenizers are (tests/fixtures/tokenizer, tools/make_test_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "tokenizer"
TINY_LLAMA = ROOT / ".bench" / "tiny-llama"


def tokenizer_dir(name: str) -> Path:
    """A test tokenizer's directory. `tiny-llama` is the tokenizer of the local model that
    tools/vllm_check/build_model.py builds for the real-vLLM checks (its tokenizer files
    are copied under tests/fixtures/tokenizer/tiny-llama, so the vLLM golden tests run on
    a machine without .bench/)."""
    return FIXTURES / name
