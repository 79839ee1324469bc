"""A model's chat template, rendered the way vLLM renders it (through transformers).

vLLM hands the conversation to `transformers`' `apply_chat_template`, which renders the
template's Jinja in an `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the `loopcontrols` extension, a `{% generation %}` block tag
(a no-op here: it only marks assistant text for training masks), a `tojson` filter that
does not escape HTML and keeps key order (`json.dumps(x, ensure_ascii=False)`), and two
globals: `raise_exception(message)` and `strftime_now(format)`. The template sees
`messages`, `tools`, `documents`, `add_generation_prompt`, the tokenizer's named special
tokens as strings (`bos_token`, `eos_token`, ...), and the request's
`chat_template_kwargs` that the template names (vLLM drops the others). This module
reproduces that with its own code; it never imports transformers or vLLM.

`continue_final_message` follows transformers: the final message is left open by
rendering it with a marker appended and cutting the text at the marker.

Errors: anything the template raises (its own `raise_exception`, an undefined attribute
it calls, a type it cannot iterate) is a `TokenizationError` carrying the template's
message, which the router answers with 400 as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from epp.tokenization.protocol import TokenizationError

ContentFormat = Literal["string", "openai"]

# transformers' apply_chat_template consumes these itself: they never reach the template
# through **kwargs (tools, documents, add_generation_prompt go in by name).
_HF_CALL_PARAMS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it to
    mask assistant tokens for training; rendering is unchanged)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: object) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def make_environment(
    now: Callable[[], datetime] = datetime.now,
) -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in; `now` is the clock
    behind `strftime_now` (a parameter so that tests can fix the date)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    return env


class ChatTemplate:
    """One compiled chat template and what vLLM reads from its source once: the variables
    it names (which `chat_template_kwargs` reach it), whether it iterates over content
    parts (vLLM's content format), whether it knows the `developer` role, and whether it
    refuses a system turn after the first (then vLLM merges an Anthropic body's inline
    system turns into the leading one)."""

    def __init__(
        self,
        source: str,
        *,
        content_format: Literal["auto", "string", "openai"] = "auto",
        now: Callable[[], datetime] = datetime.now,
    ) -> None:
        env = make_environment(now)
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_format: ContentFormat = (
            detect_content_format(ast) if content_format == "auto" else content_format
        )
        self.supports_developer = '"developer"' in source or "'developer'" in source
        self.requires_leading_system = _refuses_inline_system(env, source)

    def template_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The `chat_template_kwargs` the template receives: those it names, less the
        arguments transformers' call consumes itself (vLLM's filter, then transformers')."""
        return {k: v for k, v in kwargs.items() if k in self.variables and k not in _HF_CALL_PARAMS}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        special_tokens: Mapping[str, str],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The rendered conversation. Raises TokenizationError for what the template (or
        transformers around it) refuses."""
        if not messages:
            raise TokenizationError("cannot render an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise TokenizationError(
                "continue_final_message and add_generation_prompt are not compatible"
            )
        context = {**special_tokens, **self.template_kwargs(kwargs or {})}
        final: str | None = None
        if continue_final_message:
            messages, final = _mark_final(messages, self.source)
        try:
            rendered = self._template.render(
                messages=messages,
                tools=list(tools) if tools is not None else None,
                documents=list(documents) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise TokenizationError(str(exc) or type(exc).__name__) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TokenizationError(f"the chat template failed: {exc}") from None
        except (RecursionError, MemoryError, OverflowError):
            raise TokenizationError("the chat template failed on this conversation") from None
        if final is not None:
            rendered = _cut_at_marker(rendered, final)
        return rendered


def _mark_final(messages: list[dict[str, Any]], source: str) -> tuple[list[dict[str, Any]], str]:
    """transformers' continue_final_message: append a marker to the final message's text
    (its last text part when content is a list)."""
    if "content" not in source:
        raise TokenizationError(
            'continue_final_message is set to "content" but this is not an accepted field'
            " in the chat_template"
        )
    last = dict(messages[-1])
    content = last.get("content")
    if content is None:
        raise TokenizationError(
            'continue_final_message is set but the final message has no "content" to continue'
        )
    if isinstance(content, list | tuple):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final = str(part["text"])
                part["text"] = final + _CONTINUE_TAG
                break
        else:
            raise TokenizationError(
                "continue_final_message is set but we could not find any text to continue"
                " in the final message"
            )
        last["content"] = parts
    else:
        final = str(content)
        last["content"] = final + _CONTINUE_TAG
    return [*messages[:-1], last], final


def _cut_at_marker(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise TokenizationError(
            "continue_final_message is set but the final message does not appear in the chat"
            " after applying the chat template"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _refuses_inline_system(env: jinja2.Environment, source: str) -> bool:
    """vLLM's probe for Anthropic bodies: a [system, user, system, user] conversation the
    template refuses means inline system turns must be merged into the first."""
    probe = [
        {"role": "system", "content": "t"},
        {"role": "user", "content": "t"},
        {"role": "system", "content": "t"},
        {"role": "user", "content": "t"},
    ]
    try:
        env.from_string(source).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    except Exception:  # vLLM counts only template errors as a refusal
        return False
    return False


# -- content format: does the template iterate over a message's content? ---------------
def _is_name(node: jinja2.nodes.Node, names: set[str]) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _is_content_of(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """`m.content`, `m['content']`, with filters, tests or slices around it."""
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_name(node.node, names)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, names) and node.attr == "content"
    return False


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    while isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        node = node.node
    return node


def _loop_targets(root: jinja2.nodes.Template, sources: set[str]) -> Iterator[str]:
    for loop in root.find_all(jinja2.nodes.For):
        if _is_name(_unwrap(loop.iter), sources) and isinstance(loop.target, jinja2.nodes.Name):
            yield loop.target.name


def detect_content_format(root: jinja2.nodes.Template) -> ContentFormat:
    """The content format: "openai" when the template loops over a message's content (so it expects a list of
    parts), else "string": the rule vLLM applies to the template's syntax tree, in a
    smaller form (names bound from `messages`, loops over them, loops over their content
    or over a name `content`, and over a macro's parameter given a message's content)."""
    messages = {"messages"}
    changed = True
    while changed:  # names assigned from messages (or a slice of it)
        changed = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in messages
                and _is_name(_unwrap(assign.node), messages)
            ):
                messages.add(target.name)
                changed = True
    message_vars = set(_loop_targets(root, messages))
    if not message_vars:
        return "string"
    content_params: set[str] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = [arg.name for arg in macro.args]
        for call in root.find_all(jinja2.nodes.Call):
            if not _is_name(call.node, {macro.name}):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and _is_content_of(arg, message_vars):
                    content_params.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and _is_content_of(kw.value, message_vars):
                    content_params.add(kw.key)
    for loop in root.find_all(jinja2.nodes.For):
        if _is_content_of(loop.iter, message_vars):
            return "openai"
        inner = _unwrap(loop.iter)
        if _is_name(inner, content_params | {"content"}):
            return "openai"
    return "string"
