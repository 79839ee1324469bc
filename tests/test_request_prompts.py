"""The prompt a request routes by: completion prompt forms and their refusals, the head
of a token-id prompt and of a conversation longer than routing reads (and the estimate
of the rest), and media parts that stand in by a hash of their JSON."""

from __future__ import annotations

import json

import pytest
import xxhash

import epp.request.heads as heads_module
from epp.conversation import media_stand_in
from epp.request import CHAT_PATH, COMPLETIONS_PATH, MESSAGES_PATH, RequestRejected, parse_request

BIG_PART = 16 * 1024  # parts and turns larger than this are hashed / measured undecoded
IDS_MESSAGE = "'prompt' token ids must be integers in [0, 2^32)"
FORM_MESSAGE = "'prompt' must be a string, a list of strings, or token ids"


def completion(prompt: bytes, max_prompt_tokens: int | None = None):
    raw = b'{"model": "m", "prompt": ' + prompt + b"}"
    if max_prompt_tokens is None:
        return parse_request(COMPLETIONS_PATH, raw, {}).prompt
    return parse_request(COMPLETIONS_PATH, raw, {}, max_prompt_tokens=max_prompt_tokens).prompt


def refused(path: str, raw: bytes, **kw) -> RequestRejected:
    with pytest.raises(RequestRejected) as err:
        parse_request(path, raw, {}, **kw)
    assert err.value.status == 400 and err.value.reason == "invalid-request"
    return err.value


def compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


# -- completion prompts ----------------------------------------------------------------------


def test_completion_prompt_forms_are_read_whatever_the_whitespace():
    assert completion(b'"ab"').text == "ab"  # four bytes, like `null`
    assert completion(b'[ "a", "b"]').text == "a"
    assert completion(b'[\n  "only"\n]').text == "only"
    assert list(completion(b"[ 1, 2]").token_ids) == [1, 2]
    assert list(completion(b"[\n  [ 3, 4], [5]\n]").token_ids) == [3, 4]
    assert list(completion(b"[[6]]").token_ids) == [6]


@pytest.mark.parametrize("gap", [62, 63, 64, 1000, 100_000])
def test_a_prompt_list_is_read_whatever_the_whitespace_after_its_bracket(gap):
    """JSON allows any whitespace between `[` and the first element."""
    space = (b" \t\r\n" * gap)[:gap]
    assert completion(b"[" + space + b'"a", "b"]').text == "a"
    assert list(completion(b"[" + space + b"1, 2]").token_ids) == [1, 2]
    assert list(completion(b"[" + space + b"[3, 4], [5]]").token_ids) == [3, 4]
    ids = completion(b"[" + space + b"1," * 3000 + b"2]", max_prompt_tokens=100)
    assert list(ids.token_ids) == [1] * 100 and ids.omitted_tokens == 2901
    for other in (b"", b"true", b"{}"):  # an empty list, or another form
        raw = b'{"model": "m", "prompt": [' + space + other + b"]}"
        assert refused(COMPLETIONS_PATH, raw).message == FORM_MESSAGE


@pytest.mark.parametrize("ids_per_cap", [1, 2, 5, 6, 7, 20])
@pytest.mark.parametrize("indent", [None, 0, 3])
def test_the_token_ids_kept_are_bounded_by_the_cap(ids_per_cap, indent):
    """A token-id prompt keeps at most `max_prompt_tokens` ids, and counts the rest."""
    cap = 1000
    ids = [i % 10 for i in range(cap * ids_per_cap + 1)]
    raw = json.dumps(ids, indent=indent, separators=(",", ":") if indent is None else None)
    prompt = completion(raw.encode(), max_prompt_tokens=cap)
    assert len(prompt.token_ids) == cap and list(prompt.token_ids) == ids[:cap]
    assert prompt.omitted_tokens == len(ids) - cap


@pytest.mark.parametrize("prompt", [b"[4294967295, 0]", b"[[4294967295, 0]]"])
def test_token_ids_take_the_whole_unsigned_32_bit_range(prompt):
    ids = completion(prompt).token_ids
    assert list(ids) == [2**32 - 1, 0] and ids.typecode == "I"
    head = completion(b"[" + b"4294967295, " * 400 + b"7]", max_prompt_tokens=100)
    assert list(head.token_ids) == [2**32 - 1] * 100 and head.token_ids.typecode == "I"
    assert head.omitted_tokens == 301


