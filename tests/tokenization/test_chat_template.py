"""Chat templates rendered as transformers renders them, and their errors as a 400."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from tokenizer_fixtures import FIXTURES, tokenizer_dir

from epp.prefix.blocks import prompt_blocks
from epp.request import RequestRejected, parse_request
from epp.tokenization import ChatTemplate, HfTokenizer, load_tokenizer_dir
from epp.tokenization.protocol import ChatMessage, ChatOptions, TokenizationError

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
CHAT = "/v1/chat/completions"


def render(source: str, messages: list[dict], **kwargs: object) -> str:
    return ChatTemplate(source).render(messages, special_tokens=SPECIAL, **kwargs)  # type: ignore[arg-type]


def test_environment_matches_transformers() -> None:
    # trim_blocks + lstrip_blocks, loopcontrols, tojson without HTML escaping, in key order
    source = (
        "{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m | tojson }}|{{ m.content | tojson(indent=2) }}\n{% endfor %}{{ bos_token }}"
    )
    got = render(source, [{"role": "user", "content": "<b>é</b>", "z": 1}, {"role": "x"}])
    assert got == '{"role": "user", "content": "<b>é</b>", "z": 1}|"<b>é</b>"\n<s>'


def test_strftime_now_reads_the_given_clock() -> None:
    template = ChatTemplate(
        "{{ strftime_now('%d %b %Y') }}", now=lambda: datetime(2024, 7, 26, 12, 0)
    )
    assert template.render([{"role": "user", "content": "x"}], special_tokens={}) == "26 Jul 2024"


def test_generation_blocks_render_their_body() -> None:
    source = (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert render(source, [{"role": "assistant", "content": "a"}]) == "[a]"


def test_template_raise_exception_is_a_tokenization_error_with_its_message() -> None:
    source = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(TokenizationError, match="roles must alternate"):
        render(source, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m.content | default([]) %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            "openai",
        ),
        ("{{ messages[0].content }}", "string"),
    ],
)
def test_content_format_is_detected_from_the_template(source: str, expected: str) -> None:
    assert ChatTemplate(source).content_format == expected


def test_only_the_kwargs_the_template_names_reach_it() -> None:
    source = "{{ flavour | default('none') }}/{{ tokenize | default('absent') }}"
    got = render(
        source,
        [{"role": "u", "content": ""}],
        kwargs={"flavour": "x", "tokenize": True, "other": 1},
    )
    assert got == "x/absent"


def test_continue_final_message_leaves_the_last_turn_open(llama3: HfTokenizer) -> None:
    messages = [ChatMessage("user", "hi"), ChatMessage("assistant", "Once upon")]
    text = llama3.render_chat(
        messages, ChatOptions(add_generation_prompt=False, continue_final_message=True)
    )
    assert text.endswith("Once upon")
    with pytest.raises(TokenizationError, match="not compatible"):
        llama3.render_chat(messages, ChatOptions(continue_final_message=True))


def test_tool_use_template_is_chosen_when_the_request_has_tools(tmp_path) -> None:
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((FIXTURES / "llama3" / name).read_bytes())
    config = json.loads((FIXTURES / "llama3" / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer_dir(tmp_path)
    messages = [ChatMessage("user", "x")]
    assert tok.render_chat(messages, None) == "plain"
    tool = {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    assert tok.render_chat(messages, ChatOptions(tools=(tool,))) == "tools:1"
    (tmp_path / "chat_template.jinja").write_text("from the jinja file")
    assert load_tokenizer_dir(tmp_path).render_chat(messages, None) == "from the jinja file"


def test_a_tokenizer_without_template_refuses_chats(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((FIXTURES / "llama3" / "tokenizer.json").read_bytes())
    tok = load_tokenizer_dir(tmp_path)
    assert list(tok.encode("hi"))  # completions still work
    with pytest.raises(TokenizationError, match="no chat template"):
        tok.encode_chat([ChatMessage("user", "x")])


def _blocks(tok: HfTokenizer, body: dict, path: str = CHAT):
    request = parse_request(path, json.dumps(body).encode(), {})
    return prompt_blocks(request.prompt, tok, 16, 0, 8192)


def test_a_template_refusal_is_a_400_carrying_the_templates_message(llama3: HfTokenizer) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}],
    }
    with pytest.raises(RequestRejected) as refused:
        _blocks(llama3, body)
    assert refused.value.status == 400 and "Unsupported role: wizard" in refused.value.message
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "continue_final_message": True,
    }
    with pytest.raises(RequestRejected) as refused:
        _blocks(llama3, body)
    assert refused.value.status == 400


def test_a_template_type_error_is_a_400_not_a_crash(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((FIXTURES / "llama3" / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"})
    )
    tok = load_tokenizer_dir(tmp_path)
    with pytest.raises(RequestRejected) as refused:
        _blocks(tok, {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert refused.value.status == 400


def test_the_tokenizer_sees_only_the_bounded_head(chatml: HfTokenizer) -> None:
    seen: list[int] = []
    encode = chatml._encode

    def spy(text: str, add_special_tokens: bool = True) -> object:
        seen.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    chatml._encode = spy  # type: ignore[method-assign]
    huge = "word " * 400_000  # 2 MB in one turn
    request = parse_request(
        CHAT,
        json.dumps({"model": "m", "messages": [{"role": "user", "content": huge}]}).encode(),
        {},
    )
    blocks = prompt_blocks(request.prompt, chatml, 16, 0, max_blocks=64)
    assert len(blocks.hashes) == 64 and not blocks.exact
    assert blocks.prompt_tokens > 300_000  # the whole prompt is still counted (estimated)
    assert max(seen) < 64 * 16 * 40  # only the head was encoded


def test_huge_message_lists_render_without_crashing(llama3: HfTokenizer) -> None:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"t{i}"} for i in range(20_000)
    ]
    blocks = _blocks(llama3, {"model": "m", "messages": messages})
    assert len(blocks.hashes) > 0 and blocks.prompt_tokens > 20_000


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}},
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function"}],
        },
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "add_generation_prompt": "yes",
        },
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "reasoning_effort": 3},
        {"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": [1]}]},
        {
            "model": "m",
            "messages": [{"role": "assistant", "tool_calls": [{"type": "web", "function": {}}]}],
        },
    ],
)
def test_wrong_types_in_chat_template_inputs_are_a_400(body: dict) -> None:
    with pytest.raises(RequestRejected) as refused:
        parse_request(CHAT, json.dumps(body).encode(), {})
    assert refused.value.status == 400


def test_tiny_llama_trims_content_as_its_template_says() -> None:
    tok = load_tokenizer_dir(tokenizer_dir("tiny-llama"))
    text = tok.render_chat([ChatMessage("user", "  hi  ")], None)
    assert (
        text
        == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
