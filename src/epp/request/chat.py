"""An OpenAI /v1/chat/completions `messages` list -> the turns a chat template reads,
converted as vLLM converts them (`epp.conversation.openai_turn`)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from epp.conversation import BILLING_HEADER, BadConversation, openai_turn
from epp.request.heads import head_of_list
from epp.request.parts import content_parts
from epp.request.types import Prompt, bad
from epp.tokenization.protocol import ChatMessage, ChatOptions


class _Message(msgspec.Struct, gc=False):
    role: Annotated[str, msgspec.Meta(min_length=1)]
    # None: assistant turns with tool calls carry no content. Parts stay raw JSON until
    # their type is known (parts.content_parts): a base64 image is never decoded.
    content: str | list[msgspec.Raw] | None = None
    # Read by chat templates (absent in most turns: decoded only when present).
    tool_calls: Any = None
    tool_call_id: Any = None
    name: Any = None
    reasoning: Any = None
    tools: Any = None
    task: Any = None


_MESSAGES = msgspec.json.Decoder(list[_Message])
_PLAIN = frozenset({"system", "user", "assistant"})  # roles without template extras


def chat_prompt(raw: msgspec.Raw, max_tokens: int, options: ChatOptions) -> Prompt:
    head, omitted = head_of_list(raw, max_tokens, "messages", "a chat request")
    try:
        messages = _MESSAGES.decode(head)
    except msgspec.ValidationError as exc:
        # "Expected `object`, got `str` - at `$[0]`" -> "... at `messages[0]`"
        detail = str(exc).replace("`$", "`messages")
        raise bad(f"invalid 'messages': {detail}", "messages") from None
    try:
        turns = [_turn(m, i) for i, m in enumerate(messages)]
    except BadConversation as exc:
        raise bad(exc.message, exc.param) from None
    return Prompt(messages=tuple(turns), omitted_tokens=omitted, chat=options)


def _turn(m: _Message, index: int) -> ChatMessage:
    content = m.content
    if type(content) is str and _is_plain(m, content):
        return ChatMessage(m.role, content)
    return openai_turn(
        m.role,
        content_parts(content) if type(content) is list else content,
        index,
        tool_calls=m.tool_calls,
        tool_call_id=m.tool_call_id,
        name=m.name,
        reasoning=m.reasoning,
        tools=m.tools,
        task=m.task,
    )


def _is_plain(m: _Message, text: str) -> bool:
    """The common case, kept as it is: a string turn with nothing else for the template.
    A system turn opening with Anthropic's billing header is not: openai_turn drops it."""
    return (
        m.role in _PLAIN
        and m.tool_calls is None
        and m.name is None
        and m.reasoning is None
        and m.task is None
        and not (m.role == "system" and text.startswith(BILLING_HEADER))
    )
