"""Admission under pressure, measured on the real Router (in process, no network):

- **hol**: 8 pods of one model, p0 saturated and a request whose subset hint names only
  p0 waiting (flow_control.ttl_s 5 s); then 100 requests for any pod arrive at 100/s,
  each served in 20 ms. How long do they wait, how many are refused?
- **release**: 64 pods of one model, all saturated, 64 requests waiting; one request per
  pod completes, all in one event-loop step (as a batch of observer streams ending
  together does). How long until all 64 are dispatched, with the service's 250 ms tick
  running as `EppService._maintain` runs it?
- **cost**: the price of a backlog: microseconds per release pass (the tick's) and per
  arriving request, with 1,000 requests waiting while every one of 100 pods is full,
  without subset hints and over 10 distinct hints.

    .venv/bin/python -m epp_bench.picker.admission

It uses only the Router's public calls, so running it with the previous source first on
PYTHONPATH measures the code before a change.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from epp.app import HEALTH_REFRESH_S, connect
from epp.config import EndpointConfig, EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.observability.logs import configure_logging
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest, RequestRejected
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.tokenization.estimate import ByteEstimateTokenizer

ONE_EACH = {"max_queue": 1, "running_slots": 1}  # 1 running + 1 queued: saturated


def address(i: int) -> str:
    return f"127.0.{i // 250}.{i % 250 + 1}:8000"


def router(pods: int, ttl_s: float = 60.0, max_requests: int = 1000) -> Router:
    cfg = EppConfig.model_validate(
        {
            "scheduling": ONE_EACH,
            "flow_control": {"ttl_s": ttl_s, "max_requests": max_requests},
            "endpoints": [
                {"name": f"p{i}", "address": address(i), "model": "m"} for i in range(pods)
            ],
        }
    )
    store = EndpointStore.for_config(cfg)
    store.sync([EndpointConfig.model_validate(e.model_dump()) for e in cfg.endpoints])
    for e in store.all():
        store.scraped(e, PodMetrics(model="m"))
    index = PrefixIndex.from_config(cfg.prefix)
    built = Router(
        cfg, store, index, Scheduler(cfg.scheduling), ByteEstimateTokenizer(), EppMetrics()
    )
    connect(store, index, built, cfg)
    return built


def body(i: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"question {i} " * 30}).encode()


def route(r: Router, i: int, subset: frozenset[str] | None = None):
    return r.route(
        IncomingRequest(path="/v1/completions", body=body(i), request_id=f"r{i}", subset=subset)
    )


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def ticking(r: Router) -> None:
    while True:  # the tick of EppService._maintain
        await asyncio.sleep(HEALTH_REFRESH_S)
        r.tick()


async def hol() -> dict:
    r = router(8, ttl_s=5.0)
    only_p0 = frozenset({address(0)})
    for i in range(2):
        await route(r, i, only_p0)  # p0 saturated, for good
    hinted = asyncio.ensure_future(route(r, 10, only_p0))
    await turns()
    tick = asyncio.ensure_future(ticking(r))
    loop = asyncio.get_running_loop()
    waits: list[float] = []
    refused = 0

    async def one(i: int) -> None:
        nonlocal refused
        started = time.perf_counter()
        try:
            routed = await route(r, 100 + i)
        except RequestRejected:
            refused += 1
            return
        waits.append(time.perf_counter() - started)
        loop.call_later(0.02, r.complete, routed.token, 200)  # served in 20 ms

    arrivals = []
    for i in range(100):  # 100 req/s for 1 s, pods p1..p7 idle
        arrivals.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(0.01)
    await asyncio.gather(*arrivals)
    for task in (hinted, tick):
        task.cancel()
    await asyncio.gather(hinted, tick, return_exceptions=True)
    waits.sort()
    return {
        "requests": 100,
        "refused": refused,
        "wait_p50_ms": round(1000 * waits[len(waits) // 2], 2) if waits else None,
        "wait_max_ms": round(1000 * waits[-1], 2) if waits else None,
    }


async def release() -> dict:
    r = router(64)
    held = [await route(r, i) for i in range(128)]
    waiters = [asyncio.ensure_future(route(r, 1000 + i)) for i in range(64)]
    await turns()
    assert r.waiting == 64
    tick = asyncio.ensure_future(ticking(r))
    first: dict[str, object] = {}
    for routed in held:
        first.setdefault(routed.endpoint.name, routed)
    started = time.perf_counter()
    for routed in first.values():
        r.complete(routed.token, 200)
    await asyncio.wait(waiters, timeout=60)
    elapsed = time.perf_counter() - started
    tick.cancel()
    await asyncio.gather(tick, return_exceptions=True)
    return {"dispatched": sum(w.done() for w in waiters), "all_dispatched_after_s": elapsed}


async def cost_with(placements: int) -> dict:
    """1,000 waiting requests, every pod full; `placements` distinct subset hints (0: no
    hint, one placement)."""
    r = router(100, max_requests=2000)
    held = [await route(r, i) for i in range(200)]
    hints = [frozenset({address(i)}) for i in range(placements)] or [None]
    waiters = [
        asyncio.ensure_future(route(r, 1000 + i, hints[i % len(hints)])) for i in range(1000)
    ]
    await turns(50)
    assert r.waiting == 1000, r.waiting
    samples = []
    for _ in range(200):  # a pass after room may have returned (the tick's): nothing fits
        started = time.perf_counter()
        r.tick()
        samples.append(time.perf_counter() - started)
    arrivals = []
    for i in range(200):  # requests joining the backlog, the pool still full
        task = asyncio.ensure_future(route(r, 5000 + i, hints[i % len(hints)]))
        started = time.perf_counter()
        await asyncio.sleep(0)  # the task runs to its wait
        arrivals.append(time.perf_counter() - started)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    del held
    return {
        "tick_pass_us": round(1e6 * statistics.median(samples), 1),
        "arrival_us": round(1e6 * statistics.median(arrivals), 1),
    }


async def cost() -> dict:
    return {"no_hint": await cost_with(0), "10_hints": await cost_with(10)}


async def run() -> dict:
    return {"hol": await hol(), "release": await release(), "cost": await cost()}


def main() -> int:
    configure_logging("warning")
    print(json.dumps(asyncio.run(run()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
