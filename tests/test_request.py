from __future__ import annotations

import json

import pytest

from epp.conversation import media_stand_in
from epp.request import RequestRejected, parse_request

ADAPTERS = {"sql-lora": "base"}


def parse(path: str, body: object):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(path, raw, ADAPTERS)


def test_completion_prompt_forms():
    assert parse("/v1/completions", {"model": "base", "prompt": "hi"}).prompt.text == "hi"
    assert parse("/v1/completions", {"model": "base", "prompt": ["a", "b"]}).prompt.text == "a"
    assert list(parse("/v1/completions", {"model": "base", "prompt": [1, 2]}).prompt.token_ids) == [
        1,
        2,
    ]
    assert list(
        parse("/v1/completions", {"model": "base", "prompt": [[3], [4]]}).prompt.token_ids
    ) == [3]


def test_chat_with_string_and_parts_content():
    body = {
        "model": "base",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        "stream": True,
        "cache_salt": "tenant",
    }
    req = parse("/v1/chat/completions", body)
    assert [m.content for m in req.prompt.messages] == ["be brief", "a\nb", ""]
    assert req.stream and req.cache_salt == "tenant" and req.kind == "chat"


def test_adapter_resolves_to_base_model():
    req = parse("/v1/completions", {"model": "sql-lora", "prompt": "x"})
    assert (req.model, req.base_model, req.adapter) == ("sql-lora", "base", "sql-lora")
    req = parse("/v1/completions", {"model": "base", "prompt": "x"})
    assert req.adapter is None and req.base_model == "base"


def test_query_string_and_trailing_slash_do_not_change_kind():
    assert parse("/v1/completions/?x=1", {"model": "m", "prompt": "p"}).kind == "completion"


def test_other_paths_and_bodiless_requests_route_without_prompt():
    req = parse_request("/v1/models", b"", ADAPTERS)
    assert req.kind == "other" and req.model is None
    req = parse("/v1/embeddings", {"model": "base", "input": "x"})
    assert req.kind == "other" and req.model == "base"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", b"\xff\xfe", None),
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", b"", None),
        ("/v1/completions", b"[" * 200_000, None),
        ("/v1/completions", {"prompt": "x"}, "model"),
        ("/v1/completions", {"model": 7, "prompt": "x"}, "model"),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": 5}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [-1]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [True]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"model": "m", "prompt": "x", "cache_salt": 1}, "cache_salt"),
        ("/v1/chat/completions", {"model": "m"}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": ["hi"]}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"content": "x"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "u", "content": 3}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "u", "content": [1]}]},
            "messages",
        ),
    ],
)
def test_malformed_requests_are_400_with_openai_error(path, body, param):
    with pytest.raises(RequestRejected) as err:
        parse(path, body)
    rejected = err.value
    assert rejected.status == 400
    payload = json.loads(rejected.body())
    assert payload["error"]["code"] == 400 and payload["error"]["type"] == "BadRequestError"
    assert payload["error"]["param"] == param
    assert payload["error"]["message"]


def _random_json(rng, depth=0):
    kinds = ["str", "int", "float", "bool", "null", "list", "dict"] if depth < 4 else ["str", "int"]
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('ab \u00e9\U0001f600\\"') for _ in range(rng.randrange(6)))
    if kind == "int":
        return rng.choice([0, -1, 2**40, 7])
    if kind == "float":
        return rng.choice([0.5, -1e308, float("1e-9")])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = [
        "model",
        "prompt",
        "messages",
        "role",
        "content",
        "type",
        "text",
        "stream",
        "cache_salt",
    ]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/other"])
def test_random_bodies_are_parsed_or_rejected_never_crash(path):
    import random

    rng = random.Random(path)
    outcomes = set()
    for _ in range(3000):
        value = _random_json(rng)
        raw = json.dumps(value).encode()
        if rng.random() < 0.2:
            cut = rng.randrange(len(raw) + 1)
            raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut:]
        try:
            parse_request(path, raw, ADAPTERS)
            outcomes.add("parsed")
        except RequestRejected as rejected:
            assert rejected.status == 400 and json.loads(rejected.body())["error"]["message"]
            outcomes.add("rejected")
    assert "rejected" in outcomes


# -- hostile input: a 400 with a clear message, never another exception ----------------

CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (COMPLETION, rb'{"model": "\ud800", "prompt": "x"}'),
        (COMPLETION, rb'{"model": "m\udc00", "prompt": "x"}'),
        (COMPLETION, rb'{"model": "m", "prompt": "x", "cache_salt": "\ud800"}'),
        (COMPLETION, rb'{"model": "m", "prompt": "a\udbffb"}'),
        (COMPLETION, rb'{"model": "m", "prompt": ["\ud800"]}'),
        (CHAT, rb'{"model": "m", "messages": [{"role": "\ud800", "content": "x"}]}'),
        (CHAT, rb'{"model": "m", "messages": [{"role": "u", "content": "x\udfff"}]}'),
        (
            CHAT,
            rb'{"model":"m","messages":[{"role":"u","content":[{"type":"text","text":"\ud800"}]}]}',
        ),
        (CHAT, rb'{"model": "m", "messages": [{"role": "u", "content": "x"}], "user": "\ud800"}'),
    ],
)
def test_unpaired_surrogates_anywhere_are_a_400_naming_the_cause(path, raw):
    with pytest.raises(RequestRejected) as err:
        parse_request(path, raw, ADAPTERS)
    assert err.value.status == 400 and err.value.reason == "invalid-json"
    assert "surrogate" in err.value.message
    json.loads(err.value.body())  # the answer itself encodes


def test_paired_surrogates_are_one_character():
    req = parse_request(COMPLETION, rb'{"model": "m\ud83d\ude00", "prompt": "x"}', ADAPTERS)
    assert req.model == "m\U0001f600"


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        (COMPLETION, b'{"model": "m", "prompt": "x", "temperature": NaN}', None),
        (COMPLETION, b'{"model": "m", "prompt": "x", "temperature": Infinity}', None),
        (COMPLETION, b'{"model": 1e999, "prompt": "x"}', None),
        (COMPLETION, b'{"model": "m", "prompt": [' + b"9" * 5000 + b"]}", "prompt"),
        (COMPLETION, b'{"model": "m", "prompt": [1, ' + b"9" * 30 + b"]}", "prompt"),
        (COMPLETION, b'{"model": "m", "prompt": [[1], [2, -1]]}', "prompt"),
        (COMPLETION, b'{"model": "m", "prompt": [[1], 2]}', "prompt"),
        (COMPLETION, b'{"model": "m", "prompt": [1.5]}', "prompt"),
        (COMPLETION, b'{"model": "m", "prompt": ["a", 1]}', "prompt"),
        (COMPLETION, b'{"model": "m", "prompt": []}', "prompt"),
        (COMPLETION, b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
        (CHAT, b'{"model": "m", "messages": {"role": "u"}}', "messages"),
        (CHAT, b'{"model": "m", "messages": [null]}', "messages"),
        (CHAT, b'{"model": "m", "messages": [{"role": "", "content": "x"}]}', "messages"),
        (CHAT, b'{"model": "m", "messages": [{"role": "u", "content": {"a": 1}}]}', "messages"),
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "u", "content": [{"type": "text"}]}]}',
            "messages",
        ),
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "u", "content": "x"}], "stream": null}',
            "stream",
        ),
        (CHAT, b'{"model": "m", "messages": [' + b"[" * 5000 + b"]" * 5000 + b"]}", None),
        (CHAT, b'{"model": "m", "messages": [{"role": "u", "content": "x"}]} trailing', None),
    ],
)
def test_hostile_bodies_are_a_400(path, raw, param):
    with pytest.raises(RequestRejected) as err:
        parse_request(path, raw, ADAPTERS)
    assert err.value.status == 400 and err.value.param == param and err.value.message


def test_unknown_fields_are_skipped_whatever_they_hold():
    raw = (
        b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b', "tools": '
        b'[{"a": [[[{"b": null}]]]}], "logit_bias": {"1": -100}}'
    )
    assert parse_request(COMPLETION, raw, ADAPTERS).prompt.text == "x"


def test_media_parts_stand_in_by_their_json_hash_and_accept_bytearray_bodies():
    part = {"type": "image_url", "image_url": {"url": "data:x", "detail": "é"}}
    other = {"type": "image_url", "image_url": {"url": "data:y"}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}],
    }
    req = parse_request(CHAT, bytearray(json.dumps(body).encode()), ADAPTERS)
    message = req.prompt.messages[0]
    # vLLM puts media placeholders before the text: a stand-in per part, by its JSON hash.
    assert message.content == media_stand_in("image", part) + "\nlook"
    assert message.content.startswith("<image:") and media_stand_in(
        "image", other
    ) != media_stand_in("image", part)
    assert message.parts == ({"type": "text", "text": "look"}, {"type": "image"})


