"""An Anthropic /v1/messages body (`system`, `messages`) -> the same chat prompt as an
OpenAI chat, converted as vLLM converts it (`epp.conversation.anthropic_turns`)."""

from __future__ import annotations

from typing import Any

import msgspec

from epp.conversation import BadConversation, anthropic_turns
from epp.request.body import ANY, Body, is_null
from epp.request.heads import head_of_list
from epp.request.parts import BIG_PART, content_parts, turn_parts
from epp.request.types import Prompt, bad
from epp.tokenization.protocol import ChatOptions

_ANTHROPIC_MEDIA = {"image": "image"}  # block type -> modality


class _TurnRole(msgspec.Struct, gc=False):
    role: Any = None


_TURN_ROLE = msgspec.json.Decoder(_TurnRole)
_TURNS = msgspec.json.Decoder(list[msgspec.Raw])


def messages_prompt(data: Body, max_tokens: int, options: ChatOptions) -> Prompt:
    head, omitted = head_of_list(data.messages, max_tokens, "messages", "a messages request")
    try:
        messages = [_turn(turn) for turn in _TURNS.decode(head)]
        system = None if is_null(data.system) else ANY.decode(data.system)
        turns = anthropic_turns(system, messages)
    except BadConversation as exc:
        raise bad(exc.message, exc.param) from None
    if not turns:
        raise bad("a messages request needs at least one message with content", "messages")
    return Prompt(messages=tuple(turns), omitted_tokens=omitted, chat=options)


def _turn(turn: msgspec.Raw) -> object:
    """One turn as epp.conversation reads it (`role`, `content`); a large turn's image
    blocks stay undecoded (HashedMedia)."""
    if len(turn) > BIG_PART:
        blocks = turn_parts(turn)
        if blocks is not None:
            role = _TURN_ROLE.decode(turn).role
            return {"role": role, "content": content_parts(blocks, _ANTHROPIC_MEDIA)}
    return ANY.decode(turn)