def test_a_batch_of_token_id_prompts_routes_by_its_first_cut_to_the_cap():
    cut = completion(b"[[1, 2, 3], [4]]", max_prompt_tokens=2)
    assert list(cut.token_ids) == [1, 2] and cut.omitted_tokens == 1
    whole = completion(b"[[1, 2, 3], [4]]", max_prompt_tokens=3)
    assert list(whole.token_ids) == [1, 2, 3] and whole.omitted_tokens == 0


@pytest.mark.parametrize("raw", [b'{"model": "m"}', b'{"model": "m", "prompt": null}'])
def test_a_completion_without_prompt_is_refused_as_such(raw):
    rejected = refused(COMPLETIONS_PATH, raw)
    assert (rejected.message, rejected.param) == ("a completion request needs 'prompt'", "prompt")


@pytest.mark.parametrize(
    "prompt", [b"true", b"5", b"[]", b"[true]", b"[null]", b"[{}]", b'{"a": 1}', b'["a", 1]']
)
def test_a_prompt_of_another_form_is_refused_naming_the_forms(prompt):
    raw = b'{"model": "m", "prompt": ' + prompt + b"}"
    rejected = refused(COMPLETIONS_PATH, raw)
    assert (rejected.message, rejected.param) == (FORM_MESSAGE, "prompt")


@pytest.mark.parametrize(
    "prompt",
    [b"[-1]", b"[ -1]", b'[1, "a"]', b"[1.5]", b"[4294967296]", b"[[1], [2, -1]]", b"[[1], 2]"],
)
def test_token_ids_out_of_range_or_mixed_are_refused_with_the_first_bad_element(prompt):
    raw = b'{"model": "m", "prompt": ' + prompt + b"}"
    rejected = refused(COMPLETIONS_PATH, raw)
    assert rejected.message.startswith(IDS_MESSAGE + ": ") and "`$[" in rejected.message
    assert rejected.param == "prompt"


# -- the head of a token-id prompt -----------------------------------------------------------


def test_a_pretty_printed_token_id_prompt_keeps_its_head():
    """Whitespace makes ids long: the head is found in a window widened step by step."""
    ids = [(i * 7919) % 100_000 for i in range(3000)]
    prompt = json.dumps(ids, indent=12).encode()
    assert len(prompt) > 12 * 100 * 4  # past several doublings of the first window
    head = completion(prompt, max_prompt_tokens=100)
    assert list(head.token_ids) == ids[:100] and head.omitted_tokens == 2900
    assert list(completion(prompt).token_ids) == ids


def test_a_token_id_prompt_within_the_cap_is_kept_whole():
    # few ids that each take many bytes: longer than 2 bytes per allowed id
    ids = [4_000_000_000 + i for i in range(5)]
    for cap in (5, 6, 50):
        prompt = completion(compact(ids), max_prompt_tokens=cap)
        assert list(prompt.token_ids) == ids and prompt.omitted_tokens == 0


def test_few_short_ids_over_a_tiny_cap_route_by_their_head_and_count():
    """What routing reads of a token-id prompt: its first `cap` ids and its length."""
    ids = list(range(1, 20))
    for cap in (1, 2, 5):
        prompt = completion(compact(ids), max_prompt_tokens=cap)
        assert list(prompt.token_ids[:cap]) == ids[:cap]
        assert len(prompt.token_ids) + prompt.omitted_tokens == len(ids)


@pytest.mark.parametrize("late", [b"[1]", b"[]", b'"1"', b"{}"])
def test_a_token_id_tail_holding_a_list_string_or_object_anywhere_is_refused(late):
    """Past the head the ids are not decoded, only checked to be numbers: a list, string
    or object there is refused, also right after the cut (the first tail byte)."""
    for at in range(5, 80):
        prompt = b"[10," + b"1," * at + late + b"]"
        raw = b'{"model": "m", "prompt": ' + prompt + b"}"
        rejected = refused(COMPLETIONS_PATH, raw, max_prompt_tokens=5)
        assert rejected.message.startswith(IDS_MESSAGE) and rejected.param == "prompt"


