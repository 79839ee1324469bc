"""The scraper against real HTTP servers on loopback: a vLLM page, garbage, a dead port,
a server that hangs. One bad pod never disturbs another's state. Its pacing on an
injected clock: one scrape per interval, no burst after a slow one."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from aiohttp import web

from epp.config import DataLayerConfig, EndpointConfig
from epp.datalayer.metrics_parser import PodMetrics
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
    store.on_change(scraper.on_endpoint_change)  # as the app connects it
    await scraper.start()
    try:
        # Every pod tried once (the hung one until its 0.2 s timeout), and the good pod
        # answered after that: a failure counts once another pod answered after it.
        await asyncio.wait_for(scraper.first_round.wait(), 5)
        bad = [store.get(name) for name in ("garbage", "dead", "hung")]
        for _ in range(100):
            store.refresh_health()
            if all(pod.charged_failures for pod in bad):
                break
            await asyncio.sleep(0.01)
        good_pod = store.get("good")
        assert good_pod.metrics.waiting == 3.0 and good_pod.health == 1.0
        assert good_pod.model == "meta-llama/Llama-3.1-8B-Instruct"
        for name in ("garbage", "dead", "hung"):
            pod = store.get(name)
            assert pod.health < 0.3, (name, pod.health, pod.last_error)
            assert pod.consecutive_failures >= 1 and pod.last_error
        assert "no model server metrics" in store.get("garbage").last_error
        # Removing a pod stops its loop; adding one starts a loop.
        good_config = EndpointConfig(
            name="good", address=f"127.0.0.1:{port}", metrics_url=f"http://127.0.0.1:{port}/good"
        )
        store.sync([good_config])
        assert set(scraper._tasks) == {"good"}
        store.sync([good_config, EndpointConfig(name="new", address="127.0.0.1:4")])
        assert set(scraper._tasks) == {"good", "new"}
    finally:
        hang.set()
        await scraper.stop()
        await runner.cleanup()


class FakeTime:
    """The scraper's injected clock and sleep: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def scripted(
    scraper: MetricsScraper,
    store: EndpointStore,
    time: FakeTime,
    fetch_s: list,
    pages: list[PodMetrics] | None = None,
):
    """Replaces the HTTP fetch: each scrape takes `fetch_s[i]` on the fake clock (or
    raises it, if it is an exception) and stores `pages[i]` (default: a page with one
    request running: a busy pod, scraped at the fast interval); after the last one the
    loop waits for ever."""
    started: list[float] = []
    finished = asyncio.Event()

    async def scrape_once(endpoint):
        started.append(time.now)
        if len(started) > len(fetch_s):
            finished.set()
            await asyncio.Event().wait()
        took = fetch_s[len(started) - 1]
        if isinstance(took, Exception):
            raise took
        time.now += took
        page = pages[len(started) - 1] if pages else PodMetrics(running=1.0, model="m")
        store.scraped(endpoint, page)

    scraper.scrape_once = scrape_once
    return started, finished


async def test_a_loop_scrapes_once_per_interval_and_does_not_burst_after_a_slow_scrape():
    time = FakeTime()
    config = DataLayerConfig(scrape_interval_s=0.05)
    store = EndpointStore(config, time)
    store.sync([EndpointConfig(name="p", address="127.0.0.1:9")])
    scraper = MetricsScraper(store, config, clock=time, sleep=time.sleep)
    started, finished = scripted(scraper, store, time, [0.01, 0.01, 0.12, 0.01])
    await run_through(scraper, finished)
    assert scraper.first_round.is_set()
    # 0.10 + 0.12 ends at 0.22, past the 0.15 slot: the next starts at once, and the
    # rhythm restarts from there (no catch-up scrape for the missed slot).
    assert started == pytest.approx([0.0, 0.05, 0.10, 0.22, 0.27])
    assert store.get("p").metrics_at == pytest.approx(0.23)


async def test_a_bug_while_scraping_is_a_failed_scrape_and_the_loop_goes_on():
    time = FakeTime()
    config = DataLayerConfig(scrape_interval_s=0.05)
    store = EndpointStore(config, time)
    store.sync([EndpointConfig(name="p", address="127.0.0.1:9")])
    scraper = MetricsScraper(store, config, clock=time, sleep=time.sleep)
    failures = []
    store.on_change(lambda event, e: failures.append(e.last_error) if e.last_error else None)
    started, finished = scripted(scraper, store, time, [RuntimeError("bug"), 0.01])
    await run_through(scraper, finished)
    assert failures == ["internal: RuntimeError('bug')"]
    assert started == pytest.approx([0.0, 0.05, 0.10])
    pod = store.get("p")
    assert pod.consecutive_failures == 0 and pod.metrics_at == pytest.approx(0.06)


