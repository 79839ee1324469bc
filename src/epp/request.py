"""OpenAI and Anthropic request bodies -> the few facts the scheduler needs.

Only what routing uses is extracted: model (and the LoRA adapter it names), the prompt
(completion text, token ids, or chat messages with what the chat template also reads:
tools, chat_template_kwargs, add_generation_prompt, ...), stream and cache_salt.
Anthropic `/v1/messages` bodies become the same chat prompt, converted as vLLM converts
them (`epp.conversation`). Everything else in the body is passed to the pod untouched. Malformed input raises `RequestRejected`
carrying the HTTP status and an OpenAI-style message; it never raises anything else.
"""

from __future__ import annotations

import json
import re
from array import array
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import accumulate, compress
from typing import Annotated, Any, Literal

import msgspec
import xxhash

from epp.conversation import (
    MEDIA_MODALITY,
    BadConversation,
    HashedMedia,
    anthropic_reasoning_effort,
    anthropic_tools,
    anthropic_turns,
    openai_tools,
    openai_turn,
)
from epp.tokenization.estimate import BYTES_PER_PSEUDO_TOKEN
from epp.tokenization.protocol import ChatMessage, ChatOptions

# Routing hashes at most prefix.max_blocks_per_request (8,192) blocks of 16 tokens: the
# parser keeps that much of a prompt by default (see Prompt).
DEFAULT_MAX_PROMPT_TOKENS = 8192 * 16

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API (vLLM serves it too)

RequestKind = Literal["completion", "chat", "messages", "other"]


