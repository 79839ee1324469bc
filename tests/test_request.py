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
    from epp.tokenization.estimate import ByteEstimateTokenizer

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
    from epp.tokenization.estimate import ByteEstimateTokenizer

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


# -- chat template inputs and Anthropic /v1/messages --------------------------------------
MESSAGES = "/v1/messages"


def test_chat_template_inputs_ride_with_the_messages():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x": 1}}
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "reasoning": "think",
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"b": 2, "a": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "ok"},
        ],
        "tools": [tool],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "documents": [{"title": "t", "text": "d"}],
        "reasoning_effort": "low",
    }
    prompt = parse("/v1/chat/completions", body).prompt
    chat = prompt.chat
    assert chat is not None and chat.source == "openai"
    assert chat.add_generation_prompt is False and chat.reasoning_effort == "low"
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.documents == ({"title": "t", "text": "d"},)
    # vLLM's tool shape: description defaults to None, unknown keys dropped, key order kept
    assert chat.tools == (
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
        },
    )
    user, assistant, tool_turn = prompt.messages
    assert user.extra == {"name": "ann"}
    calls = assistant.extra["tool_calls"]
    assert list(calls[0]["function"]["arguments"].items()) == [
        ("b", 2),
        ("a", 1),
    ]  # decoded, in order
    assert assistant.extra["reasoning"] == assistant.extra["reasoning_content"] == "think"
    assert (assistant.content, assistant.parts) == ("", ())
    assert tool_turn.extra == {"tool_call_id": "1"}


def test_invalid_tool_call_arguments_become_an_empty_object_as_in_vllm():
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{not json"}},
             {"type": "function", "function": {"name": "g", "arguments": "[1]"}}]  # fmt: skip
    body = {"model": "m", "messages": [{"role": "assistant", "tool_calls": calls}]}
    turn = parse("/v1/chat/completions", body).prompt.messages[0]
    assert [c["function"]["arguments"] for c in turn.extra["tool_calls"]] == [{}, {}]


def test_billing_header_line_is_dropped_from_system_turns():
    header = "x-anthropic-billing-header: cc_version=2; cch=9f8e\n"
    body = {"model": "m", "messages": [{"role": "system", "content": header + "You are Claude Code."},
                                       {"role": "user", "content": header + "kept in user turns"}]}  # fmt: skip
    system, user = parse("/v1/chat/completions", body).prompt.messages
    assert system.content == "You are Claude Code."
    assert user.content.startswith("x-anthropic-billing-header")


def test_anthropic_agent_body_becomes_the_chat_vllm_renders():
    body = {
        "model": "claude-ish",
        "max_tokens": 1024,
        "stream": True,
        "cache_salt": "tenant-a",
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=1"},
            {"type": "text", "text": "You are an agent. ", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use tools."},
        ],
        "tools": [{"name": "bash", "description": "Run a command", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "run ls"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "ls it", "signature": "x"},
                                              {"type": "text", "text": "Running."},
                                              {"type": "tool_use", "id": "tu1", "name": "bash", "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                          "content": [{"type": "text", "text": "a.py"}, {"type": "text", "text": "b.py"}]},
                                         {"type": "text", "text": "now cat a.py"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu2", "content": "only a result"}]},
        ],
    }  # fmt: skip
    req = parse(MESSAGES, body)
    assert req.kind == "messages" and req.stream and req.cache_salt == "tenant-a"
    prompt = req.prompt
    assert prompt.chat is not None and prompt.chat.source == "anthropic"
    assert prompt.chat.tools == (
        {
            "type": "function",
            "function": {
                "name": "bash",
                "description": "Run a command",
                "parameters": {"type": "object"},
            },
        },
    )
    roles = [m.role for m in prompt.messages]
    # the tool results come before the user text of their turn; a turn of results only
    # adds no user turn
    assert roles == ["system", "user", "assistant", "tool", "user", "tool"]
    system, user, assistant, result, follow_up, result2 = prompt.messages
    assert system.content == "You are an agent. Use tools."
    assert user.content.startswith("<image:") and user.content.endswith("\nrun ls")
    assert user.parts == ({"type": "text", "text": "run ls"}, {"type": "image"})
    assert assistant.content == "Running." and assistant.parts is None
    assert assistant.extra["reasoning"] == "ls it"
    assert assistant.extra["tool_calls"] == [
        {"id": "tu1", "type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}
    ]
    assert (result.content, result.extra) == ("a.py\nb.py", {"tool_call_id": "tu1"})
    assert follow_up.content == "now cat a.py"
    assert result2.content == "only a result"


def test_anthropic_inline_system_and_thinking_settings():
    body = {"model": "m", "max_tokens": 8, "thinking": {"type": "disabled"},
            "output_config": {"effort": "high"}, "chat_template_kwargs": {"k": 1},
            "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "rule"},
                         {"role": "assistant", "content": []}]}  # fmt: skip
    prompt = parse(MESSAGES, body).prompt
    assert [(m.role, m.content) for m in prompt.messages] == [
        ("user", "a"),
        ("system", "rule"),
        ("assistant", ""),
    ]
    assert prompt.chat.reasoning_effort == "none" and prompt.chat.chat_template_kwargs == {"k": 1}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "max_tokens": 1},
        {"model": "m", "messages": []},
        {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": 5}]},
        {"model": "m", "messages": ["x"]},
        {"model": "m", "messages": [{"role": "user", "content": [1]}]},
        {"model": "m", "system": 5, "messages": [{"role": "user", "content": "x"}]},
        {
            "model": "m",
            "tools": [{"description": "no name"}],
            "messages": [{"role": "user", "content": "x"}],
        },
        {"model": "m", "messages": {"role": "user", "content": "x"}},
        {"messages": [{"role": "user", "content": "x"}]},
    ],
)
def test_hostile_anthropic_bodies_are_a_400(body):
    with pytest.raises(RequestRejected) as refused:
        parse(MESSAGES, body)
    assert refused.value.status == 400


def test_count_tokens_is_not_routed_as_a_prompt():
    assert parse("/v1/messages/count_tokens", {"model": "m", "messages": []}).kind == "other"