IDLE = PodMetrics(model="m")  # nothing running, nothing waiting
BUSY = PodMetrics(running=1.0, model="m")


class Timeline(FakeTime):
    """FakeTime that runs `at[t]()` when the clock first reaches t (a dispatch, say)."""

    def __init__(self, at: dict[float, object]) -> None:
        super().__init__()
        self.at = dict(at)
        self.sleeps = 0  # sleeps that ran to their end

    async def sleep(self, seconds: float) -> None:
        end = self.now + seconds
        for when in sorted(self.at):
            if when - 1e-9 <= end:
                self.now = max(self.now, when)
                self.at.pop(when)()
                # A sleep cancelled here (MetricsScraper.wake) ends at `when`.
                await asyncio.sleep(0)
        self.now = max(self.now, end)
        self.sleeps += 1
        await asyncio.sleep(0)


async def run_scripted(config, time, fetch_s, pages, **scraper_args):
    store = EndpointStore(config, time)
    store.sync([EndpointConfig(name="p", address="127.0.0.1:9")])
    scraper = MetricsScraper(store, config, clock=time, sleep=time.sleep, **scraper_args)
    started, finished = scripted(scraper, store, time, fetch_s, pages)
    return store, scraper, started, finished


async def run_through(scraper: MetricsScraper, finished: asyncio.Event) -> None:
    """Run the scraper's loops until the script's pages are used up, then stop them."""
    await scraper.start()
    try:
        await asyncio.wait_for(finished.wait(), 5)
    finally:
        await scraper.stop()


def dispatch(store: EndpointStore, scraper: MetricsScraper, pod, seq: list[int]) -> None:
    """A request routed to `pod`: the store counts it and the router's hook (epp.wiring)
    wakes the pod's scrape loop."""
    seq.append(store.dispatched(pod))
    scraper.wake(pod.name)


async def test_an_idle_pod_is_scraped_slowly_until_a_request_is_dispatched_to_it():
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_idle_interval_s=0.5)
    time = Timeline({})
    store, scraper, started, finished = await run_scripted(
        config, time, [0.0] * 5, [IDLE, IDLE, BUSY, BUSY, IDLE]
    )
    # A dispatch at 0.72 (between two ticks): the pod is scraped at the next tick, 0.75.
    pod = store.get("p")
    seq: list[int] = []
    time.at[0.72] = lambda: dispatch(store, scraper, pod, seq)
    time.at[0.82] = lambda: store.completed(pod, 200, seq[0])
    await run_through(scraper, finished)
    # Busy pages: the fast interval; an idle one once the request completed: slow.
    assert started == pytest.approx([0.0, 0.5, 0.75, 0.8, 0.85, 1.35])


async def test_in_flight_or_peer_work_keeps_an_idle_page_at_the_fast_interval():
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_idle_interval_s=0.5)
    time = Timeline({})
    store, scraper, started, finished = await run_scripted(config, time, [0.0] * 3, [IDLE] * 3)
    pod = store.get("p")
    store.dispatched(pod)  # in flight before the first page, still open after it
    await run_through(scraper, finished)
    assert started == pytest.approx([0.0, 0.05, 0.1, 0.15])
    time = Timeline({})
    store, scraper, started, finished = await run_scripted(config, time, [0.0] * 2, [IDLE] * 2)
    store.peer_dispatched(store.get("p"))
    await run_through(scraper, finished)
    assert started[:2] == pytest.approx([0.0, 0.05])


async def test_a_pod_followed_by_kv_events_is_scraped_at_its_interval_until_it_is_not():
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_kv_events_interval_s=0.2)
    followed = {"p": True}
    time = Timeline({})
    _, scraper, started, finished = await run_scripted(
        config, time, [0.0] * 4, [BUSY] * 4, kv_events_followed=followed.__getitem__
    )

    def events_stop() -> None:  # precise mode detaches the pod; the wiring wakes its loop
        followed.update(p=False)
        scraper.wake("p")

    time.at[0.45] = events_stop
    await run_through(scraper, finished)
    # Busy (one running) yet slow: the KV state comes as events. No longer followed
    # at 0.45: scraped at once (the 0.45 tick), then at the fast interval.
    assert started == pytest.approx([0.0, 0.2, 0.4, 0.45, 0.5])
    # The followed stretch slept through its intervals: no fast ticks (0.0-0.45:
    # 2 sleeps and the cut one, instead of 9 ticks).
    assert time.sleeps <= 4