class RequestRejected(Exception):
    """A request the EPP answers itself (ImmediateResponse) instead of routing."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        reason: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.param = param
        # Sent as a Retry-After header (whole seconds) when set: refusals under load.
        self.retry_after_s = retry_after_s

    @property
    def error_type(self) -> str:
        return {
            400: "BadRequestError",
            404: "NotFoundError",
            413: "RequestTooLargeError",
            429: "RateLimitError",
            503: "ServiceUnavailableError",
        }.get(self.status, "InternalServerError")

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.status,
        }
        return json.dumps({"error": error}).encode()


@dataclass(frozen=True, slots=True)
class Prompt:
    """Exactly one of text, token_ids or messages is set (none for bodiless requests).

    Bounded work: a token-id prompt or a conversation far longer than routing can use
    (`max_prompt_tokens` of `parse_request`) keeps only its head: the first
    `max_prompt_tokens` ids, or the first turns covering at least that many pseudo-tokens.
    `omitted_tokens` counts the rest: exactly for ids, estimated for turns (their JSON
    bytes / 4). The rest is checked as JSON, not as ids or turns: the engine validates it.
    `chat` carries, with messages, what the engine's chat template reads besides them.
    """

    text: str | None = None
    token_ids: array | None = None
    messages: tuple[ChatMessage, ...] | None = None
    omitted_tokens: int = 0
    chat: ChatOptions | None = None


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    kind: RequestKind
    model: str | None
    base_model: str | None
    adapter: str | None
    prompt: Prompt
    stream: bool = False
    cache_salt: str | None = None


def _bad(
    message: str, param: str | None = None, reason: str = "invalid-request"
) -> RequestRejected:
    return RequestRejected(400, message, reason=reason, param=param)


# The body is decoded by msgspec into this struct: only the fields routing reads become
# Python objects; every other field is validated as JSON and skipped. `prompt` and
# `messages` stay raw here and are decoded with their own typed decoders, so that type and
# range checks of every element happen in C and each error names its parameter.
class _Body(msgspec.Struct, gc=False):
    model: Any = None
    cache_salt: Any = None
    stream: Any = msgspec.UNSET
    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    # What a chat template reads besides the messages (absent: not decoded at all).
    tools: msgspec.Raw = msgspec.Raw()
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()
    add_generation_prompt: Any = msgspec.UNSET
    continue_final_message: Any = msgspec.UNSET
    add_special_tokens: Any = msgspec.UNSET
    reasoning_effort: Any = None
    # Anthropic /v1/messages
    system: msgspec.Raw = msgspec.Raw()
    thinking: msgspec.Raw = msgspec.Raw()
    output_config: msgspec.Raw = msgspec.Raw()


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]


class _Message(msgspec.Struct, gc=False):
    role: Annotated[str, msgspec.Meta(min_length=1)]
    # None: assistant turns with tool calls carry no content. Parts stay raw JSON until
    # their type is known (_content_parts): a base64 image is never decoded.
    content: str | list[msgspec.Raw] | None = None
    # Read by chat templates (absent in most turns: decoded only when present).
    tool_calls: Any = None
    tool_call_id: Any = None
    name: Any = None
    reasoning: Any = None
    tools: Any = None
    task: Any = None


class _PartType(msgspec.Struct, gc=False):
    """A content part's type: every other field is checked as JSON and skipped. A type that
    is not a string names no media kind (the part is then decoded in full)."""

    type: str | None = None


class _TurnParts(msgspec.Struct, gc=False):
    """A turn whose content is a list of parts (a string content fails at its first byte)."""

    content: list[msgspec.Raw] | None = None


# Parts and turns larger than this are looked into for media: a part that large is
# hashed from its JSON as sent, and a turn that large counts its media parts as their
# stand-ins, not their bytes, in the pseudo-token estimates.
_BIG_PART = 16 * 1024
_STAND_IN_BYTES = 24  # "<image:" + 16 hex digits + ">"
# Media kinds of both APIs (Anthropic's image blocks are "image").
_MEDIA_TYPES = frozenset(MEDIA_MODALITY) | {"image", "audio", "video", "document"}

_BODY = msgspec.json.Decoder(_Body)
_PART_TYPE = msgspec.json.Decoder(_PartType)
_TURN_PARTS = msgspec.json.Decoder(_TurnParts)
_ANTHROPIC_MEDIA = {"image": "image"}


class _TurnRole(msgspec.Struct, gc=False):
    role: Any = None


_TURN_ROLE = msgspec.json.Decoder(_TurnRole)
# A part's type read from its first bytes when it leads the object (as every SDK writes
# it): no scan of a multi-megabyte part. The body was validated as JSON already.
# A list longer than _WINDOWED x its head budget is cut from a window (_windowed_head)
# of at most _MAX_WINDOW budgets, trying at most _CUT_TRIES `},` candidates per window.
_WINDOWED = 4
_MAX_WINDOW = 8
_CUT_TRIES = 16
_BRACE_CHECKS = 4096
_BASE64_RUN = re.compile(rb";base64,[A-Za-z0-9+/=]{%d,}" % _BIG_PART)
_LEADING_TYPE = re.compile(rb'\{\s*"type"\s*:\s*"([A-Za-z_]{1,32})"')
_PROMPT_TEXT = msgspec.json.Decoder(str)
_NOT_JSON_SPACE = re.compile(rb"[^ \t\r\n]")
_PROMPT_TEXTS = msgspec.json.Decoder(list[str])
_PROMPT_IDS = msgspec.json.Decoder(list[TokenId])
_PROMPT_ID_LISTS = msgspec.json.Decoder(list[list[TokenId]])
_MESSAGES = msgspec.json.Decoder(list[_Message])
_MESSAGE_RAWS = msgspec.json.Decoder(list[msgspec.Raw])
_ANY = msgspec.json.Decoder()
_KWARGS = msgspec.json.Decoder(dict[str, Any])
_PLAIN = frozenset({"system", "user", "assistant"})  # turns without template extras
_JSON_TURN_EXTRA = 12
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff) is legal only as a high-low pair.
_UNPAIRED_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def _invalid_json(body: bytes | bytearray | memoryview, exc: Exception) -> RequestRejected:
    message = f"the body is not valid JSON: {exc}"
    if _UNPAIRED_SURROGATE.search(body):
        # msgspec reports a lone high surrogate as "truncated": name the real cause.
        message += (
            " (strings must be valid Unicode: an unpaired UTF-16 surrogate escape such as"
            " \\ud800 is not allowed)"
        )
    return _bad(message, reason="invalid-json")


def _is_null(raw: msgspec.Raw) -> bool:
    return len(raw) == 0 or (len(raw) == 4 and bytes(raw) == b"null")


def _capped_ids(ids: list[int], max_ids: int) -> Prompt:
    """At most `max_ids` ids are kept (memory bounded by the cap); the rest are counted."""
    return Prompt(token_ids=array("I", ids[:max_ids]), omitted_tokens=max(0, len(ids) - max_ids))


def _token_ids_head(raw: msgspec.Raw, max_ids: int) -> Prompt:
    """A flat list of token ids: decode (and validate) its first `max_ids` ids, count the
    rest. The rest must look like numbers (no strings, lists or objects); the engine
    validates their values."""
    view = memoryview(raw)
    if len(view) <= max_ids * 2:  # cannot hold more than max_ids ids
        return _capped_ids(_PROMPT_IDS.decode(raw), max_ids)
    size = max(64, max_ids * 12)
    while True:
        chunk = bytes(view[:size])
        cut = chunk.rfind(b",") if size < len(view) else -1
        if cut < 0:  # the whole list fits: no head to cut
            return _capped_ids(_PROMPT_IDS.decode(raw), max_ids)
        ids = _PROMPT_IDS.decode(chunk[:cut] + b"]")
        if len(ids) > max_ids:
            break
        size *= 2
    # The head ends at the comma after id number `len(ids)`; the tail follows it.
    tail = view[cut + 1 :]
    tail_bytes = bytes(tail)
    if any(tail_bytes.find(c) >= 0 for c in (b'"', b"[", b"{")):
        raise _bad("'prompt' token ids must be integers in [0, 2^32)", "prompt")
    count = len(ids) + tail_bytes.count(b",") + 1
    return Prompt(token_ids=array("I", ids[:max_ids]), omitted_tokens=count - max_ids)


def _next_byte(raw: msgspec.Raw, at: int = 0) -> tuple[bytes, int]:
    """The first byte at or after `at` that is not JSON whitespace, and its offset (b""
    past the end). JSON allows any amount of whitespace there: no fixed window."""
    found = _NOT_JSON_SPACE.search(raw, at)
    return (b"", len(raw)) if found is None else (found.group(), found.start())


def _completion_prompt(raw: msgspec.Raw, max_tokens: int) -> Prompt:
    if _is_null(raw):
        raise _bad("a completion request needs 'prompt'", "prompt")
    opening, at = _next_byte(raw)
    if opening == b'"':
        return Prompt(text=_PROMPT_TEXT.decode(raw))
    if opening == b"[":
        # The first element says which form the list is: strings, ids, or lists of ids.
        first, _ = _next_byte(raw, at + 1)
        try:
            if first == b'"':
                # A batch of prompts is one request to one pod; its first prompt leads.
                return Prompt(text=_PROMPT_TEXTS.decode(raw)[0])
            if first == b"[":
                return _capped_ids(_PROMPT_ID_LISTS.decode(raw)[0], max_tokens)
            if first.isdigit() or first == b"-":
                return _token_ids_head(raw, max_tokens)
        except msgspec.ValidationError as exc:
            if first != b'"':
                raise _bad(
                    f"'prompt' token ids must be integers in [0, 2^32): {exc}", "prompt"
                ) from None
    raise _bad("'prompt' must be a string, a list of strings, or token ids", "prompt")


def _part_type(part: msgspec.Raw) -> str | None:
    leading = _LEADING_TYPE.match(bytes(memoryview(part)[:128]))
    if leading is not None:
        return leading.group(1).decode()
    try:
        return _PART_TYPE.decode(part).type
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None  # not an object or no string type: decoded in full, checked there


def _content_parts(raws: list[msgspec.Raw], media: Mapping[str, str] = MEDIA_MODALITY) -> list[Any]:
    """A turn's content parts: decoded, except large media parts (a base64 image; their
    types -> modality in `media`), which become their stand-in's hash without a string
    being made of them."""
    parts: list[Any] = []
    for part in raws:
        if len(part) > _BIG_PART:
            kind = _part_type(part)
            modality = None if kind is None else media.get(kind)
            if modality is not None:
                parts.append(HashedMedia(modality, xxhash.xxh64_hexdigest(part)))
                continue
        parts.append(_ANY.decode(part))
    return parts


def _turn_bytes(turn: msgspec.Raw) -> int:
    """A turn's JSON bytes, its large media parts counted as their stand-ins."""
    size = len(turn)
    if size <= _BIG_PART:
        return size
    try:
        parts = _TURN_PARTS.decode(turn).content or ()
    except (msgspec.ValidationError, msgspec.DecodeError):
        return size  # string content (not copied out), or refused when decoded
    for part in parts:
        if len(part) > _BIG_PART and _part_type(part) in _MEDIA_TYPES:
            size -= len(part) - _STAND_IN_BYTES
    return size


