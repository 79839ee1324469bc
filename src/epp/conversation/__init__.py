"""Chat turns from request bodies, in the shape vLLM gives its chat template.

`request.py` decodes the bodies; this package turns decoded OpenAI messages and tools
(`openai_chat`), and Anthropic `/v1/messages` bodies (`anthropic_messages`), into
`ChatMessage`s and `ChatOptions` the way vLLM does ahead of rendering (vLLM's
`parse_chat_messages` and its Anthropic-to-chat conversion, reimplemented here). What both
share (media stand-ins, function tools, the billing header): `common`.

Errors are `BadConversation(message, param)`; request.py answers them with 400.
"""

from epp.conversation.anthropic_messages import (
    anthropic_reasoning_effort,
    anthropic_tools,
    anthropic_turns,
)
from epp.conversation.common import (
    BILLING_HEADER,
    MEDIA_MODALITY,
    BadConversation,
    HashedMedia,
    function_tool,
    media_stand_in,
)
from epp.conversation.openai_chat import (
    normalize_tool_calls,
    openai_content,
    openai_tools,
    openai_turn,
)

__all__ = [
    "BILLING_HEADER",
    "MEDIA_MODALITY",
    "BadConversation",
    "HashedMedia",
    "anthropic_reasoning_effort",
    "anthropic_tools",
    "anthropic_turns",
    "function_tool",
    "media_stand_in",
    "normalize_tool_calls",
    "openai_content",
    "openai_tools",
    "openai_turn",
]
