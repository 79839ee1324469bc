"""Serving until the process is told to stop: the first SIGTERM/SIGINT drains (readiness
off, routing on until quiet or the drain timeout), a second one stops at once. Before
starting, the open-files soft limit is raised to the hard one (`limits`); once started,
the process's heap is frozen (`freeze_start_up_heap`)."""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import TYPE_CHECKING

import structlog

from epp.serving.limits import raise_open_files_limit

if TYPE_CHECKING:
    from epp.app import EppService

log = structlog.get_logger("epp.app")


async def serve_until_signalled(service: EppService) -> None:
    signals = 0
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        (stop if signals == 1 else hurry).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    warn_fallbacks(service.config.scheduling.fallbacks)
    raise_open_files_limit()  # ~5 fds a precise pod: the common 1,024 stops ~200 pods
    await service.start()
    freeze_start_up_heap()
    try:
        await stop.wait()
        drain = asyncio.ensure_future(service.drain())
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait({drain, hurried}, return_when=asyncio.FIRST_COMPLETED)
        for task in (drain, hurried):
            task.cancel()
    finally:
        # Short grace: routing streams still open finish; observers are cut (fail-open).
        await service.stop(grace_s=1.0)


def warn_fallbacks(fallbacks: int) -> None:
    """The EPP cannot see the gateway's config: say once what a fallback list needs."""
    if fallbacks > 0:
        log.warning(
            "fallback_list_needs_override_host",
            fallbacks=fallbacks,
            detail="the destination is a comma list; only a gateway that walks it "
            "(Envoy override_host) serves it, an ORIGINAL_DST cluster answers 503",
        )


def freeze_start_up_heap() -> None:
    """Move what start-up built (modules, config, the first discovery's endpoints,
    tokenizers) out of the collector's generations (gc.freeze): it lives as long as the
    process, and a full collection, which holds the GIL and so the routing loop, then
    scans only what came later: the pauses a relist or a scrape leaves behind shrink
    several times (docs/benchmarks/loop.md). A frozen object that later ends in a
    reference cycle is never freed: bounded by what start-up built. Only the serving
    process does this (`epp serve`), not `start()`, which tests call many times in one
    process."""
    gc.collect()
    gc.freeze()
