"""Finding 6 of issue 15: the EPP's upkeep survives a bug. An exception from a scorer
while a waiting request was dispatched ended `EppService._maintain` for the life of the
process (no more health refresh, reservation expiry, readiness or queue retries) and
nothing said so; the request hung until its TTL.

A real EppService, built and not started (no ports, no scrape loops), its maintenance
loop run as a task with no pause between rounds, the store's clock injected; a real
ext_proc servicer driven directly for the answer. The scorer with a bug is ours (it
stands for any operator's scorer), raising once when armed."""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog
from extproc.fakes import DUPLEX, body_msg, headers_msg
from grpc_health.v1 import health_pb2
from helpers import config

import epp.app
from epp.config import EndpointConfig, ServerConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.extproc.server import INTERNAL_ERROR_BODY, ExternalProcessor
from epp.request import IncomingRequest

ADDRESS = {f"p{i}": f"127.0.0.1:{8001 + i}" for i in range(4)}
ONE_EACH = {"max_queue": 1, "running_slots": 1}  # 1 running + 1 queued: saturated
TTL_S = 5.0  # datalayer.in_flight_ttl_s here


def pods(n: int) -> list[dict]:
    return [{"name": f"p{i}", "address": ADDRESS[f"p{i}"], "model": "m"} for i in range(n)]


def body(i: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"question {i} " * 30}).encode()


def route(router, i: int):
    return router.route(IncomingRequest(path="/v1/completions", body=body(i), request_id=f"r{i}"))


async def settle(turns: int = 30) -> None:
    """Lets every task that can run, run (a bounded number of event-loop turns)."""
    for _ in range(turns):
        await asyncio.sleep(0)


class FlakyScorer:
    """A scorer with a bug that shows once, when armed."""

    name = "flaky"

    def __init__(self) -> None:
        self.armed = False

    def score(self, request, candidates):
        if self.armed:
            self.armed = False
            raise RuntimeError("a bug in a scorer")
        return [1.0] * len(candidates)


def service_with(flaky: FlakyScorer, clock: list[float], n: int = 2):
    """An EppService, built and not started (no ports, no scrape loops), on the store's
    clock `clock[0]`, with the flaky scorer in its profile and `n` idle pods scraped."""
    from epp.scheduling.registry import ScorerRegistry

    registry = ScorerRegistry()
    registry.register("flaky", lambda _config: flaky)
    cfg = config(
        endpoints=pods(n),
        scheduling=ONE_EACH | {"weights": {"load": 0.5, "flaky": 0.5}},
        datalayer={"in_flight_ttl_s": TTL_S},
    )
    service = epp.app.EppService(cfg, registry=registry)
    service.store._clock = lambda: clock[0]
    service.store.sync([EndpointConfig.model_validate(c) for c in pods(n)])
    for endpoint in service.store.all():
        service.store.scraped(endpoint, PodMetrics(model="m"))
    return service


async def test_a_waiting_request_whose_dispatch_raises_gets_the_error_and_the_others_go_on():
    """Finding 6: the exception left the release pass (the request hung until its TTL,
    the requests after it were not offered a pod)."""
    flaky = FlakyScorer()
    service = service_with(flaky, [100.0])
    router = service.router
    held = [await route(router, i) for i in range(4)]
    waiters = [asyncio.create_task(route(router, 100 + i)) for i in range(2)]
    await settle()
    assert router.waiting == 2
    for routed in held[:2]:
        router.complete(routed.token, 200)
    flaky.armed = True
    assert router.release_waiting() == 1  # did not raise; the second waiter was placed
    await settle()
    with pytest.raises(RuntimeError, match="a bug in a scorer"):
        waiters[0].result()
    assert waiters[1].result().endpoint.name in {"p0", "p1"}
    assert router.waiting == 0
    page = service.metrics.exposition().decode()
    assert 'epp_flow_control_requests_total{outcome="failed"} 1.0' in page


class Envoy:
    """The request side of one ext_proc stream: its messages, then open until cancelled."""

    def __init__(self, messages) -> None:
        self.messages = list(messages)

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for message in self.messages:
            yield message
        await asyncio.Event().wait()


class Context:
    def invocation_metadata(self):
        return ()


async def replies(processor: ExternalProcessor, i: int) -> list:
    envoy = Envoy([headers_msg(mode=DUPLEX), body_msg(body(i), True)])
    return [reply async for reply in processor.Process(envoy, Context())]


async def serving(service, name: str) -> bool:
    class Probe:
        async def abort(self, *_args):
            raise AssertionError(f"no health status for {name!r}")

    request = health_pb2.HealthCheckRequest(service=name)
    answer = await service.health.servicer.Check(request, Probe())
    return answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def no_pause(monkeypatch):
    monkeypatch.setattr(epp.app, "HEALTH_REFRESH_S", 0.0)  # one round per loop turn or so


