"""What a client and an operator see of request parsing: the OpenAI-style error body of
every refusal (status, type, param, message, reason), the route kinds, the defaults and
checks of each field the scheduler reads, and the model rewrite of `with_model`."""

from __future__ import annotations

import json

import pytest

from epp.request import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    MESSAGES_PATH,
    RequestRejected,
    kind_of,
    parse_request,
    with_model,
)

ADAPTERS = {"sql-lora": "base"}
TURN = [{"role": "user", "content": "x"}]


def parse(path: str, body: object):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(path, raw, ADAPTERS)


def refusal(path: str, body: object) -> RequestRejected:
    with pytest.raises(RequestRejected) as refused:
        parse(path, body)
    return refused.value


# -- the error body a client reads ------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "BadRequestError"),
        (404, "NotFoundError"),
        (413, "RequestTooLargeError"),
        (429, "RateLimitError"),
        (503, "ServiceUnavailableError"),
        (500, "InternalServerError"),
        (502, "InternalServerError"),
    ],
)
def test_the_error_body_is_openai_shaped_with_the_type_of_its_status(status, error_type):
    rejected = RequestRejected(status, "why", reason="r", param="p", retry_after_s=2.5)
    assert json.loads(rejected.body()) == {
        "error": {"message": "why", "type": error_type, "param": "p", "code": status}
    }
    assert (rejected.status, rejected.message, rejected.reason) == (status, "why", "r")
    assert (rejected.param, rejected.retry_after_s, str(rejected)) == ("p", 2.5, "why")


def test_a_refusal_has_no_param_and_no_retry_after_unless_given():
    rejected = RequestRejected(400, "why", reason="r")
    assert rejected.param is None and rejected.retry_after_s is None
    assert json.loads(rejected.body())["error"]["param"] is None


def test_a_parse_refusal_is_a_400_invalid_request_naming_its_field():
    rejected = refusal(COMPLETIONS_PATH, {"model": "m", "prompt": "x", "stream": "yes"})
    assert (rejected.status, rejected.reason, rejected.param) == (400, "invalid-request", "stream")
    assert json.loads(rejected.body()) == {
        "error": {
            "message": "'stream' must be a boolean",
            "type": "BadRequestError",
            "param": "stream",
            "code": 400,
        }
    }


# -- which requests are routed as prompts -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/completions", "completion"),
        ("/v1/completions/", "completion"),
        ("/v1/completions?stream=1", "completion"),
        ("/v1/completions/?a=1?b=2", "completion"),
        ("/v1/chat/completions", "chat"),
        ("/v1/chat/completions/", "chat"),
        ("/v1/chat/completions?x=/v1/completions", "chat"),
        ("/v1/messages", "messages"),
        ("/v1/messages/?beta=true", "messages"),
        ("v1/completions", "other"),
        ("//v1/completions", "other"),
        ("/v1/models", "other"),
        ("?/v1/completions", "other"),
        ("/v1/completionsX", "other"),
        ("/v1/messagesX/", "other"),
        ("/v1/chat/completions ", "other"),
    ],
)
def test_the_route_kind_is_the_path_without_its_query_and_trailing_slash(path, kind):
    assert kind_of(path) == kind


def test_each_route_parses_its_own_prompt():
    completion = parse("/v1/completions?x=1", {"model": "m", "prompt": "p"})
    assert (completion.kind, completion.prompt.text) == ("completion", "p")
    chat = parse("/v1/chat/completions/", {"model": "m", "messages": TURN})
    assert chat.kind == "chat" and chat.prompt.messages[0].content == "x"
    assert chat.prompt.chat is not None and chat.prompt.chat.source == "openai"
    messages = parse(MESSAGES_PATH, {"model": "m", "messages": TURN, "max_tokens": 1})
    assert messages.kind == "messages" and messages.prompt.chat.source == "anthropic"


