"""The debug pages: only on a loopback address, and `/debug/index` bounded and computed
with the event loop free between slices of the pod's map. Real HTTP on 127.0.0.1, the
real EppService and the real EngineMap."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from aiohttp import web

from epp.app import EppService
from epp.config import EppConfig
from epp.observability.debug_pages import MAX_LIMIT, debug_routes
from epp.prefix.engine_map import EngineMap


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def get(url: str) -> tuple[int, bytes]:
    return await asyncio.to_thread(_get, url)


def service(**server: object) -> EppService:
    config = EppConfig.model_validate(
        {
            "endpoints": [{"name": "pod-a", "address": "127.0.0.1:9"}],
            "server": {"grpc_port": 0, "grpc_health_port": 0, "metrics_port": 0, **server},
        }
    )
    return EppService(config)


async def test_debug_pages_are_not_on_a_public_metrics_port():
    """Metrics on 0.0.0.0 (the default): Prometheus and the probes there, debug pages only
    on 127.0.0.1:debug_port."""
    svc = service(metrics_host="0.0.0.0", debug_port=0)
    await svc.start()
    try:
        public = f"http://127.0.0.1:{svc.metrics_port}"
        assert (await get(f"{public}/metrics"))[0] == 200
        assert (await get(f"{public}/healthz"))[0] == 200
        for page in ("/debug/endpoints", "/debug/index?pod=pod-a"):
            assert (await get(public + page))[0] == 404, page
        assert svc.debug_address is not None and svc.debug_address.startswith("127.0.0.1:")
        assert svc._debug_runner is not None
        assert {host for host, _port in svc._debug_runner.addresses} == {"127.0.0.1"}
        status, body = await get(f"http://{svc.debug_address}/debug/endpoints")
        assert status == 200 and json.loads(body)[0]["name"] == "pod-a"
        status, body = await get(f"http://{svc.debug_address}/debug/index?pod=nope")
        assert status == 404 and "unknown pod" in json.loads(body)["error"]
    finally:
        await svc.stop(grace_s=0.1)


async def test_a_loopback_metrics_port_keeps_them_and_null_turns_them_off():
    svc = service(metrics_host="127.0.0.1")
    await svc.start()
    try:
        assert svc._debug_runner is None  # no second listener
        assert svc.debug_address == f"127.0.0.1:{svc.metrics_port}"
        status, _ = await get(f"http://{svc.debug_address}/debug/endpoints")
        assert status == 200
    finally:
        await svc.stop(grace_s=0.1)
    svc = service(metrics_host="127.0.0.1", debug_port=None)
    await svc.start()
    try:
        assert svc.debug_address is None
        status, _ = await get(f"http://127.0.0.1:{svc.metrics_port}/debug/endpoints")
        assert status == 404
    finally:
        await svc.stop(grace_s=0.1)


async def test_a_debug_port_in_use_does_not_stop_the_service():
    holder = service(metrics_host="0.0.0.0", debug_port=0)
    await holder.start()
    try:
        taken = int(holder.debug_address.rsplit(":", 1)[1])  # type: ignore[union-attr]
        svc = service(metrics_host="0.0.0.0", debug_port=taken)
        await svc.start()
        try:
            assert svc.debug_address is None
            assert (await get(f"http://127.0.0.1:{svc.metrics_port}/metrics"))[0] == 200
        finally:
            await svc.stop(grace_s=0.1)
    finally:
        await holder.stop(grace_s=0.1)


# -- /debug/index over a real EngineMap ------------------------------------------------


@pytest.fixture
async def index_page() -> Iterator[tuple[str, set[int], list[int]]]:
    """A page server over one pod whose map holds 50,000 engine blocks; the list counts
    the turns a concurrent task got while pages were computed."""
    rng = random.Random(5)
    engine = EngineMap(50_000)
    hashes: set[int] = set()
    while len(hashes) < 50_000:
        h = rng.getrandbits(64)
        if engine.add(h, rng.getrandbits(64)):
            hashes.add(h)
    routes = debug_routes(
        lambda: [],
        lambda: ["pod-a"],
        lambda pod: {"mode": "precise", "blocks": len(engine), "capacity": 50_000},
        lambda pod: (len(engine), engine.hash_slices()),
    )
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    turns = [0]
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            turns[0] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        yield f"http://127.0.0.1:{port}/debug/index?pod=pod-a", hashes, turns
    finally:
        stop.set()
        await task
        await runner.cleanup()


async def test_index_pages_are_bounded_and_walk_every_block_once(index_page):
    url, hashes, turns = index_page
    status, body = await get(url)
    page = json.loads(body)
    assert status == 200 and page["engine_blocks_total"] == 50_000
    assert len(page["engine_blocks"]) == 1000 and page["limit"] == 1000  # the default
    seen: list[str] = []
    after = None
    while True:
        query = f"{url}&limit={MAX_LIMIT}" + (f"&after={after}" if after else "")
        status, body = await get(query)
        page = json.loads(body)
        assert status == 200 and len(page["engine_blocks"]) <= MAX_LIMIT
        seen += page["engine_blocks"]
        after = page.get("next")
        if after is None:
            break
    assert seen == sorted(f"{h:016x}" for h in hashes)  # ascending, each once
    # The map is read in slices with the loop free between them (12+ slices a page).
    before = turns[0]
    await get(f"{url}&limit={MAX_LIMIT}")
    assert turns[0] - before >= 10


@pytest.mark.parametrize("query", ["&limit=-1", f"&limit={MAX_LIMIT + 1}", "&limit=x", "&after=zz"])
async def test_bad_index_queries_get_a_400(index_page, query):
    url, _hashes, _turns = index_page
    status, body = await get(url + query)
    assert status == 400 and "error" in json.loads(body)


async def test_an_unknown_pod_is_a_404(index_page):
    url, _hashes, _turns = index_page
    status, _ = await get(url.replace("pod-a", "nope"))
    assert status == 404
