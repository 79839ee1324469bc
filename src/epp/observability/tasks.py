"""`epp_asyncio_tasks`: the asyncio tasks alive on the EPP's event loop.

Every ext_proc stream, queued request, subscriber and background step is a task, so the
count follows the load and must come back down when the load does; a count that only grows
is a leak (a stream or a waiter never finished). It is read when /metrics is scraped,
which happens on the loop itself; a page rendered off the loop (a test, a tool) has no
loop to count and reports 0.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge


def running_task_count() -> int:
    """Tasks not yet done on the calling thread's running loop (0 without one)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # no running loop in this thread
        return 0


def register_task_gauge(registry: CollectorRegistry) -> Gauge:
    gauge = Gauge(
        "epp_asyncio_tasks",
        "asyncio tasks alive on the EPP's event loop (streams, waiters, background work),"
        " counted at scrape time.",
        registry=registry,
    )
    gauge.set_function(running_task_count)
    return gauge
