"""What a chat template reads from the body besides the messages (ChatOptions), for
both APIs: vLLM's defaults where a field is absent, a 400 naming a field of the wrong
type."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from epp.conversation import (
    BadConversation,
    anthropic_reasoning_effort,
    anthropic_tools,
    openai_tools,
)
from epp.request.body import ANY, Body, is_null
from epp.request.types import bad
from epp.tokenization.protocol import ChatOptions

_KWARGS = msgspec.json.Decoder(dict[str, Any])
Tools = tuple[Mapping[str, Any], ...] | None


def openai_options(data: Body) -> ChatOptions:
    """An OpenAI chat body's settings, checked in the order vLLM reads them."""
    kwargs = _template_kwargs(data.chat_template_kwargs)
    tools = _tools(data.tools, openai_tools)
    documents = _documents(data.documents)
    effort = data.reasoning_effort
    if effort is not None and not isinstance(effort, str):
        raise bad("'reasoning_effort' must be a string", "reasoning_effort")
    return ChatOptions(
        add_generation_prompt=_flag(data.add_generation_prompt, "add_generation_prompt", True),
        continue_final_message=_flag(data.continue_final_message, "continue_final_message", False),
        add_special_tokens=_flag(data.add_special_tokens, "add_special_tokens", False),
        tools=tools,
        documents=documents,
        reasoning_effort=effort,
        chat_template_kwargs=kwargs,
    )


def anthropic_options(data: Body) -> ChatOptions:
    """An Anthropic body's settings: tools, and the reasoning effort its `thinking` and
    `output_config` name; the template's defaults otherwise."""
    kwargs = _template_kwargs(data.chat_template_kwargs)
    return ChatOptions(
        tools=_tools(data.tools, anthropic_tools),
        reasoning_effort=anthropic_reasoning_effort(
            _optional(data.thinking), _optional(data.output_config)
        ),
        chat_template_kwargs=kwargs,
        source="anthropic",
    )


def _tools(raw: msgspec.Raw, convert: Callable[[object], Tools]) -> Tools:
    """The body's `tools` in vLLM's shape: one decode and one refusal path for both APIs;
    `convert` (epp.conversation) reads the API's own tool layout."""
    if is_null(raw):
        return None
    try:
        return convert(ANY.decode(raw))
    except BadConversation as exc:
        raise bad(exc.message, exc.param) from None


def _template_kwargs(raw: msgspec.Raw) -> dict[str, Any] | None:
    if is_null(raw):
        return None
    try:
        return _KWARGS.decode(raw)
    except msgspec.ValidationError:
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs") from None


def _documents(raw: msgspec.Raw) -> tuple[Any, ...] | None:
    decoded = _optional(raw)
    if decoded is None:
        return None
    if not isinstance(decoded, list):
        raise bad("'documents' must be a list", "documents")
    return tuple(decoded)


def _optional(raw: msgspec.Raw) -> Any:
    """A raw field decoded, None when absent or null."""
    return None if is_null(raw) else ANY.decode(raw)


def _flag(value: Any, name: str, default: bool) -> bool:
    if value is msgspec.UNSET or value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return value