def _sizes(raws: list[msgspec.Raw]) -> list[int]:
    sizes = list(map(len, raws))
    # Only large turns are looked into (in C up to here: many tiny turns stay cheap).
    for i in compress(range(len(sizes)), map(_BIG_PART.__lt__, sizes)):
        sizes[i] = _turn_bytes(raws[i])
    return sizes


def _windowed_head(raw: msgspec.Raw, budget: int) -> tuple[list[msgspec.Raw], int] | None:
    """The leading elements of a long JSON list, decoded from a window of it, and where
    the rest starts; None when no cut is found cheaply (the whole list is split then).

    A cut is a `},` past the window whose prefix, closed with `]`, decodes as a list: a
    `},` inside a string or a nested value leaves a string or container open and fails
    to decode, so the first that decodes ends a top-level element. The window doubles
    until its turns cover `budget` bytes, up to _MAX_WINDOW budgets (one huge turn or
    image leaves no cut there: the list is short, split whole)."""
    view = memoryview(raw)
    window = budget
    while 2 * window < len(view) and window <= _MAX_WINDOW * budget:
        for close, rest in _element_ends(view, window, 2 * window):
            try:
                raws = _MESSAGE_RAWS.decode(bytes(view[: close + 1]) + b"]")
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            if sum(_sizes(raws)) >= budget:
                return raws, rest
            break  # media made the window's turns short of the budget: widen it
        window *= 2
    return None


