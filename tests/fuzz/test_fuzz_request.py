"""Request parsing (epp.request) and the tokenization path after it (epp.prefix.blocks), fuzzed.

Contract (epp.request's docstring): malformed input raises `RequestRejected` with a 4xx
status and nothing else, for any bytes; an accepted body gives a prompt whose blocks the
router can hash. Invariants of accepted bodies: a prompt's leading blocks hash the same
whatever follows them (prefix affinity), and a body cut by `max_prompt_tokens` hashes its
head exactly as the whole.
"""

from __future__ import annotations

import base64
import json

from fuzz.budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_fixtures import tokenizer_dir

from epp.prefix.blocks import prompt_blocks
from epp.prefix.hashing import chain_seed
from epp.request import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MESSAGES_PATH,
    InferenceRequest,
    RequestRejected,
    parse_request,
)
from epp.tokenization import load_tokenizer_dir
from epp.tokenization.estimate import ByteEstimateTokenizer

PATHS = [COMPLETIONS_PATH, CHAT_PATH, MESSAGES_PATH, "/v1/models", CHAT_PATH + "?x=1"]
BLOCK = 16
TOKENIZER = ByteEstimateTokenizer()
ADAPTERS = {"lora-a": "m"}


def parse(path: str, body: bytes, **kw) -> InferenceRequest | RequestRejected:
    """The parse and the blocks the router would hash: the accepted request, or the
    rejection. Anything else raised is a defect and fails the property."""
    try:
        request = parse_request(path, body, ADAPTERS, **kw)
        blocks = prompt_blocks(
            request.prompt, TOKENIZER, BLOCK, chain_seed(request.model or ""), max_blocks=64
        )
    except RequestRejected as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.message)
        assert exc.message and "\n" not in exc.message[:200]
        json.loads(exc.body())  # the answer the client gets is JSON
        return exc
    assert blocks.prompt_tokens >= 0 and len(blocks.hashes) <= 64
    assert all(0 <= h < 2**64 for h in blocks.hashes)
    return request


# -- arbitrary bytes ------------------------------------------------------------------------


@settings(max_examples=examples(120))
@given(path=st.sampled_from(PATHS), body=st.binary(max_size=2048))
def test_arbitrary_bytes_are_rejected_with_a_4xx_or_parsed(path, body):
    parse(path, body)


# -- structured but wrong JSON --------------------------------------------------------------

# Strings with every kind of code point, lone surrogates included (json.dumps writes them
# as \udXXX escapes, which the parser must refuse with a 400).
TEXT = st.text(st.characters(codec=None), max_size=40) | st.sampled_from(
    ["", "x-anthropic-billing-header: a", "\ud800", "<|end|>", "é" * 5, "user"]
)
NUMBERS = (
    st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, -1, 2**32, 2**32 - 1, 2**63, 2**64, 10**400])
)
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)

PART_TYPES = [
    "text",
    "image_url",
    "input_audio",
    "video_url",
    "audio_url",
    "image",
    "document",
    "tool_use",
    "tool_result",
    "thinking",
    "refusal",
    "file",
    "unknown",
]


@st.composite
def parts(draw):
    kind = draw(st.sampled_from(PART_TYPES) | JSON)
    part = {"type": kind}
    field = draw(st.sampled_from(["text", "image_url", "input_audio", "source", "content", "x"]))
    if field == "image_url" and draw(st.booleans()):
        raw = draw(st.binary(max_size=64)) * draw(st.sampled_from([1, 400]))  # > 16 KiB too
        part[field] = {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}
    else:
        part[field] = draw(JSON | TEXT)
    if draw(st.booleans()):
        part = dict(reversed(list(part.items())))  # "type" not leading
    return part


CONTENT = TEXT | st.lists(parts() | JSON, max_size=4) | JSON
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", ""]) | JSON


@st.composite
def messages(draw):
    turn = {"role": draw(ROLES), "content": draw(CONTENT)}
    for key in ("tool_calls", "tool_call_id", "name", "reasoning", "tools"):
        if draw(st.integers(0, 4)) == 0:
            turn[key] = draw(JSON)
    return turn if draw(st.integers(0, 9)) else draw(JSON)


FIELDS = {
    "model": st.sampled_from(["m", "lora-a", ""]) | JSON,
    "prompt": TEXT | st.lists(st.integers(-1, 2**33), max_size=40) | st.lists(TEXT) | JSON,
    "messages": st.lists(messages(), max_size=5) | JSON,
    "stream": st.booleans() | JSON,
    "cache_salt": TEXT | JSON,
    "tools": JSON,
    "chat_template_kwargs": JSON,
    "documents": JSON,
    "add_generation_prompt": st.booleans() | JSON,
    "continue_final_message": JSON,
    "add_special_tokens": JSON,
    "reasoning_effort": JSON,
    "system": TEXT | st.lists(parts()) | JSON,
    "thinking": JSON,
    "output_config": JSON,
    "max_tokens": NUMBERS,
}


