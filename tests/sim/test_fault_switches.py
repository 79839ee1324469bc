"""The pod-wide switches of the fault suite (`POST /sim/fail`: generation, delay_ms, frozen
metrics, kv_events; `POST /sim/kv/restart`), over real HTTP and real ZMQ."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import zmq
import zmq.asyncio

from vllm_sim.failures import INJECTED_HEADER
from vllm_sim.kv_publisher import KvEventsConfig

from .conftest import StartPod
from .test_failures import COMPLETION, SHORT, fail_switch
from .test_kv_publisher import complete, receive, replay, subscribe


async def test_generation_switch_fails_every_request_until_cleared(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    assert (await fail_switch(http, pod, {"generation": "503"}))[1]["generation"] == "503"
    for _ in range(3):
        async with http.post(pod.url + "/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 503
            assert resp.headers[INJECTED_HEADER] == "503"
    await fail_switch(http, pod, {"generation": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(pod.url + "/v1/completions", json=COMPLETION, timeout=SHORT):
            pass
    await fail_switch(http, pod, {"generation": None})
    async with http.post(pod.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200


async def test_delay_switch_starts_every_request_late(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    # A delay long against a stall of the shared test machine: sleeps never end early, so
    # the lower bound is exact, and a request once the switch is cleared takes milliseconds.
    pod = await start()
    await fail_switch(http, pod, {"delay_ms": 1500})
    began = time.monotonic()
    async with http.post(pod.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200
    assert time.monotonic() - began >= 1.5
    await fail_switch(http, pod, {"delay_ms": None})
    began = time.monotonic()
    async with http.post(pod.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200
    assert time.monotonic() - began < 1.5  # the delay is gone


@pytest.mark.parametrize(
    "body",
    [{"generation": "slow-metrics"}, {"delay_ms": -1}, {"delay_ms": 1.5}, {"kv_events": "x"}],
)
async def test_bad_switch_values_are_refused(
    start: StartPod, http: aiohttp.ClientSession, body: dict
) -> None:
    pod = await start()
    status, _ = await fail_switch(http, pod, body)
    assert status == 400


async def test_frozen_metrics_repeat_the_page_while_the_engine_moves_on(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    await fail_switch(http, pod, {"metrics": "frozen"})
    async with http.get(pod.url + "/metrics") as resp:
        frozen = await resp.read()
    async with http.post(pod.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200
    async with http.get(pod.url + "/metrics") as resp:
        assert await resp.read() == frozen
    await fail_switch(http, pod, {"metrics": None})
    async with http.get(pod.url + "/metrics") as resp:
        assert await resp.read() != frozen


async def kv_pod(start: StartPod):
    pod = await start(kv_events=KvEventsConfig(port=0, replay_port=0))
    assert pod.kv_publisher is not None and pod.kv_publisher.pub_port
    return pod, pod.kv_publisher


async def test_kv_events_drop_reorder_and_duplicate_on_the_wire(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    context = zmq.asyncio.Context()
    try:
        pod, publisher = await kv_pod(start)
        sub = await subscribe(context, publisher.pub_port)
        prompts = iter(list(range(n * 100, n * 100 + 32)) for n in range(100))

        async def one_request() -> None:
            await complete(http, pod, next(prompts))

        async def received(count: int) -> list[int]:
            return [(await receive(sub))[1] for _ in range(count)]

        await one_request()
        first = (await received(1))[0]
        await fail_switch(http, pod, {"kv_events": "duplicate"})
        await one_request()
        assert await received(2) == [first + 1, first + 1]
        await fail_switch(http, pod, {"kv_events": "reorder"})
        await one_request()
        await one_request()
        assert await received(2) == [first + 3, first + 2]
        await fail_switch(http, pod, {"kv_events": "drop"})
        await one_request()
        await fail_switch(http, pod, {"kv_events": None})
        await one_request()
        assert await received(1) == [first + 5]  # first + 4 lost on the wire
        # ... but kept for a replay.
        replayed = await replay(context, publisher.replay_port, first + 4)
        assert len(replayed) == 3  # first + 4, first + 5, the end marker
    finally:
        context.destroy(linger=0)


async def test_publisher_restart_starts_the_sequence_again_and_empties_the_buffer(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    context = zmq.asyncio.Context()
    try:
        pod, publisher = await kv_pod(start)
        ports = publisher.pub_port, publisher.replay_port
        await complete(http, pod, list(range(32)))
        await complete(http, pod, list(range(100, 132)))
        assert publisher.next_seq > 0
        async with http.post(pod.url + "/sim/kv/restart") as resp:
            assert resp.status == 200
            assert (await resp.json())["next_seq"] == 0
        assert (publisher.pub_port, publisher.replay_port) == ports
        assert len(await replay(context, publisher.replay_port, 0)) == 1  # the end marker
        sub = await subscribe(context, publisher.pub_port)
        # A cached prefix stores no block: a new prompt does, numbered from 0 again.
        await complete(http, pod, list(range(200, 232)))
        assert (await receive(sub))[1] == 0
    finally:
        context.destroy(linger=0)


async def test_restart_without_a_publisher_is_404(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start()
    async with http.post(pod.url + "/sim/kv/restart") as resp:
        assert resp.status == 404