@pytest.mark.parametrize("indent", [None, 12])
@pytest.mark.parametrize("late", [b"-1", b"4294967296", b"1.5"])
def test_a_number_past_the_head_is_counted_not_range_checked(indent, late):
    """Only the head's ids are decoded and range-checked; a number further on is counted
    (the engine validates it): a prompt of one head and a long tail is routed by its head,
    pretty-printed or not, whatever its last number."""
    ids = json.dumps([7] * 2000, indent=indent).encode()
    prompt = completion(ids[:-1].rstrip() + b", " + late + b"]", max_prompt_tokens=5)
    assert list(prompt.token_ids) == [7] * 5 and prompt.omitted_tokens == 1996


# -- the head of a conversation -----------------------------------------------------------


def turn(size: int, role: str = "user") -> dict:
    """A turn whose compact JSON is `size` bytes."""
    skeleton = len(compact({"role": role, "content": ""}))
    return {"role": role, "content": "x" * (size - skeleton)}


def chat(turns: list, max_prompt_tokens: int, path: str = CHAT_PATH):
    raw = compact({"model": "m", "max_tokens": 1, "messages": turns})
    return parse_request(path, raw, {}, max_prompt_tokens=max_prompt_tokens).prompt


@pytest.mark.parametrize("path", [CHAT_PATH, MESSAGES_PATH])
def test_the_head_is_the_first_turns_whose_json_reaches_twice_the_cap_in_bytes(path):
    """A cap of 10 pseudo-tokens reads 2 x 4 x 10 = 80 bytes of turns JSON."""
    exactly = chat([turn(80), turn(40, "assistant"), turn(40)], 10, path)
    assert [len(m.content) for m in exactly.messages] == [80 - 28]
    short = chat([turn(79), turn(40, "assistant"), turn(40)], 10, path)
    assert [len(m.content) for m in short.messages] == [79 - 28, 40 - 33]
    everything = chat([turn(30), turn(30, "assistant"), turn(30)], 10, path)
    assert len(everything.messages) == 3 and everything.omitted_tokens == 0
    assert len(chat([turn(200)], 10, path).messages) == 1


@pytest.mark.parametrize("path", [CHAT_PATH, MESSAGES_PATH])
def test_omitted_turns_count_their_json_bytes_less_12_per_turn_over_4(path):
    # omitted: 128 + 61 bytes of JSON, 2 turns -> (189 - 24) / 4 = 41.25 -> 42
    prompt = chat([turn(100), turn(128, "assistant"), turn(61)], 10, path)
    assert len(prompt.messages) == 1 and prompt.omitted_tokens == 42
    # (60 - 12) / 4 = 12 exactly
    assert chat([turn(100), turn(60, "assistant")], 10, path).omitted_tokens == 12


def test_omitted_turns_no_longer_than_their_rendering_count_nothing():
    """The rest is not decoded: turns of 12 bytes or less add no pseudo-token."""
    assert chat([turn(100), {"role": "u"}, {"role": "u"}], 10).omitted_tokens == 0
    assert chat([turn(100), {"role": "u"}, {"role": "us"}], 10).omitted_tokens == 1
    assert chat([turn(100), {}, {}], 10).omitted_tokens == 0


# A cap of 2000 pseudo-tokens reads 16,000 bytes of turns; a list up to 4 x that is split
# into turns whole (longer ones are cut from a window, their rest measured, not split).
CAP = 2000