def test_a_bodiless_request_on_another_route_is_routed_without_prompt():
    req = parse_request("/v1/models", b"", ADAPTERS)
    assert req == parse_request("/v1/models", b"", {})
    assert (req.kind, req.model, req.base_model, req.adapter) == ("other", None, None, None)
    assert req.prompt.text is None and req.prompt.messages is None
    assert req.prompt.token_ids is None and req.prompt.omitted_tokens == 0
    assert req.stream is False and req.cache_salt is None


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH, MESSAGES_PATH])
def test_a_bodiless_prompt_request_is_refused(path):
    with pytest.raises(
        RequestRejected, match=r"^the request has no body; expected a JSON object$"
    ) as refused:
        parse_request(path, b"", ADAPTERS)
    assert refused.value.reason == "invalid-request" and refused.value.param is None


def test_another_route_needs_no_model_but_a_model_it_has_is_a_string():
    assert parse("/v1/embeddings", {"input": "x"}).model is None
    assert parse("/v1/embeddings", {"model": ""}).model == ""
    req = parse("/v1/embeddings", {"model": "sql-lora", "input": "x"})
    assert (req.kind, req.model, req.base_model, req.adapter) == (
        "other",
        "sql-lora",
        "base",
        "sql-lora",
    )
    rejected = refusal("/v1/embeddings", {"model": 7})
    assert (rejected.message, rejected.param) == ("'model' must be a string", "model")


@pytest.mark.parametrize("model", [None, "", 7, ["m"]])
@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH, MESSAGES_PATH])
def test_a_prompt_request_needs_a_non_empty_string_model(path, model):
    body = {"prompt": "x", "messages": TURN}
    if model is not None:
        body["model"] = model
    rejected = refusal(path, body)
    assert (rejected.message, rejected.param) == ("the request needs a string 'model'", "model")


# -- the body as a whole -----------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"x"', b"3", b"null"])
def test_a_body_that_is_not_an_object_is_refused_as_such(raw):
    with pytest.raises(RequestRejected, match=r"^the body must be a JSON object$") as refused:
        parse_request(COMPLETIONS_PATH, raw, ADAPTERS)
    assert refused.value.reason == "invalid-request" and refused.value.param is None


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"{not json", "JSON is malformed: object keys must be strings (byte 1)"),
        (b'{"model": "m", "prompt": "x"} trailing', "JSON is malformed: trailing characters"),
        (b'{"model": 1e999, "prompt": "x"}', "Number out of range - at `$.model`"),
    ],
)
def test_a_body_that_is_not_json_is_refused_with_the_decoder_error(raw, detail):
    with pytest.raises(RequestRejected) as refused:
        parse_request(COMPLETIONS_PATH, raw, ADAPTERS)
    assert refused.value.message.startswith("the body is not valid JSON: " + detail)
    assert refused.value.reason == "invalid-json" and refused.value.param is None
    assert "surrogate" not in refused.value.message


@pytest.mark.parametrize("field", ["documents", "tools"])
def test_a_number_out_of_range_in_a_template_setting_is_refused_as_invalid_json(field):
    """Settings are checked as JSON when the body is decoded and read later: a number
    out of float range there is found then, and refused as the body's."""
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "%s": [1e999]}' % (
        field.encode()
    )
    with pytest.raises(RequestRejected) as refused:
        parse_request(CHAT_PATH, raw, ADAPTERS)
    rejected = refused.value
    assert rejected.message.startswith("the body is not valid JSON: Number out of range")
    assert (rejected.status, rejected.reason, rejected.param) == (400, "invalid-json", None)


def test_an_unpaired_surrogate_is_named_as_the_cause():
    raw = rb'{"model": "m", "prompt": "a\ud800b"}'
    with pytest.raises(RequestRejected) as refused:
        parse_request(COMPLETIONS_PATH, raw, ADAPTERS)
    assert refused.value.message.startswith("the body is not valid JSON: ")
    assert refused.value.message.endswith(
        " (strings must be valid Unicode: an unpaired UTF-16 surrogate escape such as"
        " \\ud800 is not allowed)"
    )
    assert refused.value.reason == "invalid-json"


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        (COMPLETIONS_PATH, b'{"model": "m", "prompt": "x", "n": ' + b"[" * 200_000 + b"}"),
        (
            CHAT_PATH,
            b'{"model":"m","messages":[{"role":"user","content":['
            + b"[" * 5000
            + b"]" * 5000
            + b"]}]}",
        ),
        (
            CHAT_PATH,
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":['
            + b"[" * 5000
            + b"]" * 5000
            + b"]}",
        ),
        (
            MESSAGES_PATH,
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"system":['
            + b"[" * 5000
            + b"]" * 5000
            + b"]}",
        ),
    ],
)
def test_a_body_nested_too_deeply_is_a_400_not_a_recursion_error(path, raw):
    with pytest.raises(RequestRejected) as refused:
        parse_request(path, raw, ADAPTERS)
    rejected = refused.value
    assert (rejected.status, rejected.reason, rejected.param) == (400, "invalid-json", None)
    assert rejected.message == "the body is nested too deeply to parse"