async def test_a_scorer_raising_while_the_loop_dispatches_a_waiting_request(no_pause):
    """The loop's round: reservations past their TTL expire (refresh), the waiting
    request is dispatched (tick) and the scorer raises. The request gets 500
    internal-error; the loop goes on expiring reservations and following readiness."""
    flaky, clock = FlakyScorer(), [100.0]
    service = service_with(flaky, clock, n=1)
    router, p0 = service.router, service.store.get("p0")
    for i in range(2):
        await route(router, i)  # p0 is saturated
    processor = ExternalProcessor(router, ServerConfig(), service.metrics)
    waiter = asyncio.create_task(replies(processor, 10))
    await settle()
    assert router.waiting == 1 and not waiter.done()
    flaky.armed = True
    clock[0] += TTL_S + 1  # the held reservations expire at the next refresh
    await service.health.set(live=True, ready=False)  # as start() does
    loop = asyncio.create_task(service._maintain())
    try:
        await settle()
        assert flaky.armed is False  # it raised, in the loop's dispatch of the waiter
        assert not loop.done(), f"the maintenance loop died: {loop.exception()!r}"
        (reply,) = await asyncio.wait_for(waiter, 1.0)
        assert reply.immediate_response.status.code == 500
        assert reply.immediate_response.body == INTERNAL_ERROR_BODY
        assert router.waiting == 0 and p0.in_flight == 0
        # Still refreshing: a new reservation expires after its TTL ...
        routed = router.route_now(
            IncomingRequest(path="/v1/completions", body=body(20), request_id="r20")
        )
        assert p0.in_flight == 1
        clock[0] += TTL_S + 1
        await settle()
        assert p0.in_flight == 0
        router.complete(routed.token, 200)  # (already released: no effect)
        # ... and following readiness: the first scrape round ends, the loop says so.
        assert not await serving(service, "readiness")
        service.scraper.first_round.set()
        await settle()
        assert await serving(service, "readiness")
        assert not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


async def test_each_step_of_the_loop_survives_its_exceptions_counted_and_logged_once(no_pause):
    """A step that raises (here the health refresh, three rounds in a row) is counted
    each time, logged once with its traceback (then at most once a minute), and run
    again at the next round: the reservation past its TTL still expires."""
    clock = [100.0]
    service = service_with(FlakyScorer(), clock, n=1)
    store = service.store
    real_refresh, calls = store.refresh_health, [0]

    def refresh_with_a_bug() -> None:
        calls[0] += 1
        if calls[0] <= 3:
            raise RuntimeError("a bug in the health refresh")
        real_refresh()

    store.refresh_health = refresh_with_a_bug
    service.router.route_now(IncomingRequest(path="/v1/completions", body=body(1), request_id="r1"))
    clock[0] += TTL_S + 1
    with structlog.testing.capture_logs() as logs:
        loop = asyncio.create_task(service._maintain())
        try:
            await settle()
            assert not loop.done(), f"the maintenance loop died: {loop.exception()!r}"
            assert calls[0] > 3 and store.get("p0").in_flight == 0
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
    failed = [e for e in logs if e["event"] == "background_step_failed"]
    assert len(failed) == 1
    assert failed[0]["step"] == "health-refresh" and failed[0]["log_level"] == "error"
    assert isinstance(failed[0]["exc_info"], RuntimeError)
    page = service.metrics.exposition().decode()
    assert 'epp_background_errors_total{step="health-refresh"} 3.0' in page


async def test_a_background_task_that_ends_is_counted_and_logged():
    """Only stop() ends the service's background tasks: any other end is reported (here
    a maintenance loop with a bug outside its steps' guards). A started service on free
    loopback ports, plaintext; its pods do not exist (their scrapes fail, unused here)."""
    cfg = config(
        endpoints=pods(1),
        server={
            "grpc_host": "127.0.0.1",
            "grpc_port": 0,
            "grpc_health_port": 0,
            "metrics_host": "127.0.0.1",
            "metrics_port": 0,
            "secure_serving": False,
        },
    )
    service = epp.app.EppService(cfg)

    async def maintain_with_a_bug() -> None:
        raise RuntimeError("a bug outside the steps")

    service._maintain = maintain_with_a_bug
    with structlog.testing.capture_logs() as logs:
        await service.start()
        try:
            await settle()
        finally:
            await service.stop(grace_s=0)
    failed = [e for e in logs if e["event"] == "background_step_failed"]
    assert [e["step"] for e in failed] == ["task:health-refresh"]
    page = service.metrics.exposition().decode()
    assert 'epp_background_errors_total{step="task:health-refresh"} 1.0' in page
    assert 'epp_background_errors_total{step="task:loop-lag-monitor"}' not in page  # stop()


def test_the_scraper_asks_precise_mode_which_pods_send_kv_events():
    """A pod whose KV state precise mode keeps from its events is scraped at
    `scrape_kv_events_interval_s` (tests/datalayer/test_scraper.py): the service hands
    the scraper precise mode's own answer, not a copy of its rule."""
    service = epp.app.EppService(config(endpoints=pods(1)))
    assert service.scraper.kv_events_followed == service.precise.owns_entries