def test_an_image_in_an_omitted_turn_counts_as_its_stand_in():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40_000}}
    text = {"type": "text", "text": "y" * 100}
    late = {"role": "user", "content": [text, image]}
    omitted_bytes = len(compact(late)) - len(compact(image)) + 24 - 12
    prompt = chat([turn(16_000), late], CAP)
    assert len(prompt.messages) == 1 and prompt.omitted_tokens == -(-omitted_bytes // 4)


def test_a_large_text_part_in_an_omitted_turn_counts_in_full():
    text = {"type": "text", "text": "y" * 40_000}
    late = {"role": "user", "content": [text, {"type": "text", "text": "z"}]}
    prompt = chat([turn(16_000), late], CAP)
    assert prompt.omitted_tokens == -(-(len(compact(late)) - 12) // 4)
    string = {"role": "user", "content": "w" * 40_000}
    omitted = chat([turn(16_000), string], CAP).omitted_tokens
    assert omitted == -(-(len(compact(string)) - 12) // 4)
    # a large part that is no media (its type not a string) counts in full too
    odd = {"role": "user", "content": [{"type": ["image_url"], "data": "d" * 40_000}]}
    assert chat([turn(16_000), odd], CAP).omitted_tokens == -(-(len(compact(odd)) - 12) // 4)


@pytest.mark.parametrize(
    ("path", "what"), [(CHAT_PATH, "a chat request"), (MESSAGES_PATH, "a messages request")]
)
@pytest.mark.parametrize("messages", [None, [], {"role": "user", "content": "x"}, "x", 5])
def test_a_request_without_a_list_of_messages_is_refused_as_such(path, what, messages):
    body = {"model": "m", "max_tokens": 1}
    if messages is not None:
        body["messages"] = messages
    rejected = refused(path, json.dumps(body).encode())
    assert rejected.message == f"{what} needs a non-empty 'messages' list"
    assert rejected.param == "messages"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (["hi"], "invalid 'messages': Expected `object`, got `str` - at `messages[0]`"),
        (
            [{"role": "user", "content": "x"}, {"content": "y"}],
            "invalid 'messages': Object missing required field `role` - at `messages[1]`",
        ),
        (
            [{"role": "assistant", "content": "x", "reasoning": 5}],
            "messages[0].reasoning must be a string",
        ),
    ],
)
def test_an_invalid_chat_turn_is_refused_naming_where(messages, message):
    rejected = refused(CHAT_PATH, json.dumps({"model": "m", "messages": messages}).encode())
    assert (rejected.message, rejected.param) == (message, "messages")


def test_anthropic_turn_refusals_name_where():
    body = {"model": "m", "messages": [{"role": "robot", "content": "x"}]}
    rejected = refused(MESSAGES_PATH, json.dumps(body).encode())
    assert rejected.message == "messages[0].role must be 'user' or 'assistant'"
    body = {"model": "m", "system": 5, "messages": [{"role": "user", "content": "x"}]}
    rejected = refused(MESSAGES_PATH, json.dumps(body).encode())
    assert (rejected.message, rejected.param) == (
        "'system' must be a string or a list of blocks",
        "system",
    )
    body = {"model": "m", "messages": [{"role": "user", "content": []}]}
    rejected = refused(MESSAGES_PATH, json.dumps(body).encode())
    assert rejected.message == "a messages request needs at least one message with content"
    assert rejected.param == "messages"


# -- what a chat turn carries to the template ---------------------------------------------


def test_a_string_turn_keeps_what_the_template_reads_besides_its_text():
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "s", "name": "sys"},
            {"role": "user", "content": "u", "name": "ann", "task": "qa"},
            {"role": "assistant", "content": "a", "tool_calls": calls},
            {"role": "assistant", "content": "b", "reasoning": "r"},
            {"role": "developer", "content": "d", "tools": [{"x": 1}]},
            {"role": "tool", "content": "t", "tool_call_id": "1"},
            {"role": "user", "content": "task", "task": "qa"},
            {"role": "user", "content": "plain"},
        ],
    }
    turns = parse_request(CHAT_PATH, json.dumps(body).encode(), {}).prompt.messages
    assert [(m.role, m.content, m.parts) for m in turns] == [
        ("system", "s", None),
        ("user", "u", None),
        ("assistant", "a", None),
        ("assistant", "b", None),
        ("developer", "d", None),
        ("tool", "t", None),
        ("user", "task", None),
        ("user", "plain", None),
    ]
    assert [m.extra for m in turns] == [
        {"name": "sys"},
        {"name": "ann", "task": "qa"},
        {
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}
            ]
        },
        {"reasoning": "r", "reasoning_content": "r"},
        {"tools": [{"x": 1}]},
        {"tool_call_id": "1"},
        {"task": "qa"},
        None,
    ]


# -- media parts ------------------------------------------------------------------------------


def image_part_json(size: int, *, type_first: bool = True) -> bytes:
    """An image_url part's JSON as a client may write it (spaces, key order), `size` bytes."""
    head = b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,'
    if not type_first:
        head = b'{"image_url": {"url": "data:image/png;base64,'
    tail = b'"}}' if type_first else b'"}, "type": "image_url"}'
    return head + b"A" * (size - len(head) - len(tail)) + tail