async def test_a_dispatch_to_a_followed_pod_does_not_shorten_its_interval():
    """A wake re-asks the interval: a followed pod's is still the KV-event one."""
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_kv_events_interval_s=0.2)
    time = Timeline({})
    store, scraper, started, finished = await run_scripted(
        config, time, [0.0] * 3, [BUSY] * 3, kv_events_followed=lambda _: True
    )
    seq: list[int] = []
    time.at[0.07] = lambda: dispatch(store, scraper, store.get("p"), seq)
    await run_through(scraper, finished)
    assert started == pytest.approx([0.0, 0.2, 0.4, 0.6])


async def test_a_failed_scrape_of_an_idle_pod_is_retried_at_the_fast_interval():
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_idle_interval_s=0.5)
    time = Timeline({})
    failed = OSError("refused")
    store, scraper, started, finished = await run_scripted(
        config, time, [0.0, failed, 0.0], [IDLE, IDLE, IDLE]
    )

    async def failing_then_scripted(endpoint, scripted_once=scraper.scrape_once):
        try:
            await scripted_once(endpoint)
        except OSError as exc:
            store.scrape_failed(endpoint, f"OSError: {exc}")

    scraper.scrape_once = failing_then_scripted
    await run_through(scraper, finished)
    assert started == pytest.approx([0.0, 0.5, 0.55, 1.05])


async def test_a_slow_interval_never_lets_a_page_go_stale():
    """At most stale_after_s / 2: an idle pod's page is never older than stale_after_s."""
    config = DataLayerConfig(
        scrape_interval_s=0.05,
        scrape_idle_interval_s=5.0,
        scrape_kv_events_interval_s=5.0,
        stale_after_s=0.4,
    )
    time = Timeline({})
    _, scraper, started, finished = await run_scripted(
        config, time, [0.0] * 2, [IDLE, BUSY], kv_events_followed=lambda _: True
    )
    await run_through(scraper, finished)
    assert started == pytest.approx([0.0, 0.2, 0.4])


async def test_a_request_that_came_and_went_between_two_ticks_ends_the_slow_interval():
    """Dispatched at 0.21 and completed at 0.22: nothing in flight at the 0.25 tick, yet the
    pod took a request since its page: scraped then."""
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_idle_interval_s=0.5)
    time = Timeline({})
    store, scraper, started, finished = await run_scripted(config, time, [0.0] * 2, [IDLE] * 2)
    pod = store.get("p")
    seq: list[int] = []
    time.at[0.21] = lambda: dispatch(store, scraper, pod, seq)
    time.at[0.22] = lambda: store.completed(pod, 200, seq[0])
    await run_through(scraper, finished)
    assert started == pytest.approx([0.0, 0.25, 0.75])


async def test_an_idle_pods_loop_wakes_once_per_idle_interval_not_at_every_tick():
    """Counted, not timed: 4 idle intervals of 0.5 s are 4 sleeps, not 40 fast ticks."""
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_idle_interval_s=0.5)
    time = Timeline({})
    _, scraper, started, finished = await run_scripted(config, time, [0.0] * 4, [IDLE] * 4)
    await run_through(scraper, finished)
    assert started == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert time.sleeps == 4


async def test_a_peers_dispatch_to_an_idle_pod_wakes_its_loop_at_the_next_tick():
    """A peer's decision applied here (store.peer_dispatched, then the inbox's hook wakes
    the loop: tests/test_wiring.py) at 0.63: scraped at the 0.65 tick, then fast while
    the peer's request counts in the pod's load."""
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_idle_interval_s=0.5)
    time = Timeline({})
    store, scraper, started, finished = await run_scripted(config, time, [0.0] * 3, [IDLE] * 3)
    pod = store.get("p")

    def peer_dispatch() -> None:
        store.peer_dispatched(pod)
        scraper.wake("p")

    time.at[0.63] = peer_dispatch
    await run_through(scraper, finished)
    assert started[:3] == pytest.approx([0.0, 0.5, 0.65])


async def test_waking_a_busy_pod_or_an_unknown_one_changes_nothing():
    config = DataLayerConfig(scrape_interval_s=0.05, scrape_idle_interval_s=0.5)
    time = Timeline({0.07: lambda: scraper.wake("p"), 0.08: lambda: scraper.wake("gone")})
    _, scraper, started, finished = await run_scripted(config, time, [0.0] * 3, [BUSY] * 3)
    await run_through(scraper, finished)
    assert started == pytest.approx([0.0, 0.05, 0.1, 0.15])
