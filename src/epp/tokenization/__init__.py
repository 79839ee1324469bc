"""Real tokenizers, per model: the model's own tokenizer files and chat template, encoded
as vLLM encodes them (`hf`), the template rendered as transformers renders it
(`chat_template`), a prefix cache that spares a conversation's history from being
re-encoded every turn (`cache`), and the per-model table (`registry`)."""

from epp.tokenization.cache import PrefixTokenCache
from epp.tokenization.chat_template import ChatTemplate
from epp.tokenization.hf import HfTokenizer, load_tokenizer_dir
from epp.tokenization.registry import TokenizerRegistry

__all__ = [
    "ChatTemplate",
    "HfTokenizer",
    "PrefixTokenCache",
    "TokenizerRegistry",
    "load_tokenizer_dir",
]