def _element_ends(view: memoryview, start: int, end: int) -> Iterator[tuple[int, int]]:
    """In view[start:end], up to _CUT_TRIES `}` followed (after whitespace) by `,`: the
    brace's offset and the offset past the comma. Searched with bytes.find (memchr): a
    base64 image holds no brace and is passed over at memory speed."""
    chunk = bytes(view[start:end])
    found = checked = 0
    at = chunk.find(b"}")
    while at >= 0 and found < _CUT_TRIES and checked < _BRACE_CHECKS:
        checked += 1
        after = chunk[at + 1 : at + 17]
        stripped = after.lstrip()
        if stripped[:1] == b",":
            found += 1
            yield start + at, start + at + 2 + len(after) - len(stripped)
        at = chunk.find(b"}", at + 1)


def _tail_bytes(tail: memoryview, head: list[msgspec.Raw]) -> tuple[int, int]:
    """(text bytes, turns) of the list's tail, no element of which is decoded: its size
    with each base64 media run counted as its stand-in, and as many turns as those bytes
    make at the head's mean turn size (an image's bytes hold no turns)."""
    media = sum(len(run.group()) - _STAND_IN_BYTES for run in _BASE64_RUN.finditer(tail))
    text = len(tail) - media  # each run leaves its stand-in's bytes: never negative
    mean = max(1, sum(map(len, head)) // len(head))
    return text, max(1, text // mean)


def _head_of_list(
    raw: msgspec.Raw, max_tokens: int, param: str, what: str
) -> tuple[bytes | msgspec.Raw, int]:
    """A JSON list's head: the first elements whose JSON holds twice the bytes of
    `max_tokens` pseudo-tokens (escapes make JSON longer than its text; media parts
    count as their stand-ins). Returns the head as a JSON list and the pseudo-tokens of
    the rest (estimated from its JSON size).

    Bounded work: a list much longer than that is cut from a window of its first bytes
    (_windowed_head); its tail is measured, never split into elements."""
    if _is_null(raw):
        raise _bad(f"{what} needs a non-empty '{param}' list", param)
    budget = 2 * BYTES_PER_PSEUDO_TOKEN * max_tokens
    found = _windowed_head(raw, budget) if len(raw) > _WINDOWED * budget else None
    tail: tuple[int, int] = (0, 0)
    if found is not None:
        raws, rest = found
        tail = _tail_bytes(memoryview(raw)[rest:-1], raws)
    else:
        try:
            raws = _MESSAGE_RAWS.decode(raw)
        except msgspec.ValidationError:
            raise _bad(f"{what} needs a non-empty '{param}' list", param) from None
    if not raws:
        raise _bad(f"{what} needs a non-empty '{param}' list", param)
    ends = list(accumulate(_sizes(raws)))
    keep = min(len(raws), bisect_left(ends, budget) + 1)
    if found is None and keep == len(raws):
        return raw, 0
    head = b"[" + b",".join(raws[:keep]) + b"]"
    return head, _omitted(ends, keep, tail)


def _omitted(ends: list[int], keep: int, tail: tuple[int, int]) -> int:
    # A turn's JSON ({"role": "", "content": ""}, ~24 bytes) is ~12 bytes longer than its
    # rendering (<||>\n<|end|>\n, 13): subtract that per omitted turn.
    tail_bytes, tail_turns = tail
    turns = len(ends) - keep + tail_turns
    omitted_bytes = max(0, ends[-1] - ends[keep - 1] + tail_bytes - _JSON_TURN_EXTRA * turns)
    return -(-omitted_bytes // BYTES_PER_PSEUDO_TOKEN)


def _chat_prompt(raw: msgspec.Raw, max_tokens: int, options: ChatOptions) -> Prompt:
    head, omitted = _head_of_list(raw, max_tokens, "messages", "a chat request")
    try:
        messages = _MESSAGES.decode(head)
    except msgspec.ValidationError as exc:
        # "Expected `object`, got `str` - at `$[0]`" -> "... at `messages[0]`"
        detail = str(exc).replace("`$", "`messages")
        raise _bad(f"invalid 'messages': {detail}", "messages") from None
    try:
        turns = [
            ChatMessage(m.role, m.content)
            # the common case: a plain string turn with nothing else for the template
            if type(m.content) is str
            and m.role in _PLAIN
            and m.tool_calls is None
            and m.name is None
            and m.reasoning is None
            and m.task is None
            and not (m.role == "system" and m.content.startswith("x-anthropic-billing"))
            else openai_turn(
                m.role,
                m.content if type(m.content) is not list else _content_parts(m.content),
                i,
                tool_calls=m.tool_calls,
                tool_call_id=m.tool_call_id,
                name=m.name,
                reasoning=m.reasoning,
                tools=m.tools,
                task=m.task,
            )
            for i, m in enumerate(messages)
        ]
    except BadConversation as exc:
        raise _bad(exc.message, exc.param) from None
    return Prompt(messages=tuple(turns), omitted_tokens=omitted, chat=options)


def _anthropic_turn(turn: msgspec.Raw) -> object:
    """One Anthropic turn as epp.conversation reads it (`role`, `content`); a large turn's
    image blocks stay undecoded (HashedMedia)."""
    if len(turn) > _BIG_PART:
        try:
            blocks = _TURN_PARTS.decode(turn).content
        except (msgspec.ValidationError, msgspec.DecodeError):
            blocks = None  # string content, or not an object: decoded as it is
        if blocks is not None:
            role = _TURN_ROLE.decode(turn).role
            return {"role": role, "content": _content_parts(blocks, _ANTHROPIC_MEDIA)}
    return _ANY.decode(turn)


def _messages_prompt(data: _Body, max_tokens: int, options: ChatOptions) -> Prompt:
    """An Anthropic /v1/messages body as a chat prompt (epp.conversation)."""
    head, omitted = _head_of_list(data.messages, max_tokens, "messages", "a messages request")
    try:
        messages = [_anthropic_turn(turn) for turn in _MESSAGE_RAWS.decode(head)]
        system = None if _is_null(data.system) else _ANY.decode(data.system)
        turns = anthropic_turns(system, messages)
    except BadConversation as exc:
        raise _bad(exc.message, exc.param) from None
    if not turns:
        raise _bad("a messages request needs at least one message with content", "messages")
    return Prompt(messages=tuple(turns), omitted_tokens=omitted, chat=options)


def _bool_field(value: Any, name: str, default: bool) -> bool:
    if value is msgspec.UNSET or value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def _chat_options(data: _Body, kind: RequestKind) -> ChatOptions:
    """What the chat template reads from the body besides the messages."""
    kwargs = None
    if not _is_null(data.chat_template_kwargs):
        try:
            kwargs = _KWARGS.decode(data.chat_template_kwargs)
        except msgspec.ValidationError:
            raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs") from None
    try:
        if kind == "messages":
            tools = None if _is_null(data.tools) else anthropic_tools(_ANY.decode(data.tools))
            thinking = None if _is_null(data.thinking) else _ANY.decode(data.thinking)
            output = None if _is_null(data.output_config) else _ANY.decode(data.output_config)
            return ChatOptions(
                tools=tools,
                reasoning_effort=anthropic_reasoning_effort(thinking, output),
                chat_template_kwargs=kwargs,
                source="anthropic",
            )
        tools = None if _is_null(data.tools) else openai_tools(_ANY.decode(data.tools))
    except BadConversation as exc:
        raise _bad(exc.message, exc.param) from None
    documents = None
    if not _is_null(data.documents):
        decoded = _ANY.decode(data.documents)
        if not isinstance(decoded, list):
            raise _bad("'documents' must be a list", "documents")
        documents = tuple(decoded)
    effort = data.reasoning_effort
    if effort is not None and not isinstance(effort, str):
        raise _bad("'reasoning_effort' must be a string", "reasoning_effort")
    return ChatOptions(
        add_generation_prompt=_bool_field(
            data.add_generation_prompt, "add_generation_prompt", True
        ),
        continue_final_message=_bool_field(
            data.continue_final_message, "continue_final_message", False
        ),
        add_special_tokens=_bool_field(data.add_special_tokens, "add_special_tokens", False),
        tools=tools,
        documents=documents,
        reasoning_effort=effort,
        chat_template_kwargs=kwargs,
    )


def kind_of(path: str) -> RequestKind:
    route = path.split("?", 1)[0].rstrip("/")
    if route == COMPLETIONS_PATH:
        return "completion"
    if route == CHAT_PATH:
        return "chat"
    if route == MESSAGES_PATH:
        return "messages"
    return "other"


def parse_request(
    path: str,
    body: bytes | bytearray | memoryview,
    adapters: Mapping[str, str],
    *,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
) -> InferenceRequest:
    """Parse an OpenAI or Anthropic request body; `adapters` maps adapter names to their
    base model.

    The body is decoded with msgspec (measured 1.4-2.3x faster than `json.loads` on large
    bodies, see docs/benchmarks/pause.md), which also rejects what `json.loads` would let
    through to fail later: unpaired UTF-16 surrogates in any string, NaN/Infinity, and
    numbers out of float range are all a 400 here, never a 500 further on.
    """
    kind = kind_of(path)
    if not body:
        if kind == "other":
            return InferenceRequest(kind, None, None, None, Prompt())
        raise _bad("the request has no body; expected a JSON object")
    try:
        data = _BODY.decode(body)
    except msgspec.ValidationError as exc:
        if str(exc).startswith("Expected `object`"):
            raise _bad("the body must be a JSON object") from None
        raise _invalid_json(body, exc) from None  # e.g. a number out of range (1e999)
    except msgspec.DecodeError as exc:
        raise _invalid_json(body, exc) from None
    except RecursionError:
        raise _bad("the body is nested too deeply to parse", reason="invalid-json") from None
    model = data.model
    if kind != "other" and (not isinstance(model, str) or not model):
        raise _bad("the request needs a string 'model'", "model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    salt = data.cache_salt
    if salt is not None and not isinstance(salt, str):
        raise _bad("'cache_salt' must be a string", "cache_salt")
    stream = False if data.stream is msgspec.UNSET else data.stream
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    try:
        if kind == "completion":
            prompt = _completion_prompt(data.prompt, max_prompt_tokens)
        elif kind == "chat":
            prompt = _chat_prompt(data.messages, max_prompt_tokens, _chat_options(data, kind))
        elif kind == "messages":
            prompt = _messages_prompt(data, max_prompt_tokens, _chat_options(data, kind))
        else:
            prompt = Prompt()
    except msgspec.DecodeError as exc:  # the raw value was validated already: defensive
        raise _invalid_json(body, exc) from None
    except RecursionError:
        raise _bad("the body is nested too deeply to parse", reason="invalid-json") from None
    adapter = model if model in adapters else None
    base = adapters[adapter] if adapter else model
    return InferenceRequest(kind, model, base, adapter, prompt, stream, salt)


def with_model(body: bytes, model: str) -> bytes:
    """The body with its top-level `model` replaced: a request served as another model (an
    InferenceModel's target). Called only on a body `parse_request` accepted, so it is a
    JSON object; every other field passes through unchanged in value."""
    decoded = msgspec.json.decode(body)
    if not isinstance(decoded, dict):
        raise _bad("the request body must be a JSON object")
    decoded["model"] = model
    return msgspec.json.encode(decoded)
