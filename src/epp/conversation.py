"""Chat turns from request bodies, in the shape vLLM gives its chat template.

`request.py` decodes the bodies; this module turns decoded OpenAI messages and tools, and
Anthropic `/v1/messages` bodies, into `ChatMessage`s and `ChatOptions` the way vLLM
does before rendering (vLLM's `parse_chat_messages` and its Anthropic-to-chat
conversion, reimplemented here):

OpenAI chat turns
- Content: a string, or a list of parts. Text parts (`text`, `input_text`,
  `output_text`, `refusal`, `thinking`, or a bare string) are joined with "\\n" into the
  text; one without a string text is refused (vLLM's request validation refuses it). Media parts (images, audio, video) cannot be
  tokenized as the engine does (it expands a model-specific placeholder into as many
  tokens as the media needs), so each stands in as `<image:HASH>` (its JSON's xxh64),
  put before the text as vLLM puts its placeholders: equal media give equal tokens, and
  different media different ones. A large media part (a base64 image) arrives from the
  parser as a `HashedMedia` (the xxh64 of its JSON as sent), never decoded into a string
  (so does a large Anthropic image block).
  For templates that iterate over parts the parts are kept: `{"type": "text", "text": ...}`,
  `{"type": "image"}`, ...
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

Anthropic `/v1/messages` bodies (vLLM's conversion to a chat request)
- `system` (a string, or text blocks joined with no separator; billing-header blocks
  dropped) becomes a leading system turn; inline `system` turns stay where they are (the
  tokenizer merges them into the first when the template refuses a later system turn).
- Blocks: `text` (empty ones dropped), `image` (a stand-in, as above), `thinking` (the
  turn's reasoning), `tool_use` (a tool call whose arguments are the block's `input`),
  `tool_result` in a user turn (a `tool` turn before that user turn: its text, text
  items joined with "\\n"; images in it become a user turn of their own), in an assistant
  turn the text "Tool result: ..."; `redacted_thinking`, `tool_reference` and unknown
  blocks are dropped. A user turn left with no content is dropped.
- `tools` (`name`, `description`, `input_schema`, `strict`, `defer_loading`) become
  function tools; `thinking: {"type": "disabled"}` sets `reasoning_effort` "none" and
  `output_config.effort` sets it otherwise; `chat_template_kwargs` and `cache_salt`
  (vLLM's extensions) are honoured.

Errors are `BadConversation(message, param)`; request.py answers them with 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import xxhash

from epp.tokenization.protocol import ChatMessage

BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA = {
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
    "video_embeds": "video",
}


# A media part's type -> its modality (read-only).
MEDIA_MODALITY: Mapping[str, str] = MappingProxyType(_MEDIA)


@dataclass(frozen=True, slots=True)
class HashedMedia:
    """A media part the parser did not decode: its modality and the xxh64 of its JSON."""

    modality: str
    digest: str

    @property
    def stand_in(self) -> str:
        return f"<{self.modality}:{self.digest}>"


class BadConversation(ValueError):
    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def media_stand_in(modality: str, part: object) -> str:
    """The text that stands for one media part: its modality and a hash of its JSON."""
    try:
        raw = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        raise BadConversation("a content part cannot be read") from None
    return f"<{modality}:{xxhash.xxh64_hexdigest(raw.encode('utf-8', 'surrogatepass'))}>"


def _strip_billing(text: str) -> str | None:
    if not text.startswith(BILLING_HEADER):
        return text
    rest = text.partition("\n")[2]
    return rest or None


def openai_content(
    content: str | list[Any] | None, role: str, where: str
) -> tuple[str, tuple[dict[str, Any], ...] | None]:
    """(text, parts) of one OpenAI turn's content (module docstring)."""
    if content is None:
        return "", ()
    if isinstance(content, str):
        if role == "system" and content.startswith(BILLING_HEADER):
            stripped = _strip_billing(content)
            return (stripped, None) if stripped is not None else ("", ())
        return content, None
    texts: list[str] = []
    stand_ins: list[str] = []
    parts: list[dict[str, Any]] = []
    for part in content:
        kind: str | None
        if isinstance(part, str):
            text: object = part
            kind = "text"
        elif isinstance(part, HashedMedia):
            stand_ins.append(part.stand_in)
            parts.append({"type": part.modality})
            continue
        elif isinstance(part, dict):
            kind = part["type"] if isinstance(part.get("type"), str) else None
            if kind in _TEXT_KEYS:
                text = part.get(_TEXT_KEYS[kind])
                if not isinstance(text, str):  # vLLM's request validation refuses it
                    raise BadConversation(f"{where} text part needs a string '{_TEXT_KEYS[kind]}'")
                kind = "text"
            elif kind == "tool_reference":
                name = part.get("name")
                if not isinstance(name, str):
                    continue
                texts.append(name)
                parts.append({"type": "tool_reference", "name": name})
                continue
            else:
                modality = _MEDIA.get(kind or "") or next(
                    (m for key, m in _MEDIA.items() if key in part), "media"
                )
                stand_ins.append(media_stand_in(modality, part))
                parts.append({"type": modality})
                continue
        else:
            raise BadConversation(f"{where}.content parts must be objects or strings")
        assert isinstance(text, str)
        if role == "system":
            stripped = _strip_billing(text)
            if stripped is None:
                continue
            text = stripped
        texts.append(text)
        parts.append({"type": "text", "text": text})
    joined = "\n".join(texts)
    if stand_ins:
        joined = "\n".join([*stand_ins, joined]) if joined else "\n".join(stand_ins)
    return joined, tuple(parts)


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


