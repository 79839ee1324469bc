"""One arm of `epp bench scrape`, run as a script in a process of its own so that its CPU
is the scraper's alone, and so that it runs whichever `epp` PYTHONPATH names (the frozen
"before" checkout, or the work tree): it uses only what both have (`MetricsScraper`,
`EndpointStore`, `DataLayerConfig`, `EndpointConfig`).

    python -c "$(cat scrape_worker.py)" '{"urls": [...], "interval_s": 0.05, "seconds": 10}'

prints one JSON line: the process CPU (user, system), the wall time, the pages read and
the failed scrapes, measured after a warm-up second. On uvloop, as `epp serve` runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time


async def run(spec: dict) -> dict:  # type: ignore[type-arg]
    from epp.config import DataLayerConfig, EndpointConfig
    from epp.datalayer.scraper import MetricsScraper
    from epp.datalayer.store import EndpointStore

    config = DataLayerConfig(
        scrape_interval_s=spec["interval_s"], scrape_timeout_s=2.0, **spec.get("config", {})
    )
    store = EndpointStore(config)
    store.sync(
        EndpointConfig(name=f"pod-{i}", address=f"127.0.0.{1 + i // 250}:{1 + i}", metrics_url=u)
        for i, u in enumerate(spec["urls"])
    )
    counts = {"pages": 0, "failures": 0}
    scraped, failed = store.scraped, store.scrape_failed

    def count_page(*args, **kwargs):  # type: ignore[no-untyped-def]
        counts["pages"] += 1
        return scraped(*args, **kwargs)

    def count_failure(*args, **kwargs):  # type: ignore[no-untyped-def]
        counts["failures"] += 1
        return failed(*args, **kwargs)

    store.scraped = count_page  # type: ignore[method-assign]
    store.scrape_failed = count_failure  # type: ignore[method-assign]
    scraper = MetricsScraper(store, config)
    await scraper.start()
    await asyncio.sleep(spec.get("warmup_s", 1.0))
    before = dict(counts)
    times0, wall0 = os.times(), time.perf_counter()
    await asyncio.sleep(spec["seconds"])
    times1, wall1 = os.times(), time.perf_counter()
    after = dict(counts)
    await scraper.stop()
    return {
        "user_s": times1.user - times0.user,
        "system_s": times1.system - times0.system,
        "wall_s": wall1 - wall0,
        "pages": after["pages"] - before["pages"],
        "failures": after["failures"] - before["failures"],
        "epp": os.path.dirname(os.path.dirname(sys.modules["epp"].__file__ or "")),
    }


if __name__ == "__main__":
    try:  # the loop `epp serve` runs on
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is optional on some platforms
        runner = asyncio.run
    print(json.dumps(runner(run(json.loads(sys.argv[1])))))
