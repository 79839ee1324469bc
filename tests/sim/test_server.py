"""The simulated pod over real HTTP on loopback, with a real aiohttp client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from vllm_sim.engine import EngineConfig, FinishReason
from vllm_sim.openai_response import filler_text
from vllm_sim.server import POD_HEADER, POD_KEY, RunningPod, SimPodConfig, create_app
from vllm_sim.tokenizer import ChatMessage, SimTokenizer

from .conftest import FAST_ENGINE, StartPod

TOKENIZER = SimTokenizer()
SYSTEM = "You are a helpful assistant who answers questions about routing. " * 10


def parse_sse(body: str) -> list[Any]:
    """Events of an SSE body: parsed JSON objects, and the literal "[DONE]"."""
    assert body.endswith("\n\n")
    events: list[Any] = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def wait_until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def post(
    http: aiohttp.ClientSession, pod: RunningPod, path: str, body: Any
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(pod.url + path, data=data) as resp:
        payload = await resp.json(content_type=None)
        return resp.status, payload, resp


# -- completions -------------------------------------------------------------------------


async def test_completion_returns_openai_json(start: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start(pod_name="pod-7")
    prompt = "Route me to the pod that already has my prefix, please. " * 3
    status, body, resp = await post(
        http, pod, "/v1/completions", {"model": "sim-llama-8b", "prompt": prompt, "max_tokens": 5}
    )
    assert status == 200
    assert resp.headers[POD_HEADER] == "pod-7"
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "sim-llama-8b"
    assert body["choices"] == [
        {
            "index": 0,
            "text": filler_text(5),
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    prompt_tokens = len(TOKENIZER.encode(prompt, add_special_tokens=True))  # BOS first
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(
    ("prompt", "prompt_tokens"),
    [
        (" sed" * 19, 20),  # BOS + 19 one-token words
        ([" sed" * 19], 20),
        (list(range(37)), 37),
        ([list(range(37))], 37),
    ],
)
async def test_completion_prompt_forms(
    start: StartPod, http: aiohttp.ClientSession, prompt: Any, prompt_tokens: int
) -> None:
    pod = await start()
    status, body, _ = await post(http, pod, "/v1/completions", {"prompt": prompt})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 16  # the default max_tokens


async def test_repeated_token_prompt_hits_the_cache(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    request = {"prompt": list(range(100)), "max_tokens": 1}
    cached = []
    for _ in range(2):
        _, body, _ = await post(http, pod, "/v1/completions", request)
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 96]


# -- chat streaming ----------------------------------------------------------------------


async def stream_chat(
    http: aiohttp.ClientSession, pod: RunningPod, messages: list[dict[str, Any]], max_tokens: int
) -> tuple[aiohttp.ClientResponse, list[Any]]:
    request = {
        "model": "sim-llama-8b",
        "messages": messages,
        "max_completion_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(pod.url + "/v1/chat/completions", json=request) as resp:
        assert resp.status == 200
        return resp, parse_sse(await resp.text())


async def test_chat_streams_one_chunk_per_token_then_usage_then_done(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(pod_name="pod-3")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "Which pod?"}]},
    ]
    rendered = TOKENIZER.encode_chat(
        [ChatMessage("system", SYSTEM), ChatMessage("user", "Which pod?")]
    )
    cached = []
    for _ in range(2):
        resp, events = await stream_chat(http, pod, messages, max_tokens=4)
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers[POD_HEADER] == "pod-3"
        role, *tokens, usage, done = events
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(tokens) == 4
        assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
        assert "".join(t["choices"][0]["delta"]["content"] for t in tokens) == filler_text(4)
        assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, None, "length"]
        assert usage["choices"] == []
        assert usage["usage"]["prompt_tokens"] == len(rendered)
        assert usage["usage"]["completion_tokens"] == 4
        assert done == "[DONE]"
        cached.append(usage["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 16 * ((len(rendered) - 1) // 16)]
    assert cached[1] > 0


async def test_growing_conversation_reuses_the_previous_turn(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me more about pods."})
        _, events = await stream_chat(http, pod, messages, max_tokens=2)
        cached.append(events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"])
        reply = "".join(e["choices"][0]["delta"]["content"] for e in events[1:-2])
        messages.append({"role": "assistant", "content": reply})
    assert cached[0] == 0
    assert cached[0] < cached[1] < cached[2]


async def test_chat_without_stream_returns_a_message(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    status, body, _ = await post(
        http,
        pod,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == filler_text(3)
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_with_an_image_is_served_as_a_vision_model_would(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    """Media parts become one placeholder each, before the text (vLLM's order), hashed from
    their data: a base64 image is taken, and costs the placeholder's few tokens."""
    pod = await start()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 500_000}}
    usage = []
    for content in ([{"type": "text", "text": "what is it?"}, image], "what is it?"):
        status, body, _ = await post(
            http,
            pod,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": content}], "max_tokens": 1},
        )
        assert status == 200, body
        usage.append(body["usage"]["prompt_tokens"])
    assert 0 < usage[0] - usage[1] < 40


