"""The simulated pod answers vLLM's POST /tokenize with the ids its generation endpoints
compute for the same prompt (the router's `source: engine` tokenizer asks it)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from tokenizer_fixtures import tokenizer_dir

from vllm_sim.engine import EngineConfig
from vllm_sim.server import SimPodConfig, start_pod

MODEL = "sim-llama-8b"
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "which pod"}, {"type": "text", "text": "has it?"}],
    },
]


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url, json=body) as response:
        return response.status, await response.json()


@pytest.mark.parametrize("tokenizer", [None, "llama3"])
async def test_tokenize_answers_the_ids_generation_uses(tokenizer: str | None) -> None:
    directory = None if tokenizer is None else str(tokenizer_dir(tokenizer))
    engine = EngineConfig(prefill_overhead_s=0.0, prefill_per_token_s=0.0, decode_per_token_s=0.0)
    pod = await start_pod(SimPodConfig(engine=engine, tokenizer_dir=directory), "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            for generation in (True, False):
                chat = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": generation}
                status, answer = await post(http, f"{pod.url}/tokenize", chat)
                assert status == 200, answer
                body = {**chat, "max_tokens": 1, "return_token_ids": True}
                _, served = await post(http, f"{pod.url}/v1/chat/completions", body)
                assert answer["tokens"] == served["prompt_token_ids"]
                assert answer["count"] == len(answer["tokens"])
                assert answer["max_model_len"] == pod.pod.config.engine.max_context_tokens
            completion = {"model": MODEL, "prompt": "the router, the cache"}
            _, answer = await post(http, f"{pod.url}/tokenize", completion)
            body = {**completion, "max_tokens": 1, "return_token_ids": True}
            _, served = await post(http, f"{pod.url}/v1/completions", body)
            assert answer["tokens"] == served["choices"][0]["prompt_token_ids"]
            _, bare = await post(
                http, f"{pod.url}/tokenize", {**completion, "add_special_tokens": False}
            )
            assert bare["tokens"] == answer["tokens"][1:]  # without the BOS token
            status, _ = await post(http, f"{pod.url}/tokenize", {**completion, "model": "nope"})
            assert status == 404
            both = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True,
                    "continue_final_message": True}  # fmt: skip
            status, _ = await post(http, f"{pod.url}/tokenize", both)
            assert status == 400
    finally:
        await pod.close()
