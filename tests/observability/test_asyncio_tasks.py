"""`epp_asyncio_tasks` on the /metrics page: the tasks alive on the loop that renders it
(the EPP renders its page on its own loop), 0 off any loop."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from epp.observability.metrics import EppMetrics


def _tasks(page: bytes) -> float:
    for family in text_string_to_metric_families(page.decode()):
        if family.name == "epp_asyncio_tasks":
            return family.samples[0].value
    raise AssertionError("no epp_asyncio_tasks on the page")


def test_the_gauge_counts_the_tasks_alive_on_the_loop():
    metrics = EppMetrics()

    async def scene() -> tuple[float, float]:
        release = asyncio.Event()
        waiters = [asyncio.create_task(release.wait()) for _ in range(7)]
        await asyncio.sleep(0)
        during = _tasks(metrics.exposition())
        release.set()
        await asyncio.gather(*waiters)
        return during, _tasks(metrics.exposition())

    during, after = asyncio.run(scene())
    assert during == after + 7  # the 7 waiters, on top of the scene's own task
    assert after == 1
    assert _tasks(metrics.exposition()) == 0  # off the loop
