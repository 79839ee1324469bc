"""Which tokenizer serves which model: the `tokenizers:` section of the configuration.

    tokenizers:
      meta-llama/Llama-3.1-8B-Instruct:        # a base model name, as the pods serve it
        path: /models/llama-3.1-8b             # tokenizer.json, tokenizer_config.json
        # chat_template_file: /models/llama/tool_chat_template.jinja   (vLLM --chat-template)
        # content_format: auto                 # auto | string | openai (vLLM's option)
        # default_chat_template_kwargs: {}     # vLLM --default-chat-template-kwargs
        # cache_mb: 64                         # multi-turn prefix cache of this tokenizer
        # source: engine                       # ask a pod (POST /tokenize), path the fallback
        # timeout_ms: 75                       # then the fallback (engine.py)

Every configured tokenizer is loaded when the registry is built, so a wrong path fails at
start-up. Models that share a directory (and options) share one tokenizer and one cache.
A LoRA adapter's requests use their base model's entry (the router looks up the base model
of the model it serves the request as). A model without an entry (and every request whose
model is absent) gets the fallback, the byte estimate: approximate routing only needs the
router to agree with itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from epp.config import TokenizerConfig
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.hf import HfTokenizer
from epp.tokenization.hf_files import load_tokenizer_dir
from epp.tokenization.protocol import Tokenizer


class TokenizerRegistry:
    """model name -> Tokenizer, with a fallback for the others."""

    def __init__(
        self,
        tokenizers: Mapping[str, Tokenizer] | None = None,
        fallback: Tokenizer | None = None,
    ) -> None:
        self._by_model: dict[str, Tokenizer] = dict(tokenizers or {})
        self.fallback: Tokenizer = fallback or ByteEstimateTokenizer()

    @classmethod
    def from_config(
        cls, configs: Mapping[str, TokenizerConfig], fallback: Tokenizer | None = None
    ) -> TokenizerRegistry:
        loaded: dict[tuple[object, ...], HfTokenizer] = {}
        by_model: dict[str, Tokenizer] = {}
        for model, config in configs.items():
            if config.path is None:
                continue  # source: engine without local files: the fallback stands in
            key = (
                str(Path(config.path).resolve()),
                str(config.chat_template_file) if config.chat_template_file else None,
                config.content_format,
                tuple(sorted((k, repr(v)) for k, v in config.default_chat_template_kwargs.items())),
                config.cache_mb,
            )
            if key not in loaded:
                try:
                    loaded[key] = load_tokenizer_dir(
                        config.path,
                        name=f"hf:{model}",
                        chat_template_file=config.chat_template_file,
                        content_format=config.content_format,
                        default_chat_template_kwargs=config.default_chat_template_kwargs,
                        cache_bytes=int(config.cache_mb * 1024 * 1024),
                    )
                except (OSError, ValueError) as exc:
                    raise ValueError(f"tokenizers.{model}: {exc}") from None
            by_model[model] = loaded[key]
        return cls(by_model, fallback)

    def for_model(self, model: str | None) -> Tokenizer:
        """The model's tokenizer, or the fallback. Pass the base model for an adapter (an
        adapter has its base model's tokenizer), or the served model name."""
        if model is None:
            return self.fallback
        return self._by_model.get(model, self.fallback)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self._by_model)

    def __contains__(self, model: object) -> bool:
        return model in self._by_model
