"""What OpenAI and Anthropic bodies share on their way to a chat template: errors, media
stand-ins (a media part cannot be tokenized as the engine does, so it stands in as
`<image:HASH>`), function tools in vLLM's shape, and Claude Code's billing header line."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import xxhash

BILLING_HEADER = "x-anthropic-billing-header"
TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
MEDIA_TYPES = {
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
MEDIA_MODALITY: Mapping[str, str] = MappingProxyType(MEDIA_TYPES)


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


def strip_billing(text: str) -> str | None:
    if not text.startswith(BILLING_HEADER):
        return text
    rest = text.partition("\n")[2]
    return rest or None


def join_with_stand_ins(texts: list[str], stand_ins: list[str]) -> str:
    """A turn's text: its media stand-ins first (where vLLM puts its placeholders), then
    its text parts, one per line."""
    joined = "\n".join(texts)
    if stand_ins:
        joined = "\n".join([*stand_ins, joined]) if joined else "\n".join(stand_ins)
    return joined


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