def chat_with_parts(*parts: bytes, path: str = CHAT_PATH):
    raw = (
        b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": ['
        + b", ".join(parts)
        + b"]}]}"
    )
    return parse_request(path, raw, {}).prompt.messages[-1]


def test_a_large_media_part_stands_in_by_the_hash_of_its_json_as_sent():
    for type_first in (True, False):
        part = image_part_json(BIG_PART + 1, type_first=type_first)
        turn = chat_with_parts(part, b'{"type": "text", "text": "after"}')
        assert turn.content == f"<image:{xxhash.xxh64_hexdigest(part)}>\nafter"
        assert turn.parts == ({"type": "image"}, {"type": "text", "text": "after"})


def test_a_media_part_up_to_16_kib_stands_in_by_its_canonical_json():
    for size in (BIG_PART, BIG_PART - 1):
        part = image_part_json(size)
        assert len(part) == size
        turn = chat_with_parts(part)
        assert turn.content == media_stand_in("image", json.loads(part))
        assert turn.content == chat_with_parts(image_part_json(size, type_first=False)).content


def test_large_parts_that_are_not_media_are_decoded_as_they_are():
    text = "t" * (BIG_PART + 10)
    assert chat_with_parts(json.dumps({"type": "text", "text": text}).encode()).content == text
    assert chat_with_parts(json.dumps(text).encode()).content == text  # a bare string part
    later_type = json.dumps({"text": text, "type": "text"}).encode()
    assert chat_with_parts(later_type).content == text
    # a part whose type is not a string is media of unknown kind, by its canonical JSON
    odd = {"type": ["image_url"], "data": "d" * BIG_PART}
    assert chat_with_parts(json.dumps(odd).encode()).content == media_stand_in("media", odd)
    other = {"type": {"k": 1}, "data": "d" * BIG_PART}
    assert chat_with_parts(json.dumps(other).encode()).content == media_stand_in("media", other)


def test_a_large_part_that_is_not_an_object_or_string_is_refused():
    rejected = refused(
        CHAT_PATH,
        b'{"model": "m", "messages": [{"role": "user", "content": [['
        + b"1, " * BIG_PART
        + b"1]]}]}",
    )
    assert rejected.message == "messages[0].content parts must be objects or strings"


def anthropic_image_json(size: int, *, type_first: bool = True) -> bytes:
    source = b'"source": {"type": "base64", "media_type": "image/png", "data": "'
    if type_first:
        head, tail = b'{"type": "image", ' + source, b'"}}'
    else:
        head, tail = b"{" + source, b'"}, "type": "image"}'
    return head + b"A" * (size - len(head) - len(tail)) + tail


def anthropic_turn(*blocks: bytes, size: int | None = None) -> bytes:
    """A user turn of these blocks, padded by a text block to `size` bytes."""
    body = b'{"role": "user", "content": [' + b", ".join(blocks)
    if size is None:
        return body + b"]}"
    pad = b', {"type": "text", "text": "'
    return body + pad + b"p" * (size - len(body) - len(pad) - 4) + b'"}]}'


def anthropic(turn: bytes):
    raw = b'{"model": "m", "max_tokens": 1, "messages": [' + turn + b"]}"
    return parse_request(MESSAGES_PATH, raw, {}).prompt.messages


def test_an_anthropic_image_up_to_16_kib_stands_in_by_its_source():
    for size in (BIG_PART, BIG_PART - 1):
        blocks = [anthropic_image_json(size, type_first=first) for first in (True, False)]
        assert all(len(b) == size for b in blocks)
        first, second = (anthropic(anthropic_turn(b, size=3 * BIG_PART))[0] for b in blocks)
        assert first.content == second.content and first.content.startswith("<image:")


def test_a_large_anthropic_image_stands_in_by_the_hash_of_its_json_as_sent():
    for type_first in (True, False):
        block = anthropic_image_json(BIG_PART + 1, type_first=type_first)
        (message,) = anthropic(anthropic_turn(block, b'{"type": "text", "text": "why"}'))
        assert message.content == f"<image:{xxhash.xxh64_hexdigest(block)}>\nwhy"
        assert message.role == "user"
        assert message.parts == ({"type": "image"}, {"type": "text", "text": "why"})