async def test_completion_stream_without_usage(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    request = {"prompt": "hello", "max_tokens": 3, "stream": True}
    async with http.post(pod.url + "/v1/completions", json=request) as resp:
        events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" sed", " sit", " est"]
    assert all("usage" not in e for e in events[:-1])
    assert all("token_ids" not in e["choices"][0] for e in events[:-1])


# -- generated token ids and the blocks they fill ------------------------------------------


def test_filler_text_encodes_to_exactly_the_generated_token_ids() -> None:
    pod = create_app(SimPodConfig())[POD_KEY]
    for count in (1, 7, 16, 33):
        assert list(TOKENIZER.encode(filler_text(count))) == pod.output_token_ids(count)
    # ... also inside a longer text, whatever precedes it.
    for before in ("abcd", "abc ", "pods.", "12", "\n", "  ", "日本"):
        text = before + filler_text(20) + " and more"
        start = len(TOKENIZER.encode(before))
        assert list(TOKENIZER.encode(text))[start : start + 20] == pod.output_token_ids(20)


async def test_return_token_ids_answers_with_prompt_and_output_ids(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    expected = pod.pod.output_token_ids(4)
    prompt = list(range(50, 70))
    request = {"prompt": prompt, "max_tokens": 4, "return_token_ids": True}
    status, body, _ = await post(http, pod, "/v1/completions", request)
    assert status == 200
    choice = body["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt, expected)
    messages = [{"role": "user", "content": "hi"}]
    chat = {"messages": messages, "max_tokens": 4, "return_token_ids": True}
    status, body, _ = await post(http, pod, "/v1/chat/completions", chat)
    assert status == 200
    rendered = list(TOKENIZER.encode_chat([ChatMessage("user", "hi")]))
    assert body["prompt_token_ids"] == rendered  # vLLM puts a chat's at the top
    assert body["choices"][0]["token_ids"] == expected
    status, body, _ = await post(http, pod, "/v1/completions", {"prompt": prompt})
    assert "token_ids" not in body["choices"][0]


async def test_chat_prompt_ids_follow_the_template_and_add_generation_prompt(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    messages = [ChatMessage("system", SYSTEM), ChatMessage("user", "Which pod?")]
    body = {
        "messages": [{"role": m.role, "content": m.content} for m in messages],
        "max_tokens": 1,
        "return_token_ids": True,
    }
    for flag in (None, True, False):
        request = body if flag is None else {**body, "add_generation_prompt": flag}
        status, answer, _ = await post(http, pod, "/v1/chat/completions", request)
        assert status == 200, answer
        expected = TOKENIZER.encode_chat(messages, add_generation_prompt=flag is not False)
        assert answer["prompt_token_ids"] == list(expected)
        assert answer["usage"]["prompt_tokens"] == len(expected)


async def test_return_token_ids_streams_one_id_per_chunk(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    expected = pod.pod.output_token_ids(3)
    request = {"prompt": [7, 8, 9], "max_tokens": 3, "stream": True, "return_token_ids": True}
    async with http.post(pod.url + "/v1/completions", json=request) as resp:
        events = parse_sse(await resp.text())[:-1]
    choices = [e["choices"][0] for e in events]
    assert [c["token_ids"] for c in choices] == [[i] for i in expected]
    assert [c.get("prompt_token_ids") for c in choices] == [[7, 8, 9], None, None]
    messages = [{"role": "user", "content": "hi"}]
    chat = {"messages": messages, "max_tokens": 3, "stream": True, "return_token_ids": True}
    async with http.post(pod.url + "/v1/chat/completions", json=chat) as resp:
        role, *tokens, _ = parse_sse(await resp.text())
    assert role["prompt_token_ids"] == list(TOKENIZER.encode_chat([ChatMessage("user", "hi")]))
    assert [t["choices"][0]["token_ids"] for t in tokens] == [[i] for i in expected]


async def cached_tokens(
    http: aiohttp.ClientSession, pod: RunningPod, path: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    status, answer, _ = await post(http, pod, path, body)
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"], answer


async def test_a_prompt_holding_the_generated_ids_reuses_the_output_blocks(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    # vLLM (docs/benchmarks/sim-vs-vllm.md): 40 ids + their 40 generated ids + 10 new ids,
    # with 32-token blocks, hit 64 tokens: the prompt's block and the one output filled.
    pod = await start(block_size=32, num_gpu_blocks=40)
    prompt = list(range(1000, 1040))
    request = {"prompt": prompt, "max_tokens": 40, "return_token_ids": True}
    _, answer = await cached_tokens(http, pod, "/v1/completions", request)
    generated = answer["choices"][0]["token_ids"]
    follow_up = {"prompt": prompt + generated + list(range(2000, 2010)), "max_tokens": 1}
    assert (await cached_tokens(http, pod, "/v1/completions", follow_up))[0] == 64


async def test_a_text_prompt_quoting_the_reply_reuses_the_output_blocks(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    prompt = "Tell me about pods. " * 6
    request = {"prompt": prompt, "max_tokens": 20}
    _, answer = await cached_tokens(http, pod, "/v1/completions", request)
    assert answer["usage"]["prompt_tokens"] == 38  # BOS, 6 x 6 pieces, the last space
    reply = answer["choices"][0]["text"]
    # 38 + 19 tokens have KV: 3 full blocks, the last 2 holding output.
    follow_up = {"prompt": prompt + reply + " Go on.", "max_tokens": 1}
    assert (await cached_tokens(http, pod, "/v1/completions", follow_up))[0] == 48
    # A reply the client changed re-encodes to other ids: only the prompt's own full
    # blocks are reused.
    changed = {"prompt": prompt + reply.upper() + " Go on.", "max_tokens": 1}
    assert (await cached_tokens(http, pod, "/v1/completions", changed))[0] == 32


async def test_the_next_chat_turn_reuses_the_blocks_of_the_previous_reply(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    question = "Which pod holds my prefix?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    request = {"messages": messages, "max_tokens": 40}
    _, answer = await cached_tokens(http, pod, "/v1/chat/completions", request)
    turn1 = answer["usage"]["prompt_tokens"]
    messages += [
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And then?"},
    ]
    cached, _ = await cached_tokens(http, pod, "/v1/chat/completions", request)
    # Every full block of the first turn's prompt and its output but the last token: the
    # template renders the reply right after the generation prompt the engine saw.
    assert cached == 16 * ((turn1 + 40 - 1) // 16)
    assert cached > 16 * (turn1 // 16)


# -- other endpoints ---------------------------------------------------------------------


async def test_models_lists_base_model_and_adapters(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(model="base-m", lora_adapters=("sql-lora", "chat-lora"))
    async with http.get(pod.url + "/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    assert [(m["id"], m["parent"]) for m in body["data"]] == [
        ("base-m", None),
        ("sql-lora", "base-m"),
        ("chat-lora", "base-m"),
    ]


async def test_metrics_page_reports_served_work(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(model="m1", lora_adapters=("sql-lora",))
    await post(http, pod, "/v1/completions", {"prompt": list(range(50)), "max_tokens": 2})
    await post(http, pod, "/v1/completions", {"model": "sql-lora", "prompt": [1], "max_tokens": 1})
    async with http.get(pod.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        page = await resp.text()
    base = 'engine="0",model_name="m1"'
    for line in [
        f"vllm:num_requests_running{{{base}}} 0.0",
        f"vllm:num_requests_waiting{{{base}}} 0.0",
        f"vllm:kv_cache_usage_perc{{{base}}} 0.0",
        f"vllm:prompt_tokens_total{{{base}}} 51.0",
        f"vllm:prefix_cache_queries_total{{{base}}} 51.0",
        f"vllm:generation_tokens_total{{{base}}} 3.0",
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="m1"} 2.0',
        f"vllm:time_to_first_token_seconds_count{{{base}}} 2.0",
        f"vllm:e2e_request_latency_seconds_count{{{base}}} 2.0",
        f"vllm:inter_token_latency_seconds_count{{{base}}} 1.0",  # 2 + 1 tokens: one gap
        f"vllm:request_time_per_output_token_seconds_count{{{base}}} 1.0",
        f"vllm:request_queue_time_seconds_count{{{base}}} 2.0",
        f"vllm:request_prefill_time_seconds_count{{{base}}} 2.0",
        f"vllm:request_decode_time_seconds_count{{{base}}} 2.0",
        f"vllm:request_inference_time_seconds_count{{{base}}} 2.0",
        f"vllm:request_prompt_tokens_sum{{{base}}} 51.0",
        f"vllm:request_generation_tokens_sum{{{base}}} 3.0",
        f"vllm:prompt_tokens_cached_total{{{base}}} 0.0",
    ]:
        assert line in page.splitlines()
    assert 'vllm:lora_requests_info{max_lora="4",running_lora_adapters=""' in page
    assert 'num_gpu_blocks="4096"' in page


async def test_health_and_reset_prefix_cache(start: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start()
    async with http.get(pod.url + "/health") as resp:
        assert (resp.status, await resp.text()) == (200, "")
    request = {"prompt": list(range(64)), "max_tokens": 1}
    await post(http, pod, "/v1/completions", request)
    async with http.post(pod.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    _, body, _ = await post(http, pod, "/v1/completions", request)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_lora_adapter_is_served_under_its_own_name(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(lora_adapters=("sql-lora",))
    status, body, _ = await post(
        http, pod, "/v1/completions", {"model": "sql-lora", "prompt": "select", "max_tokens": 1}
    )
    assert (status, body["model"]) == (200, "sql-lora")
    assert pod.pod.engine.loaded_adapters == ("sql-lora",)


# -- errors ------------------------------------------------------------------------------


async def test_unknown_model_is_404(start: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start(pod_name="pod-9")
    for path, body in [
        ("/v1/completions", {"model": "gpt-x", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "gpt-x", "messages": [{"role": "user", "content": ""}]}),
    ]:
        status, payload, resp = await post(http, pod, path, body)
        assert status == 404
        assert resp.headers[POD_HEADER] == "pod-9"
        assert payload == {
            "error": {
                "message": "The model `gpt-x` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }


MALFORMED_COMPLETIONS: list[Any] = [
    b"{bad json",
    b"",
    b"[1, 2]",
    b'"just a string"',
    b"\xff\xfe\x00garbage",
    b"[" * 100_000,
    {},
    {"prompt": 5},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": ["a", "b"]},
    {"prompt": [[1], [2]]},
    {"prompt": [-1]},
    {"prompt": [2**32]},
    {"prompt": [1.5]},
    {"prompt": [1, "a"]},
    {"prompt": {"text": "x"}},
    {"prompt": "x", "model": 5},
    {"prompt": "x", "max_tokens": "8"},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "max_tokens": True},
    {"prompt": "x", "max_tokens": 1.5},
    {"prompt": "x", "stream": "yes"},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": "x", "stream": True, "stream_options": []},
    {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
    {"prompt": "x", "cache_salt": 7},
    {"prompt": "x", "cache_salt": ""},
]

MALFORMED_CHATS: list[Any] = [
    {"messages": "hi"},
    {"messages": []},
    {"messages": ["hi"]},
    {"messages": [{"content": "x"}]},
    {"messages": [{"role": 1, "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
    {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", b) for b in MALFORMED_COMPLETIONS]
    + [("/v1/chat/completions", b) for b in MALFORMED_CHATS],
)
async def test_malformed_requests_are_400_and_harmless(
    start: StartPod, http: aiohttp.ClientSession, path: str, body: Any
) -> None:
    pod = await start(pod_name="pod-4")
    status, payload, resp = await post(http, pod, path, body)
    assert status == 400, payload
    assert resp.headers[POD_HEADER] == "pod-4"
    error = payload["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    assert isinstance(error["message"], str) and error["message"]
    # Nothing leaked into the engine, and the pod still serves.
    assert (pod.pod.engine.num_running, pod.pod.engine.num_waiting) == (0, 0)
    status, _, _ = await post(http, pod, "/v1/completions", {"prompt": "ok", "max_tokens": 1})
    assert status == 200


async def test_body_larger_than_the_limit_is_413(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(client_max_size=4096)
    status, payload, resp = await post(http, pod, "/v1/completions", {"prompt": "x" * 10_000})
    assert status == 413
    assert payload["error"]["code"] == 413
    assert resp.headers[POD_HEADER] == "pod-test"


async def test_prompt_longer_than_the_kv_cache_is_400(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(num_gpu_blocks=4)  # 64 tokens in all
    status, payload, _ = await post(
        http, pod, "/v1/completions", {"prompt": list(range(60)), "max_tokens": 5}
    )
    assert status == 400
    assert "maximum context length is 64 tokens" in payload["error"]["message"]
    status, _, _ = await post(
        http, pod, "/v1/completions", {"prompt": list(range(60)), "max_tokens": 4}
    )
    assert status == 200


async def test_every_response_names_its_pod(start: StartPod, http: aiohttp.ClientSession) -> None:
    pods = [await start(pod_name="pod-a"), await start(pod_name="pod-b")]
    for pod in pods:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("GET", "/no/such/path"),
            ("GET", "/v1/completions"),  # wrong method
            ("POST", "/reset_prefix_cache"),
        ]:
            async with http.request(method, pod.url + path) as resp:
                await resp.read()
                assert resp.headers[POD_HEADER] == pod.pod.config.pod_name, path
        async with http.get(pod.url + "/no/such/path") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == 404


# -- load and disconnects ----------------------------------------------------------------

SLOW = {"max_num_seqs": 1, "max_waiting": 1, "decode_per_token_s": 0.2}


async def test_full_queue_is_429(start: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start(**SLOW)
    engine = pod.pod.engine
    request = {"prompt": "long job", "max_tokens": 1000, "stream": True}
    running = await http.post(pod.url + "/v1/completions", json=request)
    assert (await running.content.readline()).startswith(b"data: ")
    queued = asyncio.create_task(http.post(pod.url + "/v1/completions", json=request))
    await wait_until(lambda: engine.num_waiting == 1)
    status, payload, resp = await post(http, pod, "/v1/completions", request)
    assert status == 429
    assert payload["error"]["code"] == 429
    assert resp.headers[POD_HEADER] == "pod-test"
    running.close()
    (await queued).close()
    await wait_until(lambda: (engine.num_running, engine.num_waiting) == (0, 0))


async def test_disconnect_mid_stream_frees_the_slot_and_blocks(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(**SLOW)
    engine = pod.pod.engine
    request = {"prompt": " sed" * 100, "max_tokens": 1000, "stream": True}
    resp = await http.post(pod.url + "/v1/completions", json=request)
    assert (await resp.content.readline()).startswith(b"data: ")
    assert engine.num_running == 1
    assert engine.kv_cache_usage > 0
    resp.close()
    await wait_until(lambda: engine.num_running == 0)
    assert engine.kv_cache_usage == 0.0
    assert engine.counters.finished[FinishReason.ABORT] == 1
    assert engine.counters.generation_tokens >= 1
    # The slot is free again: a new request runs at once.
    status, body, _ = await post(
        http, pod, "/v1/completions", {"prompt": " sed" * 100, "max_tokens": 1}
    )
    assert status == 200
    # BOS + 100 tokens: its 6 full blocks stayed cached.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


async def test_disconnect_while_queued_or_decoding_without_stream(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(**SLOW)
    engine = pod.pod.engine
    request = {"prompt": "job", "max_tokens": 1000}
    decoding = asyncio.create_task(http.post(pod.url + "/v1/completions", json=request))
    await wait_until(lambda: engine.num_running == 1)
    queued = asyncio.create_task(http.post(pod.url + "/v1/completions", json=request))
    await wait_until(lambda: engine.num_waiting == 1)
    queued.cancel()
    await wait_until(lambda: engine.num_waiting == 0)
    assert engine.num_running == 1
    decoding.cancel()
    await wait_until(lambda: engine.num_running == 0)
    assert engine.counters.finished[FinishReason.ABORT] == 2


# -- time ------------------------------------------------------------------------------


async def test_time_scale_speeds_up_wall_time_but_metrics_stay_in_engine_seconds(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    # Four times faster, not ten: engine seconds are wall seconds / time_scale, so a stall
    # of the shared test machine shows 4x in the metrics (it would show 10x at 0.1).
    pod = await start(time_scale=0.25, prefill_overhead_s=1.0, decode_per_token_s=0.5)
    began = time.monotonic()
    status, _, _ = await post(http, pod, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    elapsed = time.monotonic() - began
    assert status == 200
    # Engine time: 1.0 s prefill + 2 x 0.5 s decode = 2.0 s; wall time a quarter of that.
    # Sleeps never end early: the lower bounds are exact. The upper bounds are guards a
    # 0.6 s stall stays under; an unscaled prefill (1.0 s of wall time) still crosses them.
    assert 0.49 <= elapsed < 1.2
    # In engine seconds, not wall seconds (which would be a quarter).
    latency = pod.pod.latency
    assert 1.0 <= latency.ttft.total < 3.5
    assert 2.0 <= latency.e2e.total < 4.5
    assert 1.0 <= latency.prefill.total < 3.5
    assert 1.0 <= latency.decode.total < 3.5
    assert latency.queue.total < 2.0
    assert latency.inter_token.total == pytest.approx(1.0)  # two steps of 0.5 s


async def test_concurrent_prefills_share_the_pods_compute(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    # Two cold 200-token prompts: 0.2 engine seconds of prefill each, one after the other.
    # Wall time runs 5x slower than engine time so that a stall of the shared test machine
    # is small against the figures; sleeps never end early, so lower bounds are exact and
    # upper bounds only guard against a pod that runs the prefills in parallel or hangs.
    scale = 5.0
    pod = await start(prefill_overhead_s=0.0, prefill_per_token_s=0.001, time_scale=scale)
    base = 'engine="0",model_name="sim-llama-8b"'
    one_runs_one_waits = {
        f"vllm:num_requests_running{{{base}}} 1.0",
        f"vllm:num_requests_waiting{{{base}}} 1.0",
    }

    async def timed(first_id: int) -> float:
        began = time.monotonic()
        prompt = list(range(first_id, first_id + 200))
        status, _, _ = await post(http, pod, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert status == 200
        return (time.monotonic() - began) / scale

    async def seen_one_running_one_waiting() -> bool:
        # While the first prefill runs, the other request waits for the compute, as in vLLM.
        deadline = time.monotonic() + 0.2 * scale
        while time.monotonic() < deadline:
            async with http.get(pod.url + "/metrics") as resp:
                if one_runs_one_waits <= set((await resp.text()).splitlines()):
                    return True
            await asyncio.sleep(0.02)
        return False

    first, second, seen = await asyncio.gather(
        timed(1000), timed(5000), seen_one_running_one_waiting()
    )
    shorter, longer = sorted([first, second])
    assert 0.2 <= shorter < 0.35
    assert 0.4 <= longer < 0.55  # the second prefill waited for the first
    assert seen
    # The wait counts as queue time, the request's own prefill as prefill time. Engine
    # seconds: a stall of the machine adds a fifth of its length; the 0.2 s wait counted on
    # the wrong side (prefill 0.6 and queue 0, or queue 0.4) is still far outside.
    latency = pod.pod.latency
    assert 0.4 <= latency.prefill.total < 0.55
    assert 0.15 <= latency.queue.total < 0.35


async def test_decode_paces_tokens_at_the_inter_token_latency(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(decode_per_token_s=0.01)
    request = {"prompt": "hi", "max_tokens": 21, "stream": True}
    async with http.post(pod.url + "/v1/completions", json=request) as resp:
        assert (await resp.content.readline()).startswith(b"data: ")
        first = time.monotonic()
        rest = await resp.text()
        last = time.monotonic()
    events = [block.strip() for block in rest.split("\n\n") if block.strip()]
    assert len(events) == 20 + 1  # 20 more tokens, then [DONE]
    assert events[-1] == "data: [DONE]"
    assert 0.19 <= last - first < 1.0


async def test_app_under_a_plain_runner_still_notices_a_client_gone_mid_decode(
    http: aiohttp.ClientSession,
) -> None:
    # Without handler cancellation aiohttp lets the handler run on; the decode loop must
    # notice the closed connection itself and give the slot back.
    config = SimPodConfig(engine=EngineConfig(**(FAST_ENGINE | SLOW)))  # type: ignore[arg-type]
    app = create_app(config)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        engine = app[POD_KEY].engine
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        client = asyncio.create_task(http.post(url, json={"prompt": "job", "max_tokens": 1000}))
        await wait_until(lambda: engine.num_running == 1)
        client.cancel()
        await wait_until(lambda: engine.num_running == 0)
        assert engine.counters.finished[FinishReason.ABORT] == 1
    finally:
        await runner.cleanup()


async def test_close_ends_requests_in_flight_promptly(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    # aiohttp would wait up to its shutdown timeout for the handler: 30 s here, so that a
    # pod that lets the request decode on fails the guard by far, stall or not.
    pod = await start(shutdown_timeout=30.0, **SLOW)
    engine = pod.pod.engine
    resp = await http.post(
        pod.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "stream": True}
    )
    assert (await resp.content.readline()).startswith(b"data: ")
    began = time.monotonic()
    await pod.close()
    assert time.monotonic() - began < 5.0
    assert (engine.num_running, engine.counters.finished[FinishReason.ABORT]) == (0, 1)
    resp.close()


def _sample_names(page: bytes) -> set[str]:
    return {
        line.split(b"{")[0].split(b" ")[0].decode()
        for line in page.splitlines()
        if line and not line.startswith(b"#")
    }


async def test_the_metrics_mount_serves_the_families_asked_for_as_prometheus_client_does(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    """vLLM's routes: /metrics ignores `name[]`; /metrics/ (prometheus_client's app) serves
    only the families named. The reference is prometheus_client's own restricted registry
    over the sim's whole page; the EPP's reader reads the same fields from both pages."""
    from prometheus_client import generate_latest

    from epp.config import DataLayerConfig
    from epp.datalayer.scraper import page_reader
    from epp_bench.picker.scrape_engine import vllm_registry

    pod = await start(model="m1")
    await post(http, pod, "/v1/completions", {"prompt": list(range(50)), "max_tokens": 2})
    reader = page_reader(DataLayerConfig())
    query = [("name[]", name) for name in reader.names]
    async with http.get(pod.url + "/metrics", params=query) as resp:
        whole = await resp.read()
    async with http.get(pod.url + "/metrics/", params=query) as resp:
        assert resp.status == 200
        mounted = await resp.read()
    async with http.get(pod.url + "/metrics/") as resp:
        unasked = await resp.read()
    assert len(mounted) < len(whole) / 5 and _sample_names(unasked) == _sample_names(whole)
    # The reference registry brings its own process collector: vLLM's families only.
    families = "\n".join(
        line for line in whole.decode().splitlines() if "process_" not in line.split(" ")[0:3][-1]
    )
    reference = generate_latest(vllm_registry(families).restricted_registry(reader.names))
    process = {"process_start_time_seconds"}
    assert _sample_names(mounted) - process == _sample_names(reference) - process
    assert process <= _sample_names(mounted)  # asked for, and on the sim's page
    assert reader.parse(mounted) == reader.parse(whole)
