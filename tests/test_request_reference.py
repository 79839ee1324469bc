"""parse_request agrees with an independent reference over many random valid bodies.

The reference reads each body with `json.loads` and applies the documented rules of each
API by hand (a completion batch routes by its first prompt; token ids are kept up to the
cap and the rest counted; a chat turn of text parts is its texts joined by newlines; an
Anthropic `system` string is the first turn; absent chat settings take vLLM's defaults).
The bodies are written with random JSON whitespace between every token (any amount, as
JSON allows), escapes or raw UTF-8, and unknown fields of any JSON value.
"""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.request import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DEFAULT_MAX_PROMPT_TOKENS,
    MESSAGES_PATH,
    parse_request,
)

ADAPTERS = {"lora-a": "base-a", "lora-b": "base-b"}
MODELS = st.sampled_from(["m", "base-a", "lora-a", "lora-b", "Meta/Llama-3 8B"])
TEXT = st.text(max_size=40)
TOKEN_ID = st.integers(0, 2**32 - 1) | st.integers(0, 9)
JSON_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
UNKNOWN = st.dictionaries(
    st.sampled_from(["n", "temperature", "max_tokens", "user", "x"]), JSON_VALUE, max_size=3
)
SPACES = " \t\r\n"


def dump(value: Any, rng: random.Random) -> str:
    """JSON text of `value` with a random run of whitespace (often none, sometimes over 64
    bytes) around every token, and strings either escaped or raw UTF-8."""

    def ws() -> str:
        roll = rng.random()
        if roll < 0.5:
            return ""
        size = rng.randint(1, 3) if roll < 0.9 else rng.randint(60, 200)
        return "".join(rng.choice(SPACES) for _ in range(size))

    if isinstance(value, dict):
        items = [f"{ws()}{dump(k, rng)}{ws()}:{ws()}{dump(v, rng)}{ws()}" for k, v in value.items()]
        return "{" + (",".join(items) if items else ws()) + "}"
    if isinstance(value, list):
        items = [f"{ws()}{dump(v, rng)}{ws()}" for v in value]
        return "[" + (",".join(items) if items else ws()) + "]"
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def common(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(MODELS), **draw(UNKNOWN)}
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["cache_salt"] = draw(TEXT)
    return body


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = common(draw)
    body["prompt"] = draw(
        TEXT
        | st.lists(TEXT, min_size=1, max_size=4)
        | st.lists(TOKEN_ID, min_size=1, max_size=300)
        | st.lists(st.lists(TOKEN_ID, min_size=1, max_size=60), min_size=1, max_size=3)
    )
    return body


TEXT_PART = st.builds(lambda t: {"type": "text", "text": t}, TEXT)
CHAT_TURN = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.text(
            alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="x"),
            max_size=40,
        )
        | st.lists(TEXT_PART, min_size=1, max_size=3),
    }
)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = common(draw)
    body["messages"] = draw(st.lists(CHAT_TURN, min_size=1, max_size=6))
    for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
        if draw(st.booleans()):
            body[name] = draw(st.booleans() | st.none())
    if draw(st.booleans()):
        body["reasoning_effort"] = draw(st.sampled_from(["low", "high"]) | st.none())
    if draw(st.booleans()):
        body["chat_template_kwargs"] = draw(st.dictionaries(TEXT, JSON_VALUE, max_size=3))
    if draw(st.booleans()):
        body["documents"] = draw(st.lists(st.dictionaries(TEXT, TEXT, max_size=2), max_size=2))
    return body


@st.composite
def messages_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = common(draw)
    turn = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant"]),
            "content": st.text(min_size=1, max_size=40),
        }
    )
    body["messages"] = draw(st.lists(turn, min_size=1, max_size=6))
    if draw(st.booleans()):
        body["system"] = draw(st.text(min_size=1, max_size=40))
    body["max_tokens"] = draw(st.integers(1, 100))
    return body