@st.composite
def bodies(draw):
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=8))
    body = {key: draw(FIELDS[key]) for key in keys}
    if draw(st.booleans()):
        body["model"] = "m"
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    return text.encode("utf-8", "surrogatepass")


@settings(max_examples=examples(300))
@given(path=st.sampled_from(PATHS), body=bodies())
def test_wrong_json_is_rejected_with_a_4xx_or_parsed(path, body):
    parse(path, body)


@settings(max_examples=examples(20))
@given(
    path=st.sampled_from(PATHS),
    depth=st.integers(1, 200_000),
    opener=st.sampled_from(["[", '{"a":', '[{"content":']),
    where=st.sampled_from(["messages", "prompt", "tools", "system", "max_tokens"]),
)
def test_deep_nesting_is_rejected_or_parsed_never_a_crash(path, depth, opener, where):
    body = b'{"model": "m", "%s": ' % where.encode() + opener.encode() * depth
    parse(path, body)
    parse(path, body + b"1" + (b"]" if opener == "[" else b"}") * depth + b"}")


# -- invariants of accepted bodies ----------------------------------------------------------


def hashes(path: str, body: dict, **kw) -> list[int]:
    request = parse_request(path, json.dumps(body).encode(), ADAPTERS, **kw)
    seed = chain_seed(request.base_model or "", request.adapter, request.cache_salt)
    return prompt_blocks(request.prompt, TOKENIZER, BLOCK, seed, max_blocks=512).hashes


WORDS = st.text(st.characters(codec="utf-8"), min_size=0, max_size=600)


@settings(max_examples=examples(80))
@given(prefix=WORDS, rest=WORDS)
def test_a_completion_prompt_keeps_its_blocks_whatever_follows(prefix, rest):
    short = hashes(COMPLETIONS_PATH, {"model": "m", "prompt": prefix})
    long = hashes(COMPLETIONS_PATH, {"model": "m", "prompt": prefix + rest})
    # Blocks wholly inside the prefix's bytes (4 bytes a pseudo-token, 16 a block).
    whole = len(prefix.encode()) // (4 * BLOCK)
    assert long[:whole] == short[:whole]


@settings(max_examples=examples(80))
@given(
    turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), WORDS), min_size=1),
    more=st.lists(
        st.tuples(st.sampled_from(["user", "assistant"]), WORDS | st.just("")), max_size=3
    ),
    image=st.booleans(),
    api=st.sampled_from([CHAT_PATH, MESSAGES_PATH]),
)
def test_a_conversation_keeps_its_blocks_when_it_grows(turns, more, image, api):
    def body(items):
        msgs = [{"role": r, "content": c} for r, c in items]
        if api == MESSAGES_PATH:
            msgs = [m for m in msgs if m["role"] != "system" and m["content"]]
        if image and api == CHAT_PATH and more:
            # A base64 image after the shared turns: it must not move their blocks.
            url = "data:image/png;base64," + base64.b64encode(b"\x89PNG" * 6000).decode()
            msgs.append(
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
            )
        return {"model": "m", "messages": msgs}

    try:
        short = hashes(api, body(turns))
    except RequestRejected:
        return  # e.g. an Anthropic body with no message left
    long = hashes(api, body(turns + more))
    # The last shared block may hold the generation prompt of the short conversation.
    shared = max(0, len(short) - 1)
    assert long[:shared] == short[:shared]


