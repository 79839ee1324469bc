"""`tokenizers: {model: {source: engine}}`: the router asks a real simulated pod for the
prompt's ids (POST /tokenize) and hashes its blocks from them; on a timeout, an error, a
bad answer or no pod it falls back to the local tokenizer (or the byte estimate), and
counts which (`epp_engine_tokenize_total{result}`).

The pods are real HTTP servers on loopback (vllm_sim) serving the llama3 test tokenizer;
the EPP's local fallback is the chatml one, so every check can tell whose ids were used.
The expected ids come from the pod's own generation answer (`return_token_ids`), not
from /tokenize, so the check does not take the endpoint's word for itself."""

from __future__ import annotations

import json
from array import array
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from helpers import engine_router
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from tokenizer_fixtures import tokenizer_dir

from epp.app import EppService
from epp.config import EppConfig
from epp.prefix.hashing import block_hashes, chain_seed
from epp.request import IncomingRequest, RequestRejected, parse_request
from epp.routing import Router
from epp.tokenization import TokenizerRegistry, load_tokenizer_dir
from epp.tokenization.engine import EngineTokenizer
from epp.tokenization.estimate import ByteEstimateTokenizer
from vllm_sim.engine import EngineConfig
from vllm_sim.server import RunningPod, SimPodConfig, start_pod

MODEL = "sim-llama-8b"
CHAT = "/v1/chat/completions"
WORDS = ["the", "router", "keeps", "a", "cache", "of", "each", "pod's", "prefix", "blocks"]


OPEN: list[EngineTokenizer] = []  # sessions built by `build`, closed after each test


@pytest.fixture
async def pod() -> AsyncIterator[RunningPod]:
    engine = EngineConfig(prefill_overhead_s=0.0, prefill_per_token_s=0.0, decode_per_token_s=0.0)
    config = SimPodConfig(engine=engine, tokenizer_dir=str(tokenizer_dir("llama3")))
    running = await start_pod(config, "127.0.0.1", 0)
    try:
        yield running
    finally:
        while OPEN:
            await OPEN.pop().close()
        await running.close()


def build(pod: RunningPod, **entry: Any) -> tuple[Router, EngineTokenizer, CollectorRegistry]:
    router, engine, registry = engine_router(f"127.0.0.1:{pod.port}", MODEL, **entry)
    OPEN.append(engine)
    return router, engine, registry


def counted(registry: CollectorRegistry, result: str) -> float:
    value = registry.get_sample_value("epp_engine_tokenize_total", {"result": result})
    assert value is not None
    return value


def chat_body(turns: int = 6, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You answer briefly."}]
    for i in range(turns):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(40))
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": MODEL, "messages": messages, "max_tokens": 1, **extra}


async def engine_ids(pod: RunningPod, body: dict[str, Any]) -> array:
    """The ids the pod computed its prompt from, as its generation answer reports them."""
    payload = {**body, "return_token_ids": True}
    async with aiohttp.ClientSession() as http, http.post(f"{pod.url}{CHAT}", json=payload) as r:
        answer = await r.json()
    assert r.status == 200, answer
    return array("I", answer["prompt_token_ids"])


async def switch(pod: RunningPod, fault: str) -> None:
    """Make the pod's /tokenize fail (vllm_sim's POST /sim/fail)."""
    fail = {"tokenize": fault}
    async with aiohttp.ClientSession() as http, http.post(f"{pod.url}/sim/fail", json=fail) as r:
        assert r.status == 200


def local_ids(name: str, body: dict[str, Any]) -> array:
    prompt = parse_request(CHAT, json.dumps(body).encode(), {}).prompt
    assert prompt.messages is not None
    return load_tokenizer_dir(tokenizer_dir(name)).encode_chat(prompt.messages, prompt.chat)


def hashes(ids: array) -> list[int]:
    return block_hashes(ids, 16, chain_seed(MODEL, None, None), 8192)


async def test_routed_blocks_are_the_engines_ids(pod: RunningPod) -> None:
    router, _, registry = build(pod, path=str(tokenizer_dir("chatml")))
    body = chat_body()
    expected = await engine_ids(pod, body)
    assert list(expected) != list(local_ids("chatml", body))  # the fallback would differ
    routed = await router.route(
        IncomingRequest(path=CHAT, body=json.dumps(body).encode(), request_id="r")
    )
    assert routed.prompt_tokens == len(expected)
    want = hashes(expected)
    assert len(want) == len(expected) // 16 > 4
    # the index recorded exactly the engine's blocks on the chosen pod
    assert router._index.match(want) == {"pod-0": len(want)}
    assert counted(registry, "ok") == 1
    assert counted(registry, "timeout") == counted(registry, "error") == 0


