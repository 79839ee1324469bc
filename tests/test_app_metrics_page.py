"""/metrics as the service serves it (epp.serving.http over real HTTP): collected on the
routing loop, which owns what the collectors read, and encoded in a worker thread; the
page is whole and well-formed while the loop churns the endpoint store, and a scrape
during the churn never fails."""

from __future__ import annotations

import asyncio
import random
import subprocess
import threading
import urllib.request

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

import epp.observability.metrics as metrics_module
from epp.app import EppService
from epp.config import EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from tests.observability.pages import page_families

PODS = 300
CHURNED = 100  # pods replaced between the two lists the churn alternates


def pod(i: int) -> dict[str, object]:
    return {"name": f"pod-{i:04d}", "address": f"10.0.{i // 250}.{i % 250 + 1}:8000", "model": "m"}


def service_with_pods() -> EppService:
    config = EppConfig.model_validate(
        {
            "endpoints": [pod(i) for i in range(PODS)],
            "server": {"metrics_host": "127.0.0.1", "metrics_port": 0},
            "kv_events": {"mode": "approximate"},  # no subscriber per pod: a quiet log
            "log_level": "warning",
        }
    )
    service = EppService(config)
    service.store.sync(config.endpoints)
    scrape_all(service, random.Random(0))
    return service


def scrape_all(service: EppService, rng: random.Random) -> None:
    for endpoint in service.store.all():
        page = PodMetrics(model="m", kv_usage=rng.random() * 0.8, waiting=rng.randrange(5))
        service.store.scraped(endpoint, page)


async def serve(service: EppService) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(service._web_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def churn(service: EppService, stop: asyncio.Event) -> int:
    """Alternate two endpoint lists (CHURNED pods replaced each time) and rescrape a slice
    of the pods, yielding between steps: the store's dicts resize while scrapes come in."""
    configs = service.config.endpoints
    added = EppConfig.model_validate({"endpoints": [pod(PODS + i) for i in range(CHURNED)]})
    lists = [configs, configs[CHURNED:] + added.endpoints]
    rng = random.Random(1)
    rounds = 0
    while not stop.is_set():
        service.store.sync(lists[rounds % 2])
        await asyncio.sleep(0)
        for endpoint in service.store.all()[rounds % 10 :: 10]:
            page = PodMetrics(model="m", kv_usage=rng.random() * 0.8, waiting=rng.randrange(5))
            service.store.scraped(endpoint, page)
        await asyncio.sleep(0)
        rounds += 1
    return rounds


def fetch(port: int, count: int) -> list[tuple[int, str]]:
    pages = []
    for _ in range(count):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            pages.append((resp.status, resp.read().decode()))
    return pages


def samples(page: str, family: str) -> list[float]:
    for parsed in text_string_to_metric_families(page):
        if parsed.name == family:
            return [s.value for s in parsed.samples]
    raise AssertionError(f"{family} not on the page")


async def test_the_page_is_whole_while_the_loop_churns_the_store() -> None:
    service = service_with_pods()
    runner, port = await serve(service)
    stop = asyncio.Event()
    churning = asyncio.create_task(churn(service, stop))
    try:
        pages = await asyncio.to_thread(fetch, port, 10)
    finally:
        stop.set()
        rounds = await churning
        await runner.cleanup()
    assert rounds >= 10  # the store changed under the scrapes
    expected = set(page_families(service.metrics.exposition().decode()))
    for status, page in pages:
        assert status == 200
        list(text_string_to_metric_families(page))  # parses, every line
        assert set(page_families(page)) == expected
        # One snapshot: the pod count and every per-pod family agree.
        assert samples(page, "epp_pods") == [PODS]
        assert len(samples(page, "epp_queue_depth")) == PODS
        assert len(samples(page, "epp_pod_health_score")) == PODS
        # Read on the loop: a collector run in another thread sees no loop (0 tasks).
        assert samples(page, "epp_asyncio_tasks")[0] >= 1
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=pages[-1][1], capture_output=True, text=True
    )
    assert "error" not in (checked.stdout + checked.stderr).lower(), checked


async def test_collected_on_the_loop_encoded_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = service_with_pods()
    loop_thread = threading.get_ident()
    seen: dict[str, int] = {}
    collect, encode = service.metrics.registry.collect, metrics_module.generate_latest

    def recording_collect():  # type: ignore[no-untyped-def]
        seen["collect"] = threading.get_ident()
        return collect()

    def recording_encode(registry):  # type: ignore[no-untyped-def]
        seen["encode"] = threading.get_ident()
        return encode(registry)

    monkeypatch.setattr(service.metrics.registry, "collect", recording_collect)
    monkeypatch.setattr(metrics_module, "generate_latest", recording_encode)
    runner, port = await serve(service)
    try:
        ((status, page),) = await asyncio.to_thread(fetch, port, 1)
    finally:
        await runner.cleanup()
    assert status == 200 and samples(page, "epp_pods") == [PODS]
    assert seen["collect"] == loop_thread
    assert seen["encode"] != loop_thread
