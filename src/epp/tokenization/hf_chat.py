"""What vLLM hands a chat template: the conversation (content shaped as the template
reads it, `developer` turns as system turns where the template has no such role, an
Anthropic body's system texts merged where the template needs one leading system turn)
and the template's arguments, merged as vLLM merges them (module docstring of `hf`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.tokenization.chat_template import ChatTemplate
from epp.tokenization.protocol import ChatMessage, ChatOptions

_UNSET = (None, "auto")


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict:
    """vLLM's merge_kwargs: overrides win, except their null (and "auto") values."""
    merged = dict(defaults or {})
    for key, value in (overrides or {}).items():
        if not any(value is u or (isinstance(value, str) and value == u) for u in _UNSET):
            merged[key] = value
    return merged


def template_kwargs(options: ChatOptions, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The template's arguments: the configured defaults, then `tools`, then the body's
    `chat_template_kwargs`, then the request's own options (later ones win, null values
    skipped)."""
    extras: dict[str, Any] = {
        "add_generation_prompt": options.add_generation_prompt,
        "continue_final_message": options.continue_final_message,
        "documents": list(options.documents) if options.documents is not None else None,
        "reasoning_effort": options.reasoning_effort,
    }
    user = options.chat_template_kwargs or {}
    if options.reasoning_effort is not None and "enable_thinking" not in user:
        extras["enable_thinking"] = options.reasoning_effort != "none"
    tools = [dict(t) for t in options.tools] if options.tools is not None else None
    with_tools = merge_kwargs(defaults, {"tools": tools})
    return merge_kwargs(with_tools, merge_kwargs(user, extras))


def conversation(
    messages: Sequence[ChatMessage], options: ChatOptions, template: ChatTemplate
) -> list[dict[str, Any]]:
    if options.source == "anthropic" and template.requires_leading_system:
        # vLLM's /v1/messages: every system text (the top-level one first) joined into
        # one leading system turn.
        systems = [m.content for m in messages if m.role == "system"]
        if systems:
            messages = [
                ChatMessage("system", "".join(systems)),
                *(m for m in messages if m.role != "system"),
            ]
    openai = template.content_format == "openai"
    out: list[dict[str, Any]] = []
    for message in messages:
        content: Any
        if not openai:
            content = message.content
        elif message.parts is None:
            content = [{"type": "text", "text": message.content}]
        elif message.role == "tool" and all(p.get("type") == "text" for p in message.parts):
            content = message.content  # vLLM joins a tool turn's text parts
        else:
            content = [dict(p) for p in message.parts]
        turn: dict[str, Any] = {"role": message.role, "content": content}
        if message.extra:
            turn.update(message.extra)
        out.append(turn)
    if not template.supports_developer and any(t["role"] == "developer" for t in out):
        out = _developer_as_system(out)
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(
            p if isinstance(p, str) else str(p["text"])
            for p in content
            if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
        )
    return content or ""


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM, for a template without a `developer` role: developer turns become system
    turns (without their tools), and when a system turn is then not first, or there are
    several, all of them are merged into one leading turn, joined with a blank line."""
    turns = [
        {k: v for k, v in t.items() if k != "tools"} | {"role": "system"}
        if t["role"] == "developer"
        else t
        for t in conversation
    ]
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, turn in enumerate(turns):
        if turn["role"] == "system":
            if i > 0 or texts:
                merge = True
            text = _text_of(turn.get("content"))
            if text:
                texts.append(text)
        else:
            rest.append(turn)
    if not merge:
        return turns
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]
