"""The simulated pod with a real model's tokenizer files (`epp sim --tokenizer DIR`)
tokenizes chats exactly as the EPP does with the same files: two implementations
(vllm_sim.tokenizer.HfDirTokenizer, epp.tokenization) agree, through a real pod on
loopback answering with its prompt token ids (vLLM's `return_token_ids`)."""

from __future__ import annotations

import json
import random

import aiohttp
import pytest
from tokenizer_fixtures import tokenizer_dir

from epp.prefix.blocks import prompt_blocks
from epp.request import parse_request
from epp.tokenization import load_tokenizer_dir
from vllm_sim.cli import build_parser, config_from_args
from vllm_sim.engine import EngineConfig
from vllm_sim.server import SimPodConfig, start_pod

WORDS = ["the", "router", "cache", "prefix", "é", "中文", "42", "!", "\n", "  ", "don't", "pod"]


def body(rng: random.Random, turns: int) -> dict:
    messages = [{"role": "system", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 80)))}]
    for i in range(turns):
        content = " ".join(rng.choices(WORDS, k=rng.randint(1, 40)))
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return {
        "model": "sim-llama-8b",
        "messages": messages,
        "max_tokens": 2,
        "return_token_ids": True,
    }


@pytest.mark.parametrize("name", ["llama3", "chatml", "tiny-llama"])
async def test_sim_and_epp_give_the_same_tokens_for_chats_and_completions(name: str) -> None:
    directory = tokenizer_dir(name)
    engine = EngineConfig(prefill_overhead_s=0.0, prefill_per_token_s=0.0, decode_per_token_s=0.0)
    pod = await start_pod(SimPodConfig(engine=engine, tokenizer_dir=str(directory)), "127.0.0.1", 0)
    epp = load_tokenizer_dir(directory)
    rng = random.Random(5)
    try:
        async with aiohttp.ClientSession() as http:
            for turns in (1, 2, 3, 5, 8):
                request = body(rng, turns)
                async with http.post(f"{pod.url}/v1/chat/completions", json=request) as response:
                    answer = await response.json()
                assert response.status == 200, answer
                parsed = parse_request("/v1/chat/completions", json.dumps(request).encode(), {})
                assert parsed.prompt.messages is not None
                ours = epp.encode_chat(parsed.prompt.messages, parsed.prompt.chat)
                assert answer["prompt_token_ids"] == list(ours)
                # and the EPP's blocks are made of exactly those ids
                blocks = prompt_blocks(parsed.prompt, epp, 16, 0, 8192)
                assert blocks.prompt_tokens == len(ours) and blocks.exact
            request = {
                "model": "sim-llama-8b",
                "prompt": "the router, the cache",
                "return_token_ids": True,
            }
            async with http.post(f"{pod.url}/v1/completions", json=request) as response:
                answer = await response.json()
            assert answer["choices"][0]["prompt_token_ids"] == list(epp.encode(request["prompt"]))
            # a template refusal is the engine's 400, as the EPP's
            refused = {"model": "sim-llama-8b", "messages": [{"role": "wizard", "content": "x"}]}
            async with http.post(f"{pod.url}/v1/chat/completions", json=refused) as response:
                status = response.status
            if name == "llama3":
                assert status == 400
    finally:
        await pod.close()


def test_vllm_sim_takes_a_tokenizer_directory(tmp_path) -> None:
    directory = tokenizer_dir("llama3")
    config = config_from_args(build_parser().parse_args(["--tokenizer", str(directory)]))
    assert config.tokenizer_dir == str(directory)
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        config_from_args(build_parser().parse_args(["--tokenizer", str(tmp_path)]))