def test_everything_accepted_can_be_encoded_downstream():
    """What parse_request accepts never makes hashing, tokenizing or a metric label fail."""
    import random

    from epp.observability.metrics import EppMetrics
    from epp.prefix.blocks import prompt_blocks
    from epp.prefix.hashing import chain_seed
    from epp.tokenize import ByteEstimateTokenizer

    pieces = ['"\\ud800"', '"\\udfff"', '"\\ud83d\\ude00"', '"\\u0000"', '"\xc3\xa9"', '"x"']
    pieces += ["NaN", "1e999", "9" * 400, "-1", "true", "null", "[]", "{}", '[1, "a"]']
    rng = random.Random(7)
    metrics = EppMetrics()
    tokenizer = ByteEstimateTokenizer()
    accepted = 0
    for _ in range(2000):
        value = lambda: rng.choice(pieces)  # noqa: E731
        model, salt, role, content, prompt = (value() for _ in range(5))
        if rng.random() < 0.5:
            path = COMPLETION
            raw = f'{{"model": {model}, "prompt": {prompt}, "cache_salt": {salt}}}'
        else:
            path = CHAT
            raw = f'{{"model": {model}, "messages": [{{"role": {role}, "content": {content}}}]}}'
        try:
            req = parse_request(path, raw.encode("utf-8", "surrogatepass"), ADAPTERS)
        except RequestRejected as rejected:
            assert rejected.status == 400
            continue
        accepted += 1
        seed = chain_seed(req.model or "", req.adapter, req.cache_salt)
        prompt_blocks(req.prompt, tokenizer, 4, seed, max_blocks=8)
        metrics.decisions.labels(req.model or "", "routed").inc()
        json.dumps({"model": req.model, "salt": req.cache_salt}).encode()
    assert accepted
    metrics.exposition()


# -- bounded work: only the head of a huge prompt is decoded, the rest counted ----------


def test_a_huge_token_id_prompt_keeps_its_head_and_counts_the_rest():
    ids = [(i * 7919) % 100_000 for i in range(50_000)]
    raw = json.dumps({"model": "m", "prompt": ids}).replace(",", " , ").encode()
    req = parse_request(COMPLETION, raw, ADAPTERS, max_prompt_tokens=1000)
    assert list(req.prompt.token_ids) == ids[:1000]
    assert req.prompt.omitted_tokens == 49_000
    full = parse_request(COMPLETION, raw, ADAPTERS, max_prompt_tokens=10**9)
    assert list(full.prompt.token_ids) == ids and full.prompt.omitted_tokens == 0


@pytest.mark.parametrize("tail", ['"x"', "[1]", '{"a": 1}'])
def test_a_token_id_tail_that_is_not_numbers_is_a_400(tail):
    raw = ('{"model": "m", "prompt": [' + "1, " * 5000 + tail + "]}").encode()
    with pytest.raises(RequestRejected) as err:
        parse_request(COMPLETION, raw, ADAPTERS, max_prompt_tokens=100)
    assert err.value.param == "prompt"


def test_a_huge_conversation_keeps_its_first_turns_and_estimates_the_rest():
    from epp.prefix.blocks import prompt_blocks
    from epp.tokenize import ByteEstimateTokenizer

    turns = [{"role": "user", "content": f"turn {i} " + "x" * 50} for i in range(20_000)]
    raw = json.dumps({"model": "m", "messages": turns}).encode()
    head = parse_request(CHAT, raw, ADAPTERS, max_prompt_tokens=2000).prompt
    full = parse_request(CHAT, raw, ADAPTERS, max_prompt_tokens=10**9).prompt
    assert len(full.messages) == 20_000 and full.omitted_tokens == 0
    assert 0 < len(head.messages) < 1000 and head.messages == full.messages[: len(head.messages)]
    tok = ByteEstimateTokenizer()
    cut = prompt_blocks(head, tok, 16, 1, max_blocks=100)
    whole = prompt_blocks(full, tok, 16, 1, max_blocks=100)
    assert cut.hashes == whole.hashes
    assert abs(cut.prompt_tokens - whole.prompt_tokens) / whole.prompt_tokens < 0.15
