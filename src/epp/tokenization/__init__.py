"""Tokenizers: the contract every one implements (`protocol`: `Tokenizer`, `ChatMessage`,
`Encoded`), the byte estimate that is the default (`estimate`), and real tokenizers, per
model: the model's own tokenizer files and chat template, encoded as vLLM encodes them
(`hf`), the template rendered as transformers renders it (`chat_template`), a prefix cache
that spares a conversation's history from being re-encoded every turn (`cache`), the
per-model table (`registry`) and the engine's own /tokenize (`engine`).

The names below are loaded on first use: the request parser imports `protocol` and
`estimate`, and must not pay for the model tokenizers' dependencies (tokenizers, jinja2,
the config) at import (about 0.2 s).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epp.tokenization.cache import PrefixTokenCache
    from epp.tokenization.chat_template import ChatTemplate
    from epp.tokenization.hf import HfTokenizer
    from epp.tokenization.hf_files import load_tokenizer_dir
    from epp.tokenization.registry import TokenizerRegistry

_MODULE_OF = {
    "ChatTemplate": "epp.tokenization.chat_template",
    "HfTokenizer": "epp.tokenization.hf",
    "PrefixTokenCache": "epp.tokenization.cache",
    "TokenizerRegistry": "epp.tokenization.registry",
    "load_tokenizer_dir": "epp.tokenization.hf_files",
}

__all__ = [
    "ChatTemplate",
    "HfTokenizer",
    "PrefixTokenCache",
    "TokenizerRegistry",
    "load_tokenizer_dir",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
