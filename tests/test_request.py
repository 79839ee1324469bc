from __future__ import annotations

import json

import pytest

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
