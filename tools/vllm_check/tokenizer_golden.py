"""Token ids vLLM itself produces for the request bodies in tests/fixtures/tokenizer/cases.json.

Runs in the vLLM venv (it imports vLLM's own request models, message parsing, Anthropic
conversion and chat-template code; no engine is started):

    .bench/vllm-venv/bin/python tools/vllm_check/tokenizer_golden.py

and writes tests/fixtures/tokenizer/golden.json: for each case, the rendered prompt text
and its token ids. tests/tokenization/test_golden.py checks that the EPP's own code
(`epp.request` + `epp.tokenization`) produces exactly these, with no vLLM installed.

Each case names a tokenizer: `llama3` and `chatml` are the test tokenizers in
tests/fixtures/tokenizer/ (tools/make_test_tokenizer.py), `tiny-llama` the model that
tools/vllm_check/build_model.py builds in .bench/tiny-llama (skipped when absent). vLLM's
ModelConfig needs a config.json beside the tokenizer files: the tiny model's is copied
next to a temporary copy of each test tokenizer.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "tokenizer"
TINY = ROOT / ".bench" / "tiny-llama"


def model_dir(name: str, scratch: Path) -> Path | None:
    if name == "tiny-llama":
        return TINY if (TINY / "tokenizer.json").exists() else None
    target = scratch / name
    if not target.exists():
        shutil.copytree(FIXTURES / name, target)
        shutil.copy(TINY / "config.json", target / "config.json")
    return target


def main() -> None:
    from vllm.config import ModelConfig
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import (
        resolve_chat_template,
        resolve_chat_template_content_format,
        safe_apply_chat_template,
    )
    from vllm.renderers.params import merge_kwargs
    from vllm.tokenizers import get_tokenizer

    cases = json.loads((FIXTURES / "cases.json").read_text())
    out: dict[str, Any] = {}
    loaded: dict[str, tuple[Any, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            directory = model_dir(case["tokenizer"], Path(tmp))
            if directory is None:
                print(f"skip {case['name']}: no {case['tokenizer']}", file=sys.stderr)
                continue
            if case["tokenizer"] not in loaded:
                config = ModelConfig(model=str(directory), tokenizer=str(directory))
                loaded[case["tokenizer"]] = (config, get_tokenizer(str(directory)))
            config, tok = loaded[case["tokenizer"]]
            body = case["body"]
            if case["path"] == "/v1/completions":
                text = body["prompt"]
                ids = tok.encode(text, add_special_tokens=True)
                out[case["name"]] = {"text": text, "ids": ids}
                continue
            if case["path"] == "/v1/messages":
                template = resolve_chat_template(tok, None, None, model_config=config)
                merge = AnthropicServingMessages._detect_merge_inline_system(template)
                request = AnthropicServingMessages.to_chat_completion_request(
                    AnthropicMessagesRequest.model_validate(body),
                    merge_inline_system=merge,
                    disabled_thinking_effort="none",
                )
            else:
                request = ChatCompletionRequest.model_validate(body)
            tool_dicts = [t.model_dump() for t in request.tools] if request.tools else None
            params = request.build_chat_params(None, "auto").with_defaults(
                merge_kwargs(None, {"tools": tool_dicts, "tokenize": False})
            )
            content_format = resolve_chat_template_content_format(
                params.chat_template,
                params.chat_template_kwargs.get("tools"),
                "auto",
                tok,
                model_config=config,
            )
            conversation, _, _ = parse_chat_messages(request.messages, config, content_format)
            text = safe_apply_chat_template(
                config, tok, conversation, **params.get_apply_chat_template_kwargs()
            )
            ids = tok.encode(text, add_special_tokens=request.add_special_tokens)
            out[case["name"]] = {"text": text, "ids": ids, "content_format": content_format}
            print(f"{case['name']}: {len(ids)} tokens ({content_format})", file=sys.stderr)
    (FIXTURES / "golden.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FIXTURES / 'golden.json'} ({len(out)} cases)")


if __name__ == "__main__":
    main()