def test_a_large_anthropic_turn_of_text_is_kept_as_text():
    text = "q" * (BIG_PART + 10)
    (message,) = anthropic(json.dumps({"role": "user", "content": text}).encode())
    assert (message.role, message.content) == ("user", text)
    (message,) = anthropic(json.dumps({"role": "assistant", "content": text}).encode())
    assert (message.role, message.content) == ("assistant", text)


def test_an_image_in_the_long_tail_of_a_conversation_counts_as_its_stand_in():
    """A conversation of several MiB is cut from a window and its tail measured: a base64
    image there changes the estimate by its stand-in, not by turns its bytes would make."""
    turns = [{"role": "user", "content": f"turn {i} " + "w" * 180} for i in range(30_000)]
    url = "data:image/png;base64," + "QUJD" * (1024 * 1024)  # 4 MiB of base64
    estimates = []
    for data in ("data:image/png;base64,QUJD", url):
        late = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}}]}
        body = json.dumps({"model": "m", "messages": [*turns[:25_000], late, *turns[25_000:]]})
        prompt = parse_request(CHAT_PATH, body.encode(), {}).prompt
        assert 0 < len(prompt.messages) < 25_000
        estimates.append(prompt.omitted_tokens)
    small, large = estimates
    # the run `;base64,` + 4 MiB counts as its 24-byte stand-in, where the small image
    # has 12 bytes (`;base64,QUJD`): 12 bytes more, 3 pseudo-tokens
    assert small > 1_000_000 and large - small == 3, (small, large)


