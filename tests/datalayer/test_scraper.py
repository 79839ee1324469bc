"""The scraper against real HTTP servers on loopback: a vLLM page, garbage, a dead port,
a server that hangs. One bad pod never disturbs another's state."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from aiohttp import web

from epp.config import DataLayerConfig, EndpointConfig
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore

PAGE = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.33-metrics.txt").read_text()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def serve(routes: dict[str, web.RequestHandler]) -> tuple[web.AppRunner, int]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def test_scraper_updates_good_pods_and_degrades_bad_ones():
    hang = asyncio.Event()

    async def good(_):
        return web.Response(text=PAGE)

    async def garbage(_):
        return web.Response(text="<html>oops</html>")

    async def hung(_):
        await hang.wait()
        return web.Response(text=PAGE)

    runner, port = await serve({"/good": good, "/garbage": garbage, "/hung": hung})
    config = DataLayerConfig(scrape_interval_s=0.02, scrape_timeout_s=0.2, stale_after_s=0.5)
    store = EndpointStore(config)
    store.sync(
        [
            EndpointConfig(
                name="good",
                address=f"127.0.0.1:{port}",
                metrics_url=f"http://127.0.0.1:{port}/good",
            ),
            EndpointConfig(
                name="garbage",
                address="127.0.0.1:2",
                metrics_url=f"http://127.0.0.1:{port}/garbage",
            ),
            EndpointConfig(name="dead", address=f"127.0.0.1:{closed_port()}"),
            EndpointConfig(
                name="hung", address="127.0.0.1:3", metrics_url=f"http://127.0.0.1:{port}/hung"
            ),
        ]
    )
    scraper = MetricsScraper(store, config)
    await scraper.start()
    try:
        await asyncio.wait_for(scraper.first_round.wait(), 5)
        await asyncio.sleep(0.8)
        store.refresh_health()
        good_pod = store.get("good")
        assert good_pod.metrics.waiting == 3.0 and good_pod.health == 1.0
        assert good_pod.model == "meta-llama/Llama-3.1-8B-Instruct"
        for name in ("garbage", "dead", "hung"):
            pod = store.get(name)
            assert pod.health < 0.3, (name, pod.health, pod.last_error)
            assert pod.consecutive_failures >= 1 and pod.last_error
        assert "no vLLM metrics" in store.get("garbage").last_error
        # Removing a pod stops its loop; adding one starts a loop.
        store.sync(
            [
                EndpointConfig(
                    name="good",
                    address=f"127.0.0.1:{port}",
                    metrics_url=f"http://127.0.0.1:{port}/good",
                )
            ]
        )
        assert set(scraper._tasks) == {"good"}
    finally:
        hang.set()
        await scraper.stop()
        await runner.cleanup()
