"""Anthropic `/v1/messages` bodies as chat turns (vLLM's conversion to a chat request).

- `system` (a string, or text blocks joined with no separator; billing-header blocks
  dropped) becomes a leading system turn; inline `system` turns stay where they are (the
  tokenizer merges them into the first when the template refuses a later system turn).
- Blocks: `text` (empty ones dropped), `image` (a stand-in, as in `common`), `thinking` (the
  turn's reasoning), `tool_use` (a tool call whose arguments are the block's `input`),
  `tool_result` in a user turn (a `tool` turn ahead of that user turn: its text, text
  items joined with "\\n"; images in it become a user turn of their own), in an assistant
  turn the text "Tool result: ..."; `redacted_thinking`, `tool_reference` and unknown
  blocks are dropped. A user turn left with no content is dropped.
- `tools` (`name`, `description`, `input_schema`, `strict`, `defer_loading`) become
  function tools; `thinking: {"type": "disabled"}` sets `reasoning_effort` "none" and
  `output_config.effort` sets it otherwise; `chat_template_kwargs` and `cache_salt`
  (vLLM's extensions) are honoured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.conversation.common import (
    BILLING_HEADER,
    BadConversation,
    HashedMedia,
    function_tool,
    join_with_stand_ins,
    media_stand_in,
)
from epp.tokenization.protocol import ChatMessage


def anthropic_turns(system: object, messages: Sequence[Any]) -> list[ChatMessage]:
    """An Anthropic body's system and messages as chat turns (module docstring)."""
    out: list[ChatMessage] = []
    top = _system_text(system, "system")
    if top:
        out.append(ChatMessage("system", top))
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise BadConversation(f"{where} must be an object")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise BadConversation(f"{where}.role must be 'user' or 'assistant'")
        content = message.get("content")
        if not isinstance(content, str | list):
            raise BadConversation(f"{where}.content must be a string or a list of blocks")
        if role == "system":
            text = _system_text(content, where)
            if text:
                out.append(ChatMessage("system", text))
        elif isinstance(content, str):
            out.append(ChatMessage(role, content))
        else:
            turn = _Turn(role)
            for block in content:
                turn.add(block, where, out)
            message_out = turn.message()
            if message_out is not None:
                out.append(message_out)
    return out


@dataclass(slots=True)
class _Turn:
    """One user or assistant turn being read from its blocks."""

    role: str
    texts: list[str] = field(default_factory=list)
    stand_ins: list[str] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    def add(self, block: object, where: str, out: list[ChatMessage]) -> None:
        """One block; a user turn's tool result goes to `out` as turns of its own, ahead
        of this one."""
        if isinstance(block, HashedMedia):  # a large image block, not decoded
            self.stand_ins.append(block.stand_in)
            self.parts.append({"type": block.modality})
            return
        if not isinstance(block, dict):
            raise BadConversation(f"{where}.content blocks must be objects")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if isinstance(text, str) and text:
                self.texts.append(text)
                self.parts.append({"type": "text", "text": text})
        elif kind == "image":
            if block.get("source"):
                self.stand_ins.append(media_stand_in("image", _image_source(block)))
                self.parts.append({"type": "image"})
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                self.reasoning.append(block["thinking"])
        elif kind == "tool_use":
            self.calls.append(_tool_call(block))
        elif kind == "tool_result":
            if self.role == "user":
                _user_tool_result(block, out)
            else:
                result = block.get("content")
                line = f"Tool result: {result if result else ''}"
                self.texts.append(line)
                self.parts.append({"type": "text", "text": line})

    def message(self) -> ChatMessage | None:
        """The turn, or None for a user turn left with no content (vLLM drops it)."""
        extra: dict[str, Any] = {}
        if self.reasoning:
            extra["reasoning"] = extra["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            extra["tool_calls"] = self.calls
        if self.parts:
            joined = join_with_stand_ins(self.texts, self.stand_ins)
            parts = self.parts
            single_text = len(parts) == 1 and parts[0]["type"] == "text"
            shaped = None if single_text else tuple(parts)
            return ChatMessage(self.role, joined, shaped, extra or None)
        if self.role == "assistant":  # vLLM keeps an assistant turn without content
            return ChatMessage(self.role, "", (), extra or None)
        return None


def _tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    arguments = block.get("input") or {}
    return {
        "id": block.get("id") or "",
        "type": "function",
        "function": {
            "name": block.get("name") or "",
            "arguments": arguments if isinstance(arguments, dict) else {},
        },
    }


def _block_text(blocks: Sequence[Any]) -> str:
    parts = []
    for block in blocks:
        if isinstance(block, dict) and block.get("type") == "text":
            text = block.get("text")
            if isinstance(text, str) and text and not text.startswith(BILLING_HEADER):
                parts.append(text)
    return "".join(parts)


def _system_text(value: object, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return "" if value.startswith(BILLING_HEADER) else value
    if isinstance(value, list):
        return _block_text(value)
    raise BadConversation(f"'{where}' must be a string or a list of blocks", where)


def _image_source(block: Mapping[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        return {"type": "image_url", "image_url": {"url": ""}}
    if source.get("type") == "url":
        url = source.get("url", "")
    else:
        url = f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
    return {"type": "image_url", "image_url": {"url": url}}


def _user_tool_result(block: Mapping[str, Any], out: list[ChatMessage]) -> None:
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    text = ""
    images: list[dict[str, Any]] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "text":
                value = item.get("text", "")
                texts.append(value if isinstance(value, str) else str(value))
            elif kind == "image":
                images.append(_image_source(item))
            elif kind == "tool_reference":
                ref = item.get("tool_name") or item.get("name")
                if isinstance(ref, str) and ref:
                    references.append({"type": "tool_reference", "name": ref})
        text = "\n".join(texts)
    out.append(ChatMessage("tool", text, None, {"tool_call_id": call_id}))
    if images:
        stand_ins = [media_stand_in("image", i) for i in images]
        out.append(
            ChatMessage("user", "\n".join(stand_ins), tuple({"type": "image"} for _ in images))
        )
    if references:
        names = "\n".join(r["name"] for r in references)
        out.append(ChatMessage("tool", names, tuple(references), {"tool_call_id": call_id}))


def anthropic_tools(tools: object) -> tuple[dict[str, Any], ...] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadConversation("'tools' must be a list", "tools")
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise BadConversation("each tool must be an object", "tools")
        out.append(
            function_tool(
                tool.get("name"),
                tool.get("description"),
                tool.get("input_schema"),
                tool.get("strict"),
                tool.get("defer_loading"),
            )
        )
    return tuple(out)


def anthropic_reasoning_effort(thinking: object, output_config: object) -> str | None:
    effort = None
    if isinstance(output_config, dict) and isinstance(output_config.get("effort"), str):
        effort = output_config["effort"]
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = "none"
    return effort
