"""Failure injection: per-request header, random failures, pod-wide switches."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from vllm_sim.engine import EngineConfig, FinishReason
from vllm_sim.failures import (
    FAIL_HEADER,
    INJECTED_HEADER,
    FailureConfig,
    FailureKind,
    parse_kinds,
)
from vllm_sim.server import POD_HEADER, POD_KEY, RunningPod, SimPodConfig, create_app

from .conftest import FAST_ENGINE, StartPod
from .test_server import wait_until

COMPLETION = {"prompt": "hello there", "max_tokens": 5}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
SHORT = aiohttp.ClientTimeout(total=0.3)
# The switches of the fault suite (tests/sim/test_fault_switches.py), off.
NO_NEW_SWITCHES = {"generation": None, "delay_ms": 0, "kv_events": None}


def fail(kind: str) -> dict[str, str]:
    return {FAIL_HEADER: kind}


async def fail_switch(http: aiohttp.ClientSession, pod: RunningPod, body: Any) -> tuple[int, Any]:
    async with http.post(pod.url + "/sim/fail", json=body) as resp:
        return resp.status, await resp.json()


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "err_type"),
    [
        ("429", "TooManyRequestsError"),
        ("500", "InternalServerError"),
        ("503", "ServiceUnavailableError"),
    ],
)
@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
async def test_error_kinds_answer_at_once_in_vllms_shape(
    start: StartPod, http: aiohttp.ClientSession, kind: str, err_type: str, path: str, body: Any
) -> None:
    pod = await start(pod_name="pod-f")
    async with http.post(pod.url + path, json=body, headers=fail(kind)) as resp:
        assert resp.status == int(kind)
        assert resp.headers[INJECTED_HEADER] == kind
        assert resp.headers[POD_HEADER] == "pod-f"
        payload = await resp.json()
    error = payload["error"]
    assert (error["type"], error["code"], error["param"]) == (err_type, int(kind), None)
    assert "injected" in error["message"]
    engine = pod.pod.engine
    assert (engine.counters.prompt_tokens, engine.num_running, engine.num_waiting) == (0, 0, 0)
    assert pod.pod.injected.total() == 1


async def test_error_kinds_work_on_metrics_too(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    async with http.get(pod.url + "/metrics", headers=fail("503")) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == 503


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("/v1/completions", "teapot", "x-sim-fail must be one of"),
        ("/v1/completions", "slow-metrics", "applies to GET /metrics only"),
        ("/metrics", "404", "x-sim-fail must be one of"),
    ],
)
async def test_bad_header_values_are_400(
    start: StartPod, http: aiohttp.ClientSession, path: str, value: str, message: str
) -> None:
    pod = await start()
    method = "GET" if path == "/metrics" else "POST"
    async with http.request(method, pod.url + path, json=COMPLETION, headers=fail(value)) as resp:
        assert resp.status == 400
        assert message in (await resp.json())["error"]["message"]


# -- hang --------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_hang_holds_a_slot_until_the_client_gives_up_then_frees_it(
    start: StartPod, http: aiohttp.ClientSession, stream: bool
) -> None:
    pod = await start()
    engine = pod.pod.engine
    body = {**COMPLETION, "stream": stream}
    began = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        # Not even the headers of a stream come back.
        async with http.post(
            pod.url + "/v1/completions", json=body, headers=fail("hang"), timeout=SHORT
        ):
            pass
    assert time.monotonic() - began >= 0.29
    await wait_until(lambda: engine.num_running == 0)
    assert engine.counters.finished[FinishReason.ABORT] == 1
    assert engine.kv_cache_usage == 0.0
    async with http.post(pod.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200


async def test_hang_is_noticed_without_handler_cancellation(http: aiohttp.ClientSession) -> None:
    app = create_app(SimPodConfig(engine=EngineConfig(**FAST_ENGINE)))  # type: ignore[arg-type]
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        engine = app[POD_KEY].engine
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        client = asyncio.create_task(http.post(url, json=COMPLETION, headers=fail("hang")))
        await wait_until(lambda: engine.num_running == 1)
        client.cancel()
        await wait_until(lambda: engine.num_running == 0)
        assert engine.counters.finished[FinishReason.ABORT] == 1
    finally:
        await runner.cleanup()


async def test_a_hung_request_does_not_hold_up_shutdown(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    # aiohttp would wait up to its shutdown timeout for the handler: 30 s here, so that a
    # pod that leaves the hung handler running fails the guard by far, stall or not.
    pod = await start(shutdown_timeout=30.0)
    client = asyncio.create_task(
        http.post(pod.url + "/v1/completions", json=COMPLETION, headers=fail("hang"))
    )
    await wait_until(lambda: pod.pod.engine.num_running == 1)
    began = time.monotonic()
    await pod.close()
    assert time.monotonic() - began < 5.0
    assert pod.pod.engine.num_running == 0
    client.cancel()


# -- drop --------------------------------------------------------------------------------


async def test_drop_closes_the_connection_without_a_response(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    engine = pod.pod.engine
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with http.post(pod.url + "/v1/completions", json=COMPLETION, headers=fail("drop")):
            pass
    await wait_until(lambda: engine.num_running == 0)
    assert engine.counters.finished[FinishReason.ABORT] == 1
    assert engine.counters.prompt_tokens > 0  # it did reach the engine


async def test_drop_mid_stream_comes_after_the_first_chunk(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    engine = pod.pod.engine
    body = {**COMPLETION, "stream": True}
    async with http.post(pod.url + "/v1/completions", json=body, headers=fail("drop")) as resp:
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: {")
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    await wait_until(lambda: engine.num_running == 0)
    assert engine.counters.generation_tokens == 1
    assert engine.counters.finished[FinishReason.ABORT] == 1


async def test_drop_on_metrics(start: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with http.get(pod.url + "/metrics", headers=fail("drop")):
            pass


# -- random failures ---------------------------------------------------------------------


async def statuses(http: aiohttp.ClientSession, pod: RunningPod, count: int) -> list[int]:
    out = []
    for _ in range(count):
        async with http.post(
            pod.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}
        ) as resp:
            await resp.read()
            out.append(resp.status)
    return out


async def test_random_failures_follow_the_seed_and_the_kinds(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    config = FailureConfig(
        rate=0.5, kinds=(FailureKind.TOO_MANY_REQUESTS, FailureKind.UNAVAILABLE), seed=7
    )
    first = await statuses(http, await start(failures=config), 30)
    second = await statuses(http, await start(failures=config), 30)
    assert first == second
    assert set(first) == {200, 429, 503}
    assert 5 <= first.count(200) <= 25
    other_seed = await statuses(http, await start(failures=FailureConfig(rate=0.5, seed=8)), 30)
    assert other_seed != first


@pytest.mark.parametrize(("rate", "expected"), [(0.0, {200}), (1.0, {500})])
async def test_failure_rate_bounds(
    start: StartPod, http: aiohttp.ClientSession, rate: float, expected: set[int]
) -> None:
    pod = await start(failures=FailureConfig(rate=rate, kinds=(FailureKind.INTERNAL_ERROR,)))
    assert set(await statuses(http, pod, 5)) == expected


async def test_a_header_overrides_the_random_choice(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(failures=FailureConfig(rate=1.0, kinds=(FailureKind.INTERNAL_ERROR,)))
    async with http.post(pod.url + "/v1/completions", json=COMPLETION, headers=fail("429")) as resp:
        assert resp.status == 429


# -- slow, garbage and hung /metrics, /health ----------------------------------------------


async def test_metrics_delay_slows_every_scrape(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(failures=FailureConfig(metrics_delay_s=0.2))
    began = time.monotonic()
    async with http.get(pod.url + "/metrics") as resp:
        assert resp.status == 200
        await resp.read()
    assert time.monotonic() - began >= 0.2


async def test_slow_metrics_header_delays_one_scrape(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    async with http.get(pod.url + "/metrics") as resp:  # not slow without the header
        await resp.read()
    with pytest.raises(asyncio.TimeoutError):  # 2 s by default: beyond a 1 s scrape timeout
        async with http.get(pod.url + "/metrics", headers=fail("slow-metrics"), timeout=SHORT):
            pass
    configured = await start(failures=FailureConfig(metrics_delay_s=0.1))
    began = time.monotonic()
    async with http.get(configured.url + "/metrics", headers=fail("slow-metrics")) as resp:
        assert resp.status == 200
    assert 0.1 <= time.monotonic() - began < 1.0


async def test_sim_fail_switches_health_and_metrics_at_runtime(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    assert await fail_switch(http, pod, {"health": 503}) == (
        200,
        {"health": 503, "metrics": None, "tokenize": None, **NO_NEW_SWITCHES},
    )
    async with http.get(pod.url + "/health") as resp:
        assert resp.status == 503
    assert await fail_switch(http, pod, {"metrics": "garbage"}) == (
        200,
        {"health": 503, "metrics": "garbage", "tokenize": None, **NO_NEW_SWITCHES},
    )
    async with http.get(pod.url + "/metrics") as resp:
        assert resp.status == 200
        garbage = await resp.text(errors="replace")
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(garbage))
    await fail_switch(http, pod, {"metrics": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(pod.url + "/metrics", timeout=SHORT):
            pass
    assert await fail_switch(http, pod, {"health": None, "metrics": None}) == (
        200,
        {"health": None, "metrics": None, "tokenize": None, **NO_NEW_SWITCHES},
    )
    async with http.get(pod.url + "/health") as resp:
        assert resp.status == 200
    async with http.get(pod.url + "/metrics") as resp:
        assert "vllm:num_requests_running" in await resp.text()
    async with http.get(pod.url + "/sim/fail") as resp:
        assert await resp.json() == {
            "health": None,
            "metrics": None,
            "tokenize": None,
            **NO_NEW_SWITCHES,
        }


@pytest.mark.parametrize(
    "body",
    [
        {"health": 200, "metrics": "garbage"},
        {"health": "503"},
        {"health": True},
        {"health": 503, "metrics": "slow"},
        {"metrics": 1},
        {"healthy": 503, "metrics": "garbage"},
        [503],
    ],
)
async def test_sim_fail_refuses_bad_bodies_and_changes_nothing(
    start: StartPod, http: aiohttp.ClientSession, body: Any
) -> None:
    pod = await start()
    await fail_switch(http, pod, {"health": 500})
    status, payload = await fail_switch(http, pod, body)
    assert status == 400
    assert payload["error"]["code"] == 400
    async with http.get(pod.url + "/sim/fail") as resp:
        assert await resp.json() == {
            "health": 500,
            "metrics": None,
            "tokenize": None,
            **NO_NEW_SWITCHES,
        }


# -- configuration -----------------------------------------------------------------------


def test_parse_kinds() -> None:
    assert parse_kinds(" 429, drop,429,") == (FailureKind.TOO_MANY_REQUESTS, FailureKind.DROP)
    for bad in ("", "404", "slow-metrics"):
        with pytest.raises(ValueError):
            parse_kinds(bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"rate": -0.1},
        {"rate": 1.5},
        {"kinds": ()},
        {"kinds": (FailureKind.SLOW_METRICS,)},
        {"metrics_delay_s": -1.0},
    ],
)
def test_failure_config_refuses_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        FailureConfig(**bad)
