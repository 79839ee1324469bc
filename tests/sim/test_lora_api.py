"""Runtime LoRA loading over HTTP, with vLLM's bodies, answers and errors."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from vllm_sim.server import RunningPod

from .conftest import StartPod


async def post_json(
    http: aiohttp.ClientSession, pod: RunningPod, path: str, body: Any
) -> tuple[int, str]:
    async with http.post(pod.url + path, json=body) as resp:
        return resp.status, await resp.text()


async def models(http: aiohttp.ClientSession, pod: RunningPod) -> list[tuple[str, str, Any]]:
    async with http.get(pod.url + "/v1/models") as resp:
        return [(m["id"], m["root"], m["parent"]) for m in (await resp.json())["data"]]


async def lora_info_line(http: aiohttp.ClientSession, pod: RunningPod) -> str:
    async with http.get(pod.url + "/metrics") as resp:
        page = await resp.text()
    # vLLM keeps old label sets; the newest (largest value) is the current one.
    lines = [x for x in page.splitlines() if x.startswith("vllm:lora_requests_info{")]
    return max(lines, key=lambda line: float(line.rpartition(" ")[2]))


async def test_load_lists_the_adapter_and_serves_it_unload_removes_it(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(model="base", enable_lora=True)
    status, text = await post_json(
        http, pod, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/adapters/sql"}
    )
    assert (status, text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert await models(http, pod) == [("base", "base", None), ("sql", "/adapters/sql", "base")]
    completion = {"model": "sql", "prompt": "select", "max_tokens": 1}
    async with http.post(pod.url + "/v1/completions", json=completion) as resp:
        assert resp.status == 200
        assert (await resp.json())["model"] == "sql"
    assert 'max_lora="4"' in await lora_info_line(http, pod)

    status, text = await post_json(http, pod, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert await models(http, pod) == [("base", "base", None)]
    assert pod.pod.engine.loaded_adapters == ()
    async with http.post(pod.url + "/v1/completions", json=completion) as resp:
        assert resp.status == 404


@pytest.mark.parametrize(("rank", "load_s"), [(None, 2.0), (16, 2.0), (64, 8.0)])
async def test_load_answers_after_the_load_time_of_its_rank(
    start: StartPod, http: aiohttp.ClientSession, rank: int | None, load_s: float
) -> None:
    # lora_load_s 2 s at rank 16, run 20x faster: 0.1 s per 16 ranks of wall time. Sleeps
    # never end early, so the lower bound is exact; the upper bound is a guard that a stall
    # of the shared test machine stays under, far below the unscaled load time (2 s or 8 s).
    scale = 0.05
    pod = await start(enable_lora=True, lora_load_s=2.0, time_scale=scale)
    body: dict[str, Any] = {"lora_name": "a", "lora_path": "/a"}
    if rank is not None:
        body["rank"] = rank
    began = time.monotonic()
    status, _ = await post_json(http, pod, "/v1/load_lora_adapter", body)
    elapsed = time.monotonic() - began
    assert status == 200
    assert load_s * scale <= elapsed < load_s * scale + 1.0
    assert pod.pod.engine.adapter_rank("a") == (rank or 16)
    # Preloaded: the first request does not pay the load again.
    assert pod.pod.engine.loaded_adapters == ("a",)


async def test_startup_adapters_keep_their_ranks(start: StartPod) -> None:
    pod = await start(lora_adapters=("sql", "chat"), lora_ranks={"sql": 64})
    engine = pod.pod.engine
    assert (engine.adapter_rank("sql"), engine.adapter_rank("chat")) == (64, 16)


LOAD_ERRORS: list[tuple[Any, int, str, str]] = [
    ({"lora_name": "a"}, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_path": "/a"}, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "", "lora_path": "/a"}, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": 5, "lora_path": "/a"}, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "sql", "lora_path": "/b"}, 400, "InvalidUserInput", "The lora adapter 'sql' has already been loaded."),
    ({"lora_name": "base", "lora_path": "/b"}, 400, "InvalidUserInput", "'base' is the base model's name."),
    ({"lora_name": "a", "lora_path": "/a", "rank": 0}, 400, "InvalidUserInput", "'rank' must be an integer >= 1."),
    ({"lora_name": "a", "lora_path": "/a", "rank": "16"}, 400, "InvalidUserInput", "'rank' must be an integer >= 1."),
    ([1, 2], 400, "BadRequestError", "Request body must be a JSON object."),
]  # fmt: skip

UNLOAD_ERRORS: list[tuple[Any, int, str, str]] = [
    ({}, 400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."),
    ({"lora_name": ""}, 400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."),
    ({"lora_name": "nope"}, 404, "NotFoundError", "The lora adapter 'nope' cannot be found."),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "err_type", "message"),
    [("/v1/load_lora_adapter", *case) for case in LOAD_ERRORS]
    + [("/v1/unload_lora_adapter", *case) for case in UNLOAD_ERRORS],
)
async def test_errors_have_vllms_status_type_and_message(
    start: StartPod,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    status: int,
    err_type: str,
    message: str,
) -> None:
    pod = await start(model="base", lora_adapters=("sql",))
    async with http.post(pod.url + path, json=body) as resp:
        assert resp.status == status
        payload = await resp.json()
    assert payload == {
        "error": {
            "message": message,
            "type": err_type,
            "param": payload["error"]["param"],
            "code": status,
        }
    }
    assert await models(http, pod) == [("base", "base", None), ("sql", "sql", "base")]


async def test_loading_needs_lora_enabled(start: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start()
    status, text = await post_json(
        http, pod, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}
    )
    assert status == 400
    assert "--enable-lora" in text
    async with http.get(pod.url + "/metrics") as resp:
        assert "vllm:lora_requests_info" not in await resp.text()


async def test_lora_requests_info_shows_running_and_waiting_adapters(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(lora_adapters=("a", "b"), max_num_seqs=1, decode_per_token_s=0.2)
    engine = pod.pod.engine
    running = await http.post(
        pod.url + "/v1/completions",
        json={"model": "a", "prompt": "x", "max_tokens": 100, "stream": True},
    )
    assert (await running.content.readline()).startswith(b"data: ")
    waiting = await http.post(
        pod.url + "/v1/completions",
        json={"model": "b", "prompt": "y", "max_tokens": 100, "stream": True},
    )
    assert engine.num_waiting == 1
    line = await lora_info_line(http, pod)
    assert 'running_lora_adapters="a"' in line
    assert 'waiting_lora_adapters="b"' in line
    running.close()
    waiting.close()