# -- the fields the scheduler reads --------------------------------------------------------


def test_stream_defaults_to_false_and_is_kept_as_sent():
    assert parse(COMPLETIONS_PATH, {"model": "m", "prompt": "x"}).stream is False
    assert parse(COMPLETIONS_PATH, {"model": "m", "prompt": "x", "stream": False}).stream is False
    assert parse(COMPLETIONS_PATH, {"model": "m", "prompt": "x", "stream": True}).stream is True


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("stream", "yes", "'stream' must be a boolean"),
        ("stream", None, "'stream' must be a boolean"),
        ("cache_salt", 1, "'cache_salt' must be a string"),
        ("cache_salt", ["a"], "'cache_salt' must be a string"),
    ],
)
def test_stream_and_cache_salt_of_the_wrong_type_are_named(field, value, message):
    rejected = refusal(COMPLETIONS_PATH, {"model": "m", "prompt": "x", field: value})
    assert (rejected.message, rejected.param, rejected.reason) == (
        message,
        field,
        "invalid-request",
    )


def test_cache_salt_is_kept_and_absent_means_none():
    assert parse(COMPLETIONS_PATH, {"model": "m", "prompt": "x"}).cache_salt is None
    salted = parse(COMPLETIONS_PATH, {"model": "m", "prompt": "x", "cache_salt": "t"})
    assert salted.cache_salt == "t"


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, CHAT_PATH, MESSAGES_PATH])
def test_an_adapter_name_routes_as_its_base_model_on_every_route(path):
    req = parse(path, {"model": "sql-lora", "prompt": "x", "messages": TURN, "stream": True})
    assert (req.model, req.base_model, req.adapter, req.stream) == (
        "sql-lora",
        "base",
        "sql-lora",
        True,
    )
    plain = parse(path, {"model": "other", "prompt": "x", "messages": TURN})
    assert (plain.model, plain.base_model, plain.adapter) == ("other", "other", None)


# -- what the chat template reads besides the messages ------------------------------------


def test_chat_template_settings_default_as_vllm_does():
    chat = parse(CHAT_PATH, {"model": "m", "messages": TURN}).prompt.chat
    assert chat is not None
    assert (chat.add_generation_prompt, chat.continue_final_message) == (True, False)
    assert chat.add_special_tokens is False and chat.source == "openai"
    assert chat.tools is chat.documents is chat.reasoning_effort is chat.chat_template_kwargs
    assert chat.tools is None
    nulls = dict.fromkeys(
        [
            "add_generation_prompt",
            "continue_final_message",
            "add_special_tokens",
            "tools",
            "documents",
            "chat_template_kwargs",
            "reasoning_effort",
        ]
    )
    assert parse(CHAT_PATH, {"model": "m", "messages": TURN, **nulls}).prompt.chat == chat


def test_chat_template_settings_are_kept_as_sent():
    body = {
        "model": "m",
        "messages": TURN,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "add_special_tokens": True,
        "documents": [{"text": "d"}, "e"],
        "reasoning_effort": "high",
        "chat_template_kwargs": {"enable_thinking": True},
    }
    chat = parse(CHAT_PATH, body).prompt.chat
    assert (chat.add_generation_prompt, chat.continue_final_message) == (False, True)
    assert chat.add_special_tokens is True and chat.reasoning_effort == "high"
    assert chat.documents == ({"text": "d"}, "e")
    assert chat.chat_template_kwargs == {"enable_thinking": True}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("add_generation_prompt", 1, "'add_generation_prompt' must be a boolean"),
        ("continue_final_message", "yes", "'continue_final_message' must be a boolean"),
        ("add_special_tokens", 0, "'add_special_tokens' must be a boolean"),
        ("documents", {"a": 1}, "'documents' must be a list"),
        ("reasoning_effort", 1, "'reasoning_effort' must be a string"),
        ("chat_template_kwargs", [1], "'chat_template_kwargs' must be an object"),
        ("tools", [{"type": "function"}], "a tool needs a 'function' object"),
    ],
)
def test_a_chat_template_setting_of_the_wrong_type_is_named(field, value, message):
    rejected = refusal(CHAT_PATH, {"model": "m", "messages": TURN, field: value})
    assert (rejected.message, rejected.param, rejected.reason) == (
        message,
        field,
        "invalid-request",
    )