def test_an_omitted_media_part_up_to_16_kib_counts_in_full():
    """Only parts over 16 KiB stand in for their bytes in the estimate (smaller ones are
    decoded as any part)."""
    text = {"type": "text", "text": "y" * 100}
    for size, counted in ((BIG_PART, BIG_PART), (BIG_PART + 1, 24)):
        part = image_part_json(size)
        late = b'{"role": "user", "content": [' + part + b", " + compact(text) + b"]}"
        raw = b'{"model": "m", "messages": [' + compact(turn(16_000)) + b", " + late + b"]}"
        prompt = parse_request(CHAT_PATH, raw, {}, max_prompt_tokens=CAP).prompt
        omitted_bytes = len(late) - size + counted - 12
        assert prompt.omitted_tokens == -(-omitted_bytes // 4), size


@pytest.mark.parametrize("path", [CHAT_PATH, MESSAGES_PATH])
@pytest.mark.parametrize("first", [200, 300, 600, 700])
def test_a_conversation_cut_from_a_window_keeps_the_head_and_estimate_of_splitting_it(
    monkeypatch, path, first
):
    """Past 4 x its byte budget a list is cut from a window of its first bytes and its
    tail measured undecoded: with one turn left past the head, the same turns and the
    same estimate, to the pseudo-token, as splitting the whole list (sizes 300-303 cover
    every rounding of bytes / 4)."""
    for last in (300, 301, 302, 303):
        turns = [turn(first), turn(last, "assistant")]
        assert len(compact(turns)) > 4 * 80  # a cap of 10 reads 80 bytes
        windowed = chat(turns, 10, path)
        monkeypatch.setattr(heads_module, "_WINDOWED", 10**9)  # split all of it
        whole = chat(turns, 10, path)
        monkeypatch.undo()
        assert windowed.messages == whole.messages and len(whole.messages) == 1
        assert type(windowed.omitted_tokens) is int
        assert windowed.omitted_tokens == whole.omitted_tokens == -(-(last - 12) // 4)


def test_a_list_up_to_4_budgets_is_split_whole_and_counted_exactly():
    """A cap of 10 reads 80 bytes: a list of 320 bytes is split into turns, its rest
    counted turn by turn (a window's tail would be measured: 49, not 48)."""
    turns = [turn(100), turn(108, "assistant"), turn(108)]
    assert len(compact(turns)) == 320
    assert chat(turns, 10).omitted_tokens == (216 - 2 * 12) // 4


def test_a_first_turn_past_half_the_list_leaves_no_cut_and_the_list_is_split_whole():
    """Windows are searched below half the list: a first turn of 700 bytes in 855 (or
    in exactly 1280, twice the last window) leaves no cut in them, so the list is split
    whole and its rest counted exactly."""
    turns = [turn(700), turn(50, "assistant"), turn(50), turn(50, "assistant")]
    assert len(compact(turns)) == 855
    prompt = chat(turns, 10)
    assert len(prompt.messages) == 1 and prompt.omitted_tokens == -(-(150 - 3 * 12) // 4)
    turns = [turn(700), *[turn(50, "assistant")] * 10, turn(67)]
    assert len(compact(turns)) == 1280
    prompt = chat(turns, 10)
    assert len(prompt.messages) == 1 and prompt.omitted_tokens == -(-(567 - 11 * 12) // 4)


def test_a_tail_cut_in_the_last_window_is_measured_at_the_heads_mean_turn_size():
    """A cap of 10 reads 80 bytes: windows go up to 8 x 80 = 640 bytes, the last one
    spans 640-1280, where the first turn (700 bytes) ends. The 12 turns after it are
    measured, not split: 611 bytes with their commas, as many turns as 611 bytes make at
    the head's mean turn size (700: at least one)."""
    turns = [turn(700), *[turn(50, "assistant")] * 12]
    assert len(compact(turns)) == 1314
    prompt = chat(turns, 10)
    assert len(prompt.messages) == 1 and prompt.omitted_tokens == -(-(611 - 12) // 4)
    # a `},` inside the first turn's text, in the window too, is no cut: the next is
    text = turns[0]["content"]
    turns[0] = {"role": "user", "content": text[:630] + "}," + text[632:]}
    assert compact(turns).find(b"},") == 657
    assert chat(turns, 10).omitted_tokens == -(-(611 - 12) // 4)


# A conversation of 73 KB with a cap of 1000 (8,000 bytes read): its first turn (40,000
# bytes) ends in the window of 32,000-64,000 bytes; the 500 turns after it are measured
# as one turn at the head's mean size when that cut is found (8872), or counted turn by
# turn when the list is split whole (7250).
TAIL_TURNS = b",".join(compact({"role": "assistant", "content": "y" * 37}) for _ in range(500))
CUT_FOUND = -(-(len(TAIL_TURNS) - 12) // 4)


def long_first_turn(filler: bytes, extra: bytes = b"") -> bytes:
    head, end = b'{"role":"user","content":"', b'"' + extra + b"}"
    pad = 40_000 - len(head) - len(end) - len(filler) - 100
    return head + b"x" * pad + filler + b"x" * 100 + end


def cut_estimate(first: bytes, comma: bytes = b",") -> int:
    raw = b'{"model":"m","messages":[' + first + comma + TAIL_TURNS + b"]}"
    prompt = parse_request(CHAT_PATH, raw, {}, max_prompt_tokens=1000).prompt
    assert len(prompt.messages) == 1
    return prompt.omitted_tokens


def test_the_cut_after_a_turn_ending_in_a_nested_object_is_found():
    assert len(long_first_turn(b"")) == 40_000 and len(TAIL_TURNS) == 35_499
    assert cut_estimate(long_first_turn(b"")) == CUT_FOUND == 8872
    assert cut_estimate(long_first_turn(b"", b',"meta":{"a":{}}')) == CUT_FOUND
    assert cut_estimate(long_first_turn(b""), b" \n\t ,") == CUT_FOUND


def test_a_comma_further_than_16_bytes_after_a_brace_is_not_looked_for():
    """The cut is then after the next turn: the first tail turn (70 bytes) is counted
    exactly and the rest measured (35,428 bytes, one turn at the mean of 40,070 / 2)."""
    estimate = cut_estimate(long_first_turn(b""), b" " * 16 + b",")
    assert estimate == -(-(70 + 35_428 - 2 * 12) // 4) == 8869
    assert cut_estimate(long_first_turn(b""), b" " * 15 + b",") == CUT_FOUND


def test_a_window_tries_16_candidate_cuts():
    """`},` inside a string is no cut: the window tries 16 of them, then gives up (the
    list is then split whole and counted turn by turn)."""
    assert cut_estimate(long_first_turn(b"},x" * 15)) == CUT_FOUND
    whole = cut_estimate(long_first_turn(b"},x" * 16))
    assert whole == -(-(len(TAIL_TURNS) - 499 - 500 * 12) // 4) == 7250


def test_a_window_checks_4096_braces():
    assert cut_estimate(long_first_turn(b"}" * 4095)) == CUT_FOUND
    assert cut_estimate(long_first_turn(b"}" * 4096)) == 7250


def test_a_window_whose_turns_just_reach_the_budget_is_the_cut():
    """A first turn of exactly 80 bytes (a cap of 10) ends the head: the 300-byte turn
    after it is measured at the head's mean turn size (80 bytes: 3 turns), not split."""
    prompt = chat([turn(80), turn(300, "assistant")], 10)
    assert len(prompt.messages) == 1 and prompt.omitted_tokens == -(-(300 - 3 * 12) // 4)


def test_an_image_that_leaves_the_window_short_of_the_budget_widens_the_window():
    """A cap of 1000 reads 8,000 bytes. The first cut (after a 20 KB turn that is mostly an
    image, 130 bytes once the image counts as its stand-in) is short of that: the window
    widens to 32,000-64,000 bytes and cuts after the third turn. Kept: the image turn and
    the next (10,130 bytes); counted: the third turn (10,000) and the 30 measured turns
    after it (30,029 bytes; 2 turns at the head's mean of 13,374)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 20_000}}
    first = {"role": "user", "content": [{"type": "text", "text": "see"}, image]}
    turns = [first, turn(10_000, "assistant"), turn(10_000), *[turn(1000, "assistant")] * 30]
    assert len(compact(first)) == 20_122 and len(compact(turns)) == 70_156
    prompt = chat(turns, 1000)
    assert len(prompt.messages) == 2 and type(prompt.omitted_tokens) is int
    assert prompt.omitted_tokens == -(-(10_000 + 30_029 - 3 * 12) // 4)


def test_a_cut_needs_its_brace_and_comma_in_one_window():
    """A first turn of 159 bytes (cap 10: windows 80-160, 160-320, 320-640) ends on the
    last byte of the first window, its comma starts the second: neither window holds a
    cut, the 500-byte turn after it ends past them, so the list is split whole."""
    turns = [turn(159), turn(500, "assistant"), turn(300)]
    assert compact(turns).find(b"},") == 159 and len(compact(turns)) == 963
    prompt = chat(turns, 10)
    assert len(prompt.messages) == 1 and prompt.omitted_tokens == (800 - 2 * 12) // 4


def test_a_list_within_the_head_budget_is_all_head_as_the_full_split_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """head_of_list's shortcut for lists of at most `budget` bytes answers what splitting
    them answers: the whole list and nothing omitted, or the same refusal (an empty list,
    whitespace inside, not a list, elements of any shape, media parts)."""
    import random as _random

    import msgspec

    from epp.request import heads
    from epp.request.types import RequestRejected

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}}
    elements = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "x" * 300}]},
        {"role": "user", "content": [image, image]},
        1,
        "s",
        None,
        [],
    ]
    rng = _random.Random(3)
    bodies = [b"[]", b"[ ]", b"[\n\t ]", b"[" + b" " * 100 + b"]", b"{}", b'"x"', b"3"]
    for _ in range(300):
        chosen = [rng.choice(elements) for _ in range(rng.randint(1, 6))]
        separators = rng.choice([(",", ":"), (" , ", " : "), (",\n ", ": ")])
        bodies.append(json.dumps(chosen, separators=separators).encode())
    bodies.append(b"[" + b" " * 100 + b'{"role": "user", "content": "late"}]')

    def answer(raw: bytes, max_tokens: int) -> object:
        try:
            head, omitted = heads.head_of_list(msgspec.Raw(raw), max_tokens, "messages", "x")
        except RequestRejected as exc:
            return ("refused", str(exc))
        return (bytes(head), omitted)

    shortcut_taken = 0
    for raw in bodies:
        for max_tokens in (-(-len(raw) // 8), 10**6):  # budgets of 8 bytes a token >= len
            with monkeypatch.context() as patched:
                patched.setattr(heads, "_opens_a_non_empty_list", lambda _raw: False)
                full = answer(raw, max_tokens)
            shortcut_taken += heads._opens_a_non_empty_list(msgspec.Raw(raw))
            assert answer(raw, max_tokens) == full, (raw, max_tokens)
    assert shortcut_taken > 400  # most bodies here are lists the shortcut takes
