"""Keeps every endpoint's metrics fresh: one keep-alive HTTP scrape loop per pod.

Fetching (page_client, one kept-alive connection per pod), parsing (metrics_parser, pure,
straight from the fetched bytes) and storing (EndpointStore) are separate: the scraper
writes no Endpoint field itself, it hands each page or failure to the store; a failure of
any kind in one pod's loop is recorded against that pod and never leaves the loop, so one
bad pod never affects another.

Each loop starts a scrape every `scrape_interval_s` on its `clock`, waiting with `sleep`
(both injected: tests drive the loops on a fake clock). Where a fresh page does not pay it
waits longer (`_interval`): `scrape_idle_interval_s` for an idle pod,
`scrape_kv_events_interval_s` for a pod whose KV state comes as KV events. Such a pod's
loop sleeps until its next scrape is due unless `wake(pod)` is called; the wiring calls it
for what can shorten the interval: each dispatch of this router and each peer's dispatch
applied here (an idle pod turns busy) and a followed pod's events stopping (precise mode
detaches it). Woken, the loop rejoins the ticks of `scrape_interval_s` as if it had
ticked all along, and scrapes at the first one its interval allows. A busy pod's loop
ticks at `scrape_interval_s`. The app connects the store's `added`/`removed` events to
`on_endpoint_change`, which starts and stops loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urljoin, urlsplit

import structlog

from epp.config import METRIC_SPEC_KEYS, DataLayerConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_parser import MetricsFormatError, PageReader
from epp.datalayer.name_filter import honours, mount_url, scrape_url, without_filter
from epp.datalayer.page_client import MAX_PAGE_BYTES, PageClient, Response
from epp.datalayer.store import EndpointStore
from epp.tls import ScrapeTls

log = structlog.get_logger("epp.scraper")

_REDIRECTS = frozenset((301, 302, 303, 307, 308))

__all__ = ["MAX_PAGE_BYTES", "MetricsScraper", "page_reader", "scrape_url"]


def page_reader(config: DataLayerConfig) -> PageReader:
    """The reader of the series `config` names (validated at config load)."""
    return PageReader.from_texts(*(getattr(config, key) for key in METRIC_SPEC_KEYS))


# A mount URL that fails to answer (a timeout, a reset) is asked at this many scrapes
# before the pod goes unfiltered: one passing fault must not cost vLLM 3x the CPU per
# scrape for the pod's life, nor a hanging path an extra request every scrape.
MOUNT_TRIES = 3


class MetricsScraper:
    def __init__(
        self,
        store: EndpointStore,
        config: DataLayerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        kv_events_followed: Callable[[str], bool] | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._clock = clock
        self._sleep = sleep
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._clients: dict[str, PageClient] = {}
        # Pods whose server answered the `name[]` query with an error: asked for the
        # whole page (a server that is not prometheus_client's may refuse the query).
        self._unfiltered: set[str] = set()
        # Pod -> the metrics URL whose first page was checked against the filter.
        self._filter_checked: dict[str, str] = {}
        self._mount_tries: dict[str, int] = {}  # mount URL checks that failed to answer
        # An idle pod's loop's sleep, while it sleeps: `wake` cancels it.
        self._idle_sleeps: dict[str, asyncio.Future[None]] = {}
        self._running = False
        # The series read from each page: built once, not per scrape.
        self.reader = page_reader(config)
        self._filter = self.reader.names if config.scrape_name_filter else ()
        # Whether a pod's KV state comes as KV events (precise mode follows it): its page
        # may be read at `scrape_kv_events_interval_s`. None: no pod's does.
        self.kv_events_followed = kv_events_followed
        self.first_round = asyncio.Event()
        # https metrics URLs: CA / client certificate files, re-read when they change.
        self.tls = ScrapeTls(config, clock=clock)
        # A slower interval never lets a page go stale (datalayer/health.py).
        limit = config.stale_after_s / 2
        self._idle_s = max(config.scrape_interval_s, min(config.scrape_idle_interval_s, limit))
        self._events_s = max(
            config.scrape_interval_s, min(config.scrape_kv_events_interval_s, limit)
        )

    async def start(self) -> None:
        self._running = True
        for endpoint in self._store.all():
            self._start_loop(endpoint)
        if not self._tasks:
            self.first_round.set()

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def on_endpoint_change(self, event: str, endpoint: Endpoint) -> None:
        """An endpoint store event: a pod added gets a loop (once started), a pod removed
        loses its loop and its connection."""
        if event == "added" and self._running:
            self._start_loop(endpoint)
        elif event == "removed":
            task = self._tasks.pop(endpoint.name, None)
            if task is not None:
                task.cancel()
            client = self._clients.pop(endpoint.name, None)
            if client is not None:
                client.close()
            self._unfiltered.discard(endpoint.name)
            self._filter_checked.pop(endpoint.name, None)
            self._mount_tries.pop(endpoint.name, None)

    def wake(self, pod: str) -> None:
        """A request went to `pod` (this router's or a peer's): if its loop sleeps through
        an idle interval, it is scraped at the next fast tick. O(1): called per dispatch."""
        sleeping = self._idle_sleeps.pop(pod, None)
        if sleeping is not None:
            sleeping.cancel()

    def _start_loop(self, endpoint: Endpoint) -> None:
        if endpoint.name not in self._tasks:
            self._tasks[endpoint.name] = asyncio.create_task(
                self._loop(endpoint), name=f"scrape:{endpoint.name}"
            )

    def _client(self, endpoint: Endpoint) -> PageClient:
        """The pod's client; a new one (and connection) when its metrics URL changed."""
        client = self._clients.get(endpoint.name)
        if client is None or client.origin != endpoint.metrics_url:
            if client is not None:
                client.close()
            names = () if endpoint.name in self._unfiltered else self._filter
            url = scrape_url(endpoint.metrics_url, names)
            client = self._clients[endpoint.name] = PageClient(url, origin=endpoint.metrics_url)
        return client

    async def _fetch(self, endpoint: Endpoint) -> Response:
        """The pod's page. With the `name[]` filter on: a pod that refuses the query (a
        4xx: a 5xx is the server's own trouble) is asked again, and from then on,
        without it; a pod whose first page shows the query ignored is asked on the mount
        URL (`name_filter`: vLLM's /metrics/), kept if that honours it, else asked
        without the query from then on."""
        client = self._client(endpoint)
        tls = self.tls.context() if client.where.https else None
        response = await client.get(self._config.scrape_timeout_s, tls)
        if response.status in _REDIRECTS and response.location:
            response = await self._follow(endpoint, client, response.location, tls)
        name = endpoint.name
        if not self._filter or name in self._unfiltered:
            return response
        if 400 <= response.status < 500:
            self._unfilter(endpoint, f"HTTP {response.status}")
            return await self._client(endpoint).get(self._config.scrape_timeout_s, tls)
        if response.status == 200 and self._filter_checked.get(name) != endpoint.metrics_url:
            self._filter_checked[name] = endpoint.metrics_url
            if not honours(response.body, self._filter):
                return await self._filter_on_mount(endpoint, response, tls)
        return response

    async def _filter_on_mount(
        self, endpoint: Endpoint, ignored: Response, tls: ssl.SSLContext | None
    ) -> Response:
        """The pod's server ignored the query: its mount URL is asked (again at the next
        scrapes, up to MOUNT_TRIES, while it fails to answer); kept, and its page
        returned, if it honours the query, else the pod goes unfiltered. The page already
        fetched serves this scrape unless the mount's does."""
        client = self._clients[endpoint.name]
        target = mount_url(client.url)
        if target is not None:
            mounted = PageClient(target, origin=endpoint.metrics_url)
            try:
                response = await mounted.get(self._config.scrape_timeout_s, tls)
            except (TimeoutError, OSError, MetricsFormatError) as exc:
                mounted.close()
                tries = self._mount_tries[endpoint.name] = (
                    self._mount_tries.get(endpoint.name, 0) + 1
                )
                if tries < MOUNT_TRIES:  # a passing fault: asked again at the next scrape
                    del self._filter_checked[endpoint.name]
                    return ignored
                response = None
                log.info(
                    "scrape_name_filter_mount_failed", pod=endpoint.name, error=repr(exc)[:200]
                )
            if response is not None and response.status == 200 and honours(response.body, self._filter):  # fmt: skip
                client.close()
                self._clients[endpoint.name] = mounted
                log.info("scrape_name_filter_mount", pod=endpoint.name, url=target[:200])
                return response
            mounted.close()
        self._unfilter(endpoint, "query ignored")
        return ignored

    def _unfilter(self, endpoint: Endpoint, why: str) -> None:
        """The pod is asked for its whole page from the next request on (where a
        redirect moved it, if one did)."""
        self._unfiltered.add(endpoint.name)
        client = self._clients.pop(endpoint.name, None)
        if client is not None:
            client.close()
            if client.url != scrape_url(endpoint.metrics_url, self._filter):
                self._clients[endpoint.name] = PageClient(
                    without_filter(client.url), origin=endpoint.metrics_url
                )
        log.info("scrape_name_filter_off", pod=endpoint.name, reason=why)

    async def _follow(
        self, endpoint: Endpoint, client: PageClient, location: str, tls: ssl.SSLContext | None
    ) -> Response:
        """A redirect on the pod's own server (e.g. /metrics -> /metrics/, as a mounted
        ASGI app answers) is followed, and its target kept for the next scrapes; one to
        another server is an error (the pod's page is the pod's)."""
        target = urljoin(client.url, location)
        if urlsplit(target)[:2] != urlsplit(client.url)[:2]:
            raise MetricsFormatError(f"redirected to another server: {target[:120]}")
        client.close()
        moved = self._clients[endpoint.name] = PageClient(target, origin=endpoint.metrics_url)
        return await moved.get(self._config.scrape_timeout_s, tls)

    async def scrape_once(self, endpoint: Endpoint) -> None:
        dispatched_at_start = endpoint.dispatched_total
        try:
            response = await self._fetch(endpoint)
            if response.status != 200:
                raise MetricsFormatError(f"HTTP {response.status}")
            metrics = self.reader.parse(response.body)
        except (TimeoutError, MetricsFormatError, OSError) as exc:
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

    def _interval(self, endpoint: Endpoint, dispatched_mark: int) -> float:
        """How long after its last scrape the pod's next one is due. `dispatched_mark`: the
        pod's dispatch count when that scrape began (a dispatch since: not idle)."""
        fast = self._config.scrape_interval_s
        if endpoint.metrics is None or endpoint.consecutive_failures:
            return fast
        interval = fast
        followed = self.kv_events_followed
        if followed is not None and followed(endpoint.name):
            interval = self._events_s
        if self._idle(endpoint, dispatched_mark):
            interval = max(interval, self._idle_s)
        return interval

    def _sleeps_through(self, endpoint: Endpoint, dispatched_mark: int) -> bool:
        """Whether only a `wake` can shorten the pod's interval (module docstring)."""
        if self._idle(endpoint, dispatched_mark):
            return True
        followed = self.kv_events_followed
        return followed is not None and followed(endpoint.name)

    @staticmethod
    def _idle(endpoint: Endpoint, dispatched_mark: int) -> bool:
        """Nothing on its page, nothing in flight, no dispatch since the scrape began."""
        page = endpoint.metrics
        return (
            page is not None
            and page.running == 0
            and page.waiting == 0
            and endpoint.in_flight == 0
            and not endpoint.peer
            and endpoint.dispatched_total == dispatched_mark
        )

    async def _sleep_unless_woken(self, pod: str, delay: float) -> bool:
        """Sleep `delay`, or less if `wake(pod)` is called: whether it was."""
        sleeping = asyncio.ensure_future(self._sleep(delay))
        self._idle_sleeps[pod] = sleeping
        try:
            await asyncio.wait((sleeping,))
        finally:
            if self._idle_sleeps.get(pod) is sleeping:
                del self._idle_sleeps[pod]
            sleeping.cancel()
        return sleeping.cancelled()

    async def _loop(self, endpoint: Endpoint) -> None:
        fast = self._config.scrape_interval_s
        clock = self._clock
        next_at = clock()
        while True:
            began_at, mark = next_at, endpoint.dispatched_total
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
            # Ticks of the fast interval until the pod's interval has passed since
            # this scrape's slot; the interval is asked again at each tick, so a pod
            # that turns busy is scraped at the next one. A pod whose interval only a
            # wake can shorten skips the ticks and, when woken, rejoins them at the
            # next one.
            while True:
                next_at += fast
                interval = self._interval(endpoint, mark)
                if next_at - began_at < interval - 1e-9 and self._sleeps_through(endpoint, mark):
                    due = began_at + interval
                    if not await self._sleep_unless_woken(endpoint.name, max(0.0, due - clock())):
                        next_at = max(due, clock())
                        break
                    ticks = max(1, math.ceil((clock() - began_at) / fast - 1e-9))
                    next_at = began_at + ticks * fast
                delay = next_at - clock()
                if delay < 0:  # fell behind (slow pod): do not burst to catch up
                    next_at = clock()
                    delay = 0.0
                await self._sleep(delay)
                # 1e-9: the ticks' float sum may fall a hair short of the interval.
                if next_at - began_at >= self._interval(endpoint, mark) - 1e-9:
                    break