def test_anthropic_settings_become_the_chat_template_settings():
    body = {
        "model": "m",
        "max_tokens": 1,
        "messages": TURN,
        "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "output_config": {"effort": "low"},
        "chat_template_kwargs": {"k": 1},
        # OpenAI-only settings are not read from an Anthropic body
        "add_generation_prompt": "not read",
        "documents": "not read",
        "reasoning_effort": 5,
    }
    chat = parse(MESSAGES_PATH, body).prompt.chat
    assert chat.source == "anthropic" and chat.reasoning_effort == "low"
    assert chat.tools == (
        {
            "type": "function",
            "function": {"name": "t", "description": None, "parameters": {"type": "object"}},
        },
    )
    assert chat.chat_template_kwargs == {"k": 1}
    assert chat.add_generation_prompt is True and chat.documents is None
    disabled = parse(MESSAGES_PATH, {**body, "thinking": {"type": "disabled"}}).prompt.chat
    assert disabled.reasoning_effort == "none"
    bare = parse(MESSAGES_PATH, {"model": "m", "max_tokens": 1, "messages": TURN}).prompt.chat
    assert (bare.tools, bare.reasoning_effort, bare.chat_template_kwargs) == (None, None, None)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tools", [{"input_schema": {}}], "a tool needs a string 'name'"),
        ("tools", {"name": "t"}, "'tools' must be a list"),
        ("chat_template_kwargs", "k", "'chat_template_kwargs' must be an object"),
    ],
)
def test_an_anthropic_setting_of_the_wrong_type_is_named(field, value, message):
    rejected = refusal(MESSAGES_PATH, {"model": "m", "messages": TURN, field: value})
    assert (rejected.message, rejected.param) == (message, field)


# -- with_model -----------------------------------------------------------------------------


def test_with_model_rewrites_only_the_model():
    body = b'{"model": "a", "prompt": [1, 2], "cache_salt": "s", "n": 1.5}'
    rewritten = with_model(body, "b")
    assert json.loads(rewritten) == {"model": "b", "prompt": [1, 2], "cache_salt": "s", "n": 1.5}
    assert parse_request(COMPLETIONS_PATH, rewritten, {}).model == "b"
    assert json.loads(with_model(b'{"prompt": "x"}', "b")) == {"prompt": "x", "model": "b"}


def test_with_model_refuses_a_body_that_is_not_an_object():
    with pytest.raises(RequestRejected, match=r"^the request body must be a JSON object$") as err:
        with_model(b"[1]", "b")
    assert (err.value.status, err.value.reason, err.value.param) == (400, "invalid-request", None)


def test_at_every_nesting_depth_a_chat_is_parsed_or_refused_never_a_recursion_error():
    """Decoding a turn's parts nests one level less than the whole body but runs deeper in
    the stack: at some depth the body decodes and its parts do not. Every depth around the
    decoder's limit (which depends on the stack) is a content refusal or a 400 naming the
    nesting."""
    outcomes = set()
    for depth in range(700, 1000):
        raw = (
            b'{"model":"m","messages":[{"role":"user","content":['
            + b"[" * depth
            + b"]" * depth
            + b"]}]}"
        )
        with pytest.raises(RequestRejected) as refused:
            parse_request(CHAT_PATH, raw, ADAPTERS)
        rejected = refused.value
        outcomes.add((rejected.message, rejected.reason, rejected.param))
    assert outcomes == {
        ("messages[0].content parts must be objects or strings", "invalid-request", "messages"),
        ("the body is nested too deeply to parse", "invalid-json", None),
    }