@settings(max_examples=examples(40))
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3000),
    cap=st.integers(1, 4000),
)
def test_a_token_prompt_cut_by_the_cap_hashes_its_head_as_the_whole(ids, cap):
    body = {"model": "m", "prompt": ids}
    request = parse_request(COMPLETIONS_PATH, json.dumps(body).encode(), {}, max_prompt_tokens=cap)
    kept = list(request.prompt.token_ids)
    # At least the first `cap` ids, exactly (a short list is kept whole: the cut is looked
    # for only past the first 12 bytes an id), and the rest counted.
    assert kept == ids[: len(kept)] and len(kept) >= min(cap, len(ids))
    assert len(kept) + request.prompt.omitted_tokens == len(ids)
    whole = hashes(COMPLETIONS_PATH, body)
    cut = hashes(COMPLETIONS_PATH, body, max_prompt_tokens=cap)
    assert cut == whole[: len(cut)] and len(cut) >= min(len(whole), cap // BLOCK)


@settings(max_examples=examples(40))
@given(
    turns=st.lists(WORDS, min_size=1, max_size=40),
    cap=st.integers(1, 600),
)
def test_a_chat_cut_by_the_cap_hashes_its_head_as_the_whole(turns, cap):
    body = {"model": "m", "messages": [{"role": "user", "content": t} for t in turns]}
    whole = hashes(CHAT_PATH, body)
    cut = hashes(CHAT_PATH, body, max_prompt_tokens=cap)
    # The head's blocks are the whole's, but for its last, which may hold the generation
    # prompt rendered after the head's last turn. Not asserted: that the head covers
    # `cap` pseudo-tokens. The head is cut at twice the cap's bytes of JSON, and JSON
    # escapes make text up to 6x longer (json.dumps writes "\u0080" for a 2-byte
    # character), so an escaped conversation over the cap keeps fewer blocks (found by
    # the long profile: 3 of 4 turns kept, 28 of 32 pseudo-tokens).
    shared = max(0, len(cut) - 1)
    assert cut[:shared] == whole[:shared]


# -- mostly valid chats: deep into the conversation code -----------------------------------------


def _mostly(draw, valid, garbage=JSON):
    return draw(valid) if draw(st.integers(0, 7)) else draw(garbage)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
OPENAI_PARTS = st.sampled_from(
    [IMAGE, {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]
) | st.builds(lambda t: {"type": "text", "text": t}, WORDS)
ANTHROPIC_BLOCKS = (
    st.builds(lambda t: {"type": "text", "text": t}, WORDS)
    | st.just(
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    )
    | st.builds(lambda i: {"type": "tool_use", "id": i, "name": "f", "input": {"a": 1}}, TEXT)
    | st.builds(lambda i, c: {"type": "tool_result", "tool_use_id": i, "content": c}, TEXT, WORDS)
    | st.just({"type": "thinking", "thinking": "hm", "signature": "s"})
)
TOOL_CALL = st.builds(
    lambda i, a: {"id": i, "type": "function", "function": {"name": "f", "arguments": a}},
    TEXT,
    st.sampled_from(["{}", '{"a": 1}', "not json", ""]),
)
TOOLS = st.lists(
    st.builds(
        lambda n: {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}},
        TEXT,
    ),
    max_size=2,
)


@st.composite
def chat_bodies(draw):
    """(path, body) of a chat or messages request, valid but for a field or two."""
    anthropic = draw(st.booleans())
    turns = []
    for _ in range(draw(st.integers(1, 5))):
        if anthropic:
            role = _mostly(draw, st.sampled_from(["user", "assistant"]))
            content = _mostly(draw, WORDS | st.lists(ANTHROPIC_BLOCKS, min_size=1, max_size=3))
            turns.append({"role": role, "content": content})
            continue
        role = _mostly(draw, st.sampled_from(["system", "user", "assistant", "tool", "developer"]))
        turn = {
            "role": role,
            "content": _mostly(draw, WORDS | st.lists(OPENAI_PARTS, max_size=3) | st.none()),
        }
        if role == "assistant" and draw(st.booleans()):
            turn["tool_calls"] = _mostly(draw, st.lists(TOOL_CALL, min_size=1, max_size=2))
        if role == "tool":
            turn["tool_call_id"] = _mostly(draw, TEXT)
        turns.append(turn)
    body = {"model": "m", "messages": turns}
    if draw(st.booleans()):
        body["tools"] = _mostly(draw, TOOLS)
    if anthropic and draw(st.booleans()):
        body["system"] = _mostly(draw, WORDS | st.lists(ANTHROPIC_BLOCKS, max_size=2))
    if draw(st.booleans()):
        body["chat_template_kwargs"] = _mostly(draw, st.dictionaries(TEXT, JSON, max_size=2))
    if anthropic and draw(st.booleans()):
        body["thinking"] = _mostly(draw, st.just({"type": "enabled", "budget_tokens": 1024}))
    path = MESSAGES_PATH if anthropic else CHAT_PATH
    return path, json.dumps(body).encode("utf-8", "surrogatepass")


@settings(max_examples=examples(200))
@given(request=chat_bodies())
def test_mostly_valid_chats_are_parsed_or_rejected_with_a_4xx(request):
    parse(*request)


# -- the real tokenizers' chat templates -------------------------------------------------------

REAL_TOKENIZERS = {name: load_tokenizer_dir(tokenizer_dir(name)) for name in ("chatml", "llama3")}


@settings(max_examples=examples(120))
@given(request=chat_bodies(), name=st.sampled_from(sorted(REAL_TOKENIZERS)))
def test_a_real_chat_template_renders_or_rejects_with_a_4xx(request, name):
    path, body = request
    # A template that refuses a conversation is a TokenizationError, answered 400 as vLLM
    # answers it (epp.prefix.blocks); any other exception is a defect.
    try:
        request = parse_request(path, body, ADAPTERS)
        prompt_blocks(request.prompt, REAL_TOKENIZERS[name], BLOCK, 7, max_blocks=64)
    except RequestRejected as exc:
        assert 400 <= exc.status < 500, (exc.status, exc.message)
