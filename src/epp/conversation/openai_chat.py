"""OpenAI chat turns, in the shape vLLM gives its chat template (`parse_chat_messages`).

- Content: a string, or a list of parts. Text parts (`text`, `input_text`,
  `output_text`, `refusal`, `thinking`, or a bare string) are joined with "\\n" into the
  text; one without a string text is refused (vLLM's request validation refuses it).
  Media parts (images, audio, video) cannot be tokenized as the engine does (it expands
  a model-specific placeholder into as many tokens as the media needs), so each stands
  in as `<image:HASH>` (its JSON's xxh64), put ahead of the text as vLLM puts its
  placeholders: equal media give equal tokens, and different media different ones. A
  large media part (a base64 image) arrives from the parser as a `HashedMedia` (the
  xxh64 of its JSON as sent), never decoded into a string (so does a large Anthropic
  image block).
  For templates that iterate over parts the parts are kept:
  `{"type": "text", "text": ...}`, `{"type": "image"}`, ...
- A system turn's text part that starts with Claude Code's `x-anthropic-billing-header`
  line loses that line (vLLM drops it: its per-request hash would defeat prefix caching).
- Assistant `tool_calls`: kept, with string `arguments` decoded to an object (invalid
  JSON or a non-object becomes `{}`, as vLLM does); an empty list is dropped; a call that
  is not an object or not of type "function" is refused. `reasoning` is passed as
  `reasoning` and `reasoning_content`; a tool turn's `tool_call_id`, any turn's `name`
  and a developer turn's `tools` are passed too.
- Tools: `{"type": "function", "function": {"name", "description", "parameters"}}` with
  `strict` / `defer_loading` only when set, in that key order (vLLM's model dump, which a
  template's `tojson` prints as is).
"""

from __future__ import annotations

import json
from typing import Any

from epp.conversation.common import (
    BILLING_HEADER,
    MEDIA_TYPES,
    TEXT_KEYS,
    BadConversation,
    HashedMedia,
    function_tool,
    join_with_stand_ins,
    media_stand_in,
    strip_billing,
)
from epp.tokenization.protocol import ChatMessage


def openai_content(
    content: str | list[Any] | None, role: str, where: str
) -> tuple[str, tuple[dict[str, Any], ...] | None]:
    """(text, parts) of one OpenAI turn's content (module docstring)."""
    if content is None:
        return "", ()
    if isinstance(content, str):
        if role == "system" and content.startswith(BILLING_HEADER):
            stripped = strip_billing(content)
            return (stripped, None) if stripped is not None else ("", ())
        return content, None
    texts: list[str] = []
    stand_ins: list[str] = []
    parts: list[dict[str, Any]] = []
    for part in content:
        text = _part_text(part, where, texts, stand_ins, parts)
        if text is None:
            continue
        if role == "system":
            stripped = strip_billing(text)
            if stripped is None:
                continue
            text = stripped
        texts.append(text)
        parts.append({"type": "text", "text": text})
    return join_with_stand_ins(texts, stand_ins), tuple(parts)


def _part_text(
    part: object,
    where: str,
    texts: list[str],
    stand_ins: list[str],
    parts: list[dict[str, Any]],
) -> str | None:
    """A text part's text; any other part (media, a tool reference) is recorded here and
    gives None."""
    if isinstance(part, str):
        return part
    if isinstance(part, HashedMedia):
        stand_ins.append(part.stand_in)
        parts.append({"type": part.modality})
        return None
    if not isinstance(part, dict):
        raise BadConversation(f"{where}.content parts must be objects or strings")
    kind = part["type"] if isinstance(part.get("type"), str) else None
    if kind in TEXT_KEYS:
        text = part.get(TEXT_KEYS[kind])
        if not isinstance(text, str):  # vLLM's request validation refuses it
            raise BadConversation(f"{where} text part needs a string '{TEXT_KEYS[kind]}'")
        return text
    if kind == "tool_reference":
        name = part.get("name")
        if isinstance(name, str):
            texts.append(name)
            parts.append({"type": "tool_reference", "name": name})
        return None
    modality = MEDIA_TYPES.get(kind or "") or next(
        (m for key, m in MEDIA_TYPES.items() if key in part), "media"
    )
    stand_ins.append(media_stand_in(modality, part))
    parts.append({"type": modality})
    return None


def normalize_tool_calls(calls: object, where: str) -> list[dict[str, Any]] | None:
    """Assistant tool calls as vLLM gives them to the template (arguments as objects)."""
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise BadConversation(f"{where}.tool_calls must be a list")
    if not calls:
        return None
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise BadConversation("assistant tool_calls entries must be objects.", "tool_calls")
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadConversation(
                "chat completions only support assistant tool_calls of type 'function'.",
                "tool_calls",
            )
        arguments = function.get("arguments")
        if not arguments:
            parsed: object = {}
        elif isinstance(arguments, dict):
            parsed = arguments
        elif isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = {}
        else:
            parsed = arguments
        if not isinstance(parsed, dict):
            parsed = {}
        out.append({**call, "function": {**function, "arguments": parsed}})
    return out


def openai_turn(
    role: str,
    content: str | list[Any] | None,
    index: int,
    *,
    tool_calls: object = None,
    tool_call_id: object = None,
    name: object = None,
    reasoning: object = None,
    tools: object = None,
    task: object = None,
) -> ChatMessage:
    """One OpenAI chat turn as vLLM hands it to the template."""
    where = f"messages[{index}]"
    text, parts = openai_content(content, role, where)
    extra: dict[str, Any] = {}
    if role == "assistant":
        calls = normalize_tool_calls(tool_calls, where)
        if calls is not None:
            extra["tool_calls"] = calls
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise BadConversation(f"{where}.reasoning must be a string")
            extra["reasoning"] = extra["reasoning_content"] = reasoning
    elif role == "tool" and tool_call_id is not None:
        extra["tool_call_id"] = tool_call_id
    if isinstance(name, str):
        extra["name"] = name
    if isinstance(task, str):
        extra["task"] = task
    if role == "developer":
        extra["tools"] = tools
    return ChatMessage(role, text, parts, extra or None)


def openai_tools(tools: object) -> tuple[dict[str, Any], ...] | None:
    """A chat body's `tools`, in vLLM's shape (module docstring)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadConversation("'tools' must be a list", "tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadConversation("each tool must be an object of type 'function'", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise BadConversation("a tool needs a 'function' object", "tools")
        out.append(
            function_tool(
                function.get("name"),
                function.get("description"),
                function.get("parameters"),
                function.get("strict"),
                function.get("defer_loading"),
                top_defer_loading=tool.get("defer_loading"),
            )
        )
    return tuple(out)