def reference(path: str, raw: bytes, cap: int) -> dict[str, Any]:
    """What routing must read of a valid body, by json.loads and the APIs' rules."""
    body = json.loads(raw)
    model = body["model"]
    out: dict[str, Any] = {
        "model": model,
        "adapter": model if model in ADAPTERS else None,
        "base_model": ADAPTERS.get(model, model),
        "stream": body.get("stream", False),
        "cache_salt": body.get("cache_salt"),
    }
    if path == COMPLETIONS_PATH:
        prompt = body["prompt"]
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch routes by its first prompt
        elif isinstance(prompt, list) and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            out.update(text=prompt, token_ids=None, omitted=0)
        else:
            out.update(text=None, token_ids=prompt[:cap], omitted=max(0, len(prompt) - cap))
        return out
    if path == CHAT_PATH:
        turns = []
        for turn in body["messages"]:
            content = turn["content"]
            if isinstance(content, list):
                content = "\n".join(part["text"] for part in content)
            turns.append((turn["role"], content))
        out["turns"] = turns

        def flag(name: str, default: bool) -> bool:
            value = body.get(name)
            return default if value is None else value

        out["options"] = {
            "add_generation_prompt": flag("add_generation_prompt", True),
            "continue_final_message": flag("continue_final_message", False),
            "add_special_tokens": flag("add_special_tokens", False),
            "reasoning_effort": body.get("reasoning_effort"),
            "chat_template_kwargs": body.get("chat_template_kwargs"),
            "documents": body.get("documents"),
            "source": "openai",
        }
        return out
    system = [("system", body["system"])] if "system" in body else []
    out["turns"] = system + [(t["role"], t["content"]) for t in body["messages"]]
    out["options"] = {"source": "anthropic"}
    return out


def parsed(path: str, raw: bytes, cap: int) -> dict[str, Any]:
    request = parse_request(path, raw, ADAPTERS, max_prompt_tokens=cap)
    prompt = request.prompt
    out: dict[str, Any] = {
        "model": request.model,
        "adapter": request.adapter,
        "base_model": request.base_model,
        "stream": request.stream,
        "cache_salt": request.cache_salt,
    }
    if path == COMPLETIONS_PATH:
        ids = None if prompt.token_ids is None else list(prompt.token_ids)
        out.update(text=prompt.text, token_ids=ids, omitted=prompt.omitted_tokens)
        return out
    assert prompt.messages is not None and prompt.chat is not None and prompt.omitted_tokens == 0
    out["turns"] = [(m.role, m.content) for m in prompt.messages]
    chat = prompt.chat
    if path == CHAT_PATH:
        out["options"] = {
            "add_generation_prompt": chat.add_generation_prompt,
            "continue_final_message": chat.continue_final_message,
            "add_special_tokens": chat.add_special_tokens,
            "reasoning_effort": chat.reasoning_effort,
            "chat_template_kwargs": chat.chat_template_kwargs,
            "documents": None if chat.documents is None else list(chat.documents),
            "source": chat.source,
        }
    else:
        out["options"] = {"source": chat.source}
    return out


BODIES = st.one_of(
    st.tuples(st.just(COMPLETIONS_PATH), completion_bodies()),
    st.tuples(st.just(CHAT_PATH), chat_bodies()),
    st.tuples(st.just(MESSAGES_PATH), messages_bodies()),
)


@settings(max_examples=200, deadline=None)
@given(request=BODIES, seed=st.integers(0, 2**32), cap=st.sampled_from([1, 7, 50, 131072]))
def test_parse_results_match_a_json_loads_reference(request, seed, cap):
    path, body = request
    raw = dump(body, random.Random(seed)).encode()
    if path != COMPLETIONS_PATH:
        cap = DEFAULT_MAX_PROMPT_TOKENS  # all turns kept: the head of a long chat is estimated
    assert parsed(path, raw, cap) == reference(path, raw, cap)