async def test_anthropic_messages_body_gets_the_engines_ids_of_its_chat(pod: RunningPod) -> None:
    router, _, registry = build(pod)
    text = " ".join(WORDS * 8)
    chat = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": text},
        ],
    }
    anthropic = {
        "model": MODEL,
        "max_tokens": 1,
        "system": "You answer briefly.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    }
    expected = await engine_ids(pod, chat)
    routed = await router.route(
        IncomingRequest(path="/v1/messages", body=json.dumps(anthropic).encode(), request_id="r")
    )
    assert routed.prompt_tokens == len(expected)
    want = hashes(expected)
    assert want and router._index.match(want) == {"pod-0": len(want)}
    assert counted(registry, "ok") == 1


@pytest.mark.parametrize(
    ("fault", "result"), [("hang", "timeout"), ("error", "error"), ("garbage", "bad_answer")]
)
async def test_a_failing_engine_falls_back_to_the_local_tokenizer(
    pod: RunningPod, fault: str, result: str
) -> None:
    router, _, registry = build(pod, path=str(tokenizer_dir("chatml")), timeout_ms=100)
    await switch(pod, fault)
    body = chat_body()
    routed = await router.route(
        IncomingRequest(path=CHAT, body=json.dumps(body).encode(), request_id="r")
    )
    ours = local_ids("chatml", body)
    assert routed.prompt_tokens == len(ours)
    assert router._index.match(hashes(ours)) == {"pod-0": len(ours) // 16}
    assert counted(registry, result) == 1
    assert counted(registry, "ok") == 0


async def test_without_local_files_the_fallback_is_the_byte_estimate(pod: RunningPod) -> None:
    router, _, registry = build(pod, timeout_ms=100)
    await switch(pod, "error")
    body = chat_body()
    routed = await router.route(
        IncomingRequest(path=CHAT, body=json.dumps(body).encode(), request_id="r")
    )
    prompt = parse_request(CHAT, json.dumps(body).encode(), {}).prompt
    assert prompt.messages is not None
    assert routed.prompt_tokens == len(ByteEstimateTokenizer().encode_chat(prompt.messages))
    assert counted(registry, "error") == 1


async def test_an_answer_beyond_the_size_limit_is_a_bad_answer(pod: RunningPod) -> None:
    # 0.0001 MB = 104 bytes: the answer for a ~250-token chat is far longer
    router, _, registry = build(pod, path=str(tokenizer_dir("chatml")), max_response_mb=0.0001)
    body = chat_body()
    routed = await router.route(
        IncomingRequest(path=CHAT, body=json.dumps(body).encode(), request_id="r")
    )
    assert routed.prompt_tokens == len(local_ids("chatml", body))
    assert counted(registry, "bad_answer") == 1


async def test_no_healthy_pod_of_the_model_falls_back(pod: RunningPod) -> None:
    router, _, registry = build(pod, path=str(tokenizer_dir("chatml")))
    for endpoint in router._store.all():
        endpoint.excluded = True  # the health model took it out
    with pytest.raises(RequestRejected):  # and nothing can serve it either
        await router.route(
            IncomingRequest(path=CHAT, body=json.dumps(chat_body()).encode(), request_id="r")
        )
    assert counted(registry, "no_pod") == 1
    assert counted(registry, "ok") == 0


async def test_what_tokenize_cannot_express_takes_the_local_path(pod: RunningPod) -> None:
    router, _, registry = build(pod, path=str(tokenizer_dir("chatml")))
    body = chat_body(reasoning_effort="low")
    routed = await router.route(
        IncomingRequest(path=CHAT, body=json.dumps(body).encode(), request_id="r")
    )
    assert routed.prompt_tokens == len(local_ids("chatml", body))
    assert counted(registry, "skipped") == 1
    # token ids need no tokenizer: nothing asked, nothing counted
    ids = {"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 1}
    routed = await router.route(
        IncomingRequest(path="/v1/completions", body=json.dumps(ids).encode(), request_id="r")
    )
    assert routed.prompt_tokens == 39
    assert sum(counted(registry, r) for r in ("ok", "skipped", "error", "no_pod")) == 1


async def test_route_now_keeps_the_local_path(pod: RunningPod) -> None:
    router, _, registry = build(pod, path=str(tokenizer_dir("chatml")))
    body = chat_body()
    routed = router.route_now(
        IncomingRequest(path=CHAT, body=json.dumps(body).encode(), request_id="r")
    )
    assert routed.prompt_tokens == len(local_ids("chatml", body))
    assert counted(registry, "ok") == 0


def test_config_engine_source() -> None:
    with pytest.raises(ValidationError, match="path is required"):
        EppConfig.model_validate({"tokenizers": {"m": {}}})
    with pytest.raises(ValidationError):
        EppConfig.model_validate({"tokenizers": {"m": {"source": "engine", "timeout_ms": 0}}})
    with pytest.raises(ValidationError):
        EppConfig.model_validate({"tokenizers": {"m": {"source": "pod"}}})
    config = EppConfig.model_validate({"tokenizers": {"m": {"source": "engine"}}})
    entry = config.tokenizers["m"]
    assert entry.path is None and 50 <= entry.timeout_ms <= 100
    # engine-only entries load no files: the model's local fallback is the byte estimate
    assert "m" not in TokenizerRegistry.from_config(config.tokenizers)
    assert EngineTokenizer.from_config(config.tokenizers, list) is not None


def test_default_configs_never_await_the_engine() -> None:
    local = {"tokenizers": {"m": {"path": str(tokenizer_dir("chatml"))}}}
    for raw in ({}, local):
        service = EppService(EppConfig.model_validate(raw))
        assert service.router.engine_tokenizer is None
    engine = EppService(EppConfig.model_validate({"tokenizers": {"m": {"source": "engine"}}}))
    assert engine.router.engine_tokenizer is not None


async def test_a_long_answer_arriving_in_many_chunks_is_read_whole(pod: RunningPod) -> None:
    # a generous timeout: the pod takes a while to tokenize 30k tokens on a busy machine
    router, _, registry = build(pod, path=str(tokenizer_dir("chatml")), timeout_ms=10_000)
    text = " ".join(WORDS[i % len(WORDS)] + str(i) for i in range(12_000))
    body = {"model": MODEL, "prompt": text, "max_tokens": 1}
    routed = await router.route(
        IncomingRequest(path="/v1/completions", body=json.dumps(body).encode(), request_id="r")
    )
    # the pod's ids (its llama3 files, BOS first as for /v1/completions), ~200 KB of JSON
    expected = load_tokenizer_dir(tokenizer_dir("llama3")).encode(text)
    assert len(expected) > 30_000
    assert counted(registry, "ok") == 1
    assert routed.prompt_tokens == len(expected)
    want = hashes(expected)
    assert router._index.match(want) == {"pod-0": len(want)}
