"""The `tokenizers:` configuration: a tokenizer per model, the byte estimate for the rest."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from tokenizer_fixtures import FIXTURES

from epp.config import EppConfig, load_config
from epp.tokenization import HfTokenizer, TokenizerRegistry
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.protocol import ChatMessage, ChatOptions


def test_configured_models_get_their_tokenizer_and_others_the_byte_estimate(tmp_path) -> None:
    config_file = tmp_path / "epp.yaml"
    config_file.write_text(
        "tokenizers:\n"
        f"  llama-a: {{path: {FIXTURES / 'llama3'}}}\n"
        f"  llama-b: {{path: {FIXTURES / 'llama3'}}}\n"
        f"  qwen: {{path: {FIXTURES / 'chatml'}, cache_mb: 1, content_format: string,"
        " default_chat_template_kwargs: {enable_thinking: false}}\n"
    )
    config = load_config(config_file)
    registry = TokenizerRegistry.from_config(config.tokenizers)
    llama = registry.for_model("llama-a")
    assert isinstance(llama, HfTokenizer)
    assert registry.for_model("llama-b") is llama  # one directory, one tokenizer and cache
    qwen = registry.for_model("qwen")
    assert isinstance(qwen, HfTokenizer) and qwen is not llama
    assert qwen.cache.max_bytes == 1024 * 1024
    # vLLM's --default-chat-template-kwargs and --chat-template-content-format
    assert qwen.render_chat([ChatMessage("user", "hi")], None).endswith("<think>\n\n</think>\n\n")
    assert qwen.template_for(ChatOptions()).content_format == "string"
    assert isinstance(registry.for_model("unknown"), ByteEstimateTokenizer)
    assert registry.for_model(None) is registry.fallback
    assert "qwen" in registry and set(registry.models) == {"llama-a", "llama-b", "qwen"}


def test_a_wrong_path_fails_at_start_naming_the_model(tmp_path) -> None:
    config = EppConfig.model_validate({"tokenizers": {"m": {"path": str(tmp_path)}}})
    with pytest.raises(ValueError, match=r"tokenizers\.m: .*no tokenizer.json"):
        TokenizerRegistry.from_config(config.tokenizers)


@pytest.mark.parametrize(
    "entry",
    [
        {"path": "x", "typo": 1},
        {"path": "x", "content_format": "xml"},
        {"path": "x", "cache_mb": -1},
        {},
    ],
)
def test_tokenizer_entries_are_strict(entry: dict) -> None:
    with pytest.raises(ValidationError):
        EppConfig.model_validate({"tokenizers": {"m": entry}})


def test_no_tokenizers_by_default() -> None:
    assert EppConfig().tokenizers == {}
    assert isinstance(TokenizerRegistry.from_config({}).for_model("m"), ByteEstimateTokenizer)
