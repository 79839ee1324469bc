"""Keeps every endpoint's metrics fresh: one keep-alive HTTP scrape loop per pod.

Fetching (aiohttp), parsing (metrics_parser, pure) and storing (EndpointStore) are
separate: the scraper writes no Endpoint field itself, it hands each page or failure to
the store; a failure of any kind in one pod's loop is recorded against that pod and never
leaves the loop, so one bad pod never affects another.

Each loop starts a scrape every `scrape_interval_s` on its `clock`, waiting with `sleep`
(both injected: tests drive the loops on a fake clock). The app connects the store's
`added`/`removed` events to `on_endpoint_change`, which starts and stops loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import aiohttp
import structlog

from epp.config import METRIC_SPEC_KEYS, DataLayerConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_parser import MetricsFormatError, PageReader
from epp.datalayer.store import EndpointStore
from epp.tls import ScrapeTls

log = structlog.get_logger("epp.scraper")

# A vLLM page is 50-70 KB; anything far larger is not a metrics page.
MAX_PAGE_BYTES = 8 * 1024 * 1024


def page_reader(config: DataLayerConfig) -> PageReader:
    """The reader of the series `config` names (validated at config load)."""
    return PageReader.from_texts(*(getattr(config, key) for key in METRIC_SPEC_KEYS))


class MetricsScraper:
    def __init__(
        self,
        store: EndpointStore,
        config: DataLayerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._config = config
        self._clock = clock
        self._sleep = sleep
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        # The series read from each page: built once, not per scrape.
        self.reader = page_reader(config)
        self.first_round = asyncio.Event()
        # https metrics URLs: CA / client certificate files, re-read when they change.
        self.tls = ScrapeTls(config, clock=clock)

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self._config.scrape_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        for endpoint in self._store.all():
            self._start_loop(endpoint)
        if not self._tasks:
            self.first_round.set()

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()

    def on_endpoint_change(self, event: str, endpoint: Endpoint) -> None:
        """An endpoint store event: a pod added gets a loop (once started), a pod removed
        loses its loop."""
        if event == "added" and self._session is not None:
            self._start_loop(endpoint)
        elif event == "removed":
            task = self._tasks.pop(endpoint.name, None)
            if task is not None:
                task.cancel()

    def _start_loop(self, endpoint: Endpoint) -> None:
        if endpoint.name not in self._tasks:
            self._tasks[endpoint.name] = asyncio.create_task(
                self._loop(endpoint), name=f"scrape:{endpoint.name}"
            )

    async def scrape_once(self, endpoint: Endpoint) -> None:
        assert self._session is not None
        dispatched_at_start = endpoint.dispatched_total
        url = endpoint.metrics_url
        tls = self.tls.context() if url[:6].lower() == "https:" else True
        try:
            async with self._session.get(url, ssl=tls) as response:
                if response.status != 200:
                    raise MetricsFormatError(f"HTTP {response.status}")
                raw = await response.content.read(MAX_PAGE_BYTES + 1)
                if len(raw) > MAX_PAGE_BYTES:
                    raise MetricsFormatError("metrics page larger than 8 MiB")
            metrics = self.reader.parse(raw.decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError, MetricsFormatError, OSError) as exc:
            self._store.scrape_failed(endpoint, f"{type(exc).__name__}: {exc}")
            if endpoint.consecutive_failures in (1, 10) or endpoint.consecutive_failures % 200 == 0:
                log.warning(
                    "scrape_failed",
                    pod=endpoint.name,
                    failures=endpoint.consecutive_failures,
                    error=endpoint.last_error,
                    health=round(endpoint.health, 3),
                )
        else:
            if endpoint.metrics_at is None:
                log.info("pod_scraped", pod=endpoint.name, model=metrics.model)
            self._store.scraped(endpoint, metrics, dispatched_at_start)

    async def _loop(self, endpoint: Endpoint) -> None:
        interval = self._config.scrape_interval_s
        clock = self._clock
        next_at = clock()
        while True:
            try:
                await self.scrape_once(endpoint)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not end this pod's scraping for good
                self._store.scrape_failed(endpoint, f"internal: {exc!r}")
                log.exception("scrape_internal_error", pod=endpoint.name)
            if not self.first_round.is_set() and all(
                e.metrics_at is not None or e.consecutive_failures for e in self._store.all()
            ):
                self.first_round.set()
            next_at += interval
            delay = next_at - clock()
            if delay < 0:  # fell behind (slow pod): do not burst to catch up
                next_at = clock()
                delay = 0.0
            await self._sleep(delay)
