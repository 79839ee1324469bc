"""Re-exports epp.tokenization.protocol and .estimate; goes when routing is split."""

from epp.tokenization.estimate import BYTES_PER_PSEUDO_TOKEN, ByteEstimateTokenizer
from epp.tokenization.protocol import (
    DEFAULT_CHAT_OPTIONS,
    ChatMessage,
    ChatOptions,
    Encoded,
    TokenizationError,
    Tokenizer,
    encode_head_by_slicing,
)

__all__ = [
    "BYTES_PER_PSEUDO_TOKEN",
    "DEFAULT_CHAT_OPTIONS",
    "ByteEstimateTokenizer",
    "ChatMessage",
    "ChatOptions",
    "Encoded",
    "TokenizationError",
    "Tokenizer",
    "encode_head_by_slicing",
]