def function_tool(
    name: object,
    description: object = None,
    parameters: object = None,
    strict: object = None,
    defer_loading: object = None,
    *,
    top_defer_loading: object = None,
) -> dict[str, Any]:
    if not isinstance(name, str):
        raise BadConversation("a tool needs a string 'name'", "tools")
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if defer_loading is None:
        defer_loading = top_defer_loading
    if strict is not None:
        function["strict"] = strict
    if defer_loading is not None:
        function["defer_loading"] = defer_loading
    tool: dict[str, Any] = {"type": "function", "function": function}
    if top_defer_loading is not None:
        tool["defer_loading"] = top_defer_loading
    return tool


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


# -- Anthropic /v1/messages -----------------------------------------------------------
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
            continue
        if isinstance(content, str):
            out.append(ChatMessage(role, content))
            continue
        texts: list[str] = []
        stand_ins: list[str] = []
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            if isinstance(block, HashedMedia):  # a large image block, not decoded
                stand_ins.append(block.stand_in)
                parts.append({"type": block.modality})
                continue
            if not isinstance(block, dict):
                raise BadConversation(f"{where}.content blocks must be objects")
            kind = block.get("type")
            if kind == "text":
                block_text = block.get("text")
                if isinstance(block_text, str) and block_text:
                    texts.append(block_text)
                    parts.append({"type": "text", "text": block_text})
            elif kind == "image":
                if block.get("source"):
                    stand_ins.append(media_stand_in("image", _image_source(block)))
                    parts.append({"type": "image"})
            elif kind == "thinking":
                if isinstance(block.get("thinking"), str):
                    reasoning.append(block["thinking"])
            elif kind == "tool_use":
                arguments = block.get("input") or {}
                calls.append(
                    {
                        "id": block.get("id") or "",
                        "type": "function",
                        "function": {
                            "name": block.get("name") or "",
                            "arguments": arguments if isinstance(arguments, dict) else {},
                        },
                    }
                )
            elif kind == "tool_result":
                if role == "user":
                    _user_tool_result(block, out)
                else:
                    result = block.get("content")
                    line = f"Tool result: {result if result else ''}"
                    texts.append(line)
                    parts.append({"type": "text", "text": line})
        extra: dict[str, Any] = {}
        if reasoning:
            extra["reasoning"] = extra["reasoning_content"] = "".join(reasoning)
        if calls:
            extra["tool_calls"] = calls
        if parts:
            joined = "\n".join(texts)
            if stand_ins:
                joined = "\n".join([*stand_ins, joined]) if joined else "\n".join(stand_ins)
            single_text = len(parts) == 1 and parts[0]["type"] == "text"
            out.append(
                ChatMessage(role, joined, None if single_text else tuple(parts), extra or None)
            )
        elif role == "assistant":  # vLLM keeps an assistant turn without content
            out.append(ChatMessage(role, "", (), extra or None))
    return out


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
