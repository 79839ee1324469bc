"""PreciseMode (epp.datalayer.kv_events_wiring): the endpoint store's events start, replace
and close KV-event subscribers, against real simulated pods publishing over real ZMQ on
loopback. A pod is followed once its model is known; a new model or endpoint replaces
its subscriber (nothing of the old one stays), a reset drops its entries and resyncs,
removal leaves nothing, and `close` stops everything. Through the EppService's router:
a decision on a precise pod opens a stale-routing claim that its events settle."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from array import array
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from epp.app import EppService
from epp.config import EndpointConfig, EppConfig, KvEventsConfig
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest
from epp.wiring import index_listener
from vllm_sim.kv_publisher import KvEventsConfig as SimKvEvents
from vllm_sim.server import RunningPod, SimPodConfig, start_pod

MODEL = "m"
FAST = {"resync_timeout_s": 1.0, "reconnect_max_s": 0.2, "fallback_after_s": 0.5}


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def sim_pod(name: str, model: str = MODEL) -> RunningPod:
    return await start_pod(
        SimPodConfig(
            pod_name=name,
            model=model,
            time_scale=0.001,
            kv_events=SimKvEvents(port=0, replay_port=0, topic=""),
        )
    )


def labels(pod: RunningPod) -> dict[str, str]:
    publisher = pod.kv_publisher
    assert publisher is not None
    return {
        "kv_events_endpoint": f"tcp://127.0.0.1:{publisher.pub_port}",
        "kv_events_replay": f"tcp://127.0.0.1:{publisher.replay_port}",
    }


def endpoint(name: str, pod: RunningPod, model: str | None = None, **extra: str) -> EndpointConfig:
    return EndpointConfig(
        name=name,
        address=f"127.0.0.1:{pod.port}",
        model=model,
        labels={**labels(pod), **extra},
    )


def ids_of(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 100_000) for _ in range(n)]


def ours(ids: list[int], model: str = MODEL) -> list:
    return block_hashes(array("I", ids), 16, chain_seed(model))


async def serve(pod: RunningPod, ids: list[int], model: str = MODEL) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            pod.url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1}
        ) as response,
    ):
        assert response.status == 200, await response.text()


async def serve_and_see_it_sent(pod: RunningPod, ids: list[int]) -> None:
    """Serve a request and wait until the pod's publisher has put its batches on the
    wire: the positive signal a "nothing of it reached the index" check waits for."""
    publisher = pod.kv_publisher
    assert publisher is not None
    before = publisher.next_seq
    await serve(pod, ids)
    assert publisher.next_seq > before, "the request published no KV events"
    await until(lambda: publisher.sent >= publisher.next_seq - publisher.config.first_seq)


def engine_view(pod: RunningPod) -> set[int]:
    return set(pod.pod.engine._pool._copies)


class Rig:
    def __init__(self, *, app_index_listener: bool = False, **kv_events: object) -> None:
        config = KvEventsConfig.model_validate({**FAST, **kv_events})
        self.store = EndpointStore(EppConfig().datalayer)
        self.index = PrefixIndex(100_000, clock=self.store.now)
        self.mode = PreciseMode(config, self.index, 16)
        if app_index_listener:  # as the app connects them: the index listener first
            self.store.on_change(index_listener(self.index, EppConfig().prefix, self.mode))
        self.store.on_change(self.mode.on_change)

    def holds(self, pod: str, ids: list[int], model: str = MODEL) -> int:
        return self.index.match(ours(ids, model)).get(pod, 0)

    def attached(self, pod: str) -> bool:
        sub = self.mode.subscriber(pod)
        return sub is not None and sub.state.attached and sub.state.resyncs >= 1


@pytest.fixture
async def pods() -> AsyncIterator[list[RunningPod]]:
    running = [await sim_pod(f"pod-{i}") for i in range(2)]
    yield running
    for pod in running:
        await pod.close()


async def test_a_pod_is_followed_once_its_model_is_known_and_the_index_matches_its_engine(
    pods: list[RunningPod],
):
    rig = Rig()
    await rig.mode.start()
    try:
        rig.store.sync([endpoint("pod-0", pods[0]), endpoint("pod-1", pods[1], model=MODEL)])
        assert rig.mode.subscriber("pod-0") is None  # no model yet: no seed for its chains
        await until(lambda: rig.attached("pod-1"))
        assert rig.mode.mode_of("pod-1") == "precise" and rig.mode.mode_of("pod-0") == "approximate"
        pod0 = rig.store.get("pod-0")
        assert pod0 is not None
        rig.store.scraped(pod0, PodMetrics(model=MODEL))  # the first page names the model
        await until(lambda: rig.attached("pod-0"))
        for i, pod in enumerate(pods):
            for seed in range(3):
                await serve(pod, ids_of(10 * i + seed))
        for i, pod in enumerate(pods):
            name = f"pod-{i}"
            await until(lambda n=name, p=pod: set(rig.index.engine_blocks(n)) == engine_view(p))
            assert rig.holds(name, ids_of(10 * i)) == 10
            assert rig.holds(name, ids_of(10 * (1 - i))) == 0  # the other pod's prompt
        subs = rig.mode.subscribers
        rig.store.scraped(pod0, PodMetrics(model=MODEL))  # the same wiring: kept
        assert rig.mode.subscribers == subs
        assert rig.mode.stats.counts["blocks_stored"] > 0
    finally:
        await rig.mode.close()
    assert rig.mode.subscribers == {}
    assert not rig.index.is_precise("pod-0") and rig.index.blocks("pod-0") == 0


async def test_a_new_model_or_endpoint_replaces_the_subscriber_and_nothing_old_stays(
    pods: list[RunningPod],
):
    rig = Rig()
    await rig.mode.start()
    try:
        rig.store.sync([endpoint("pod-0", pods[0], model=MODEL)])
        await until(lambda: rig.attached("pod-0"))
        await serve(pods[0], ids_of(1))
        await until(lambda: rig.holds("pod-0", ids_of(1)) == 10)
        first = rig.mode.subscriber("pod-0")
        # The pod's publisher endpoint changes (its labels now name pod-1's publisher).
        rig.store.sync([endpoint("pod-0", pods[0], model=MODEL, **labels(pods[1]))])
        pod0 = rig.store.get("pod-0")
        assert pod0 is not None
        rig.store.scraped(pod0, PodMetrics(model=MODEL))
        second = rig.mode.subscriber("pod-0")
        assert second is not None and second is not first
        assert rig.holds("pod-0", ids_of(1)) == 0  # the old publisher's blocks went at once
        await until(lambda: rig.attached("pod-0"))
        await until(lambda: first is not None and first.state.connected is False)
        await serve(pods[1], ids_of(2))
        await until(lambda: rig.holds("pod-0", ids_of(2)) == 10)
        # The old publisher: its batches leave it, and nothing of them reaches the index.
        await serve_and_see_it_sent(pods[0], ids_of(3))
        await asyncio.sleep(0.1)  # what a still-connected subscriber would need to read it
        assert rig.holds("pod-0", ids_of(3)) == 0
        assert set(rig.index.engine_blocks("pod-0")) == engine_view(pods[1])
        # A new model: a new subscriber, whose chains start from the new name.
        rig.store.sync(
            [EndpointConfig(name="pod-0", address=pod0.address, model="m2", labels=labels(pods[1]))]
        )
        rig.store.scraped(pod0, PodMetrics(model="m2"))
        third = rig.mode.subscriber("pod-0")
        assert third is not None and third is not second and third.model == "m2"
        await until(lambda: rig.attached("pod-0"))
        await until(lambda: rig.holds("pod-0", ids_of(2), "m2") == 10)  # resynced from replay
        assert rig.holds("pod-0", ids_of(2)) == 0
    finally:
        await rig.mode.close()


async def test_a_reset_drops_entries_and_resyncs_and_removal_leaves_nothing(
    pods: list[RunningPod],
):
    rig = Rig()
    await rig.mode.start()
    try:
        rig.store.sync([endpoint("pod-0", pods[0], model=MODEL)])
        await until(lambda: rig.attached("pod-0"))
        await serve(pods[0], ids_of(1))
        await until(lambda: rig.holds("pod-0", ids_of(1)) == 10)
        sub = rig.mode.subscriber("pod-0")
        assert sub is not None
        pod0 = rig.store.get("pod-0")
        assert pod0 is not None
        rig.mode.on_change("reset", pod0)  # the store saw the pod's counters go back
        assert sub.state.restarts == 1
        assert rig.holds("pod-0", ids_of(1)) == 0  # dropped at once...
        await until(lambda: rig.holds("pod-0", ids_of(1)) == 10)  # ...and replayed
        rig.store.sync([])
        assert rig.mode.subscriber("pod-0") is None
        assert rig.index.blocks("pod-0") == 0 and "pod-0" not in rig.index.pods()
        await until(lambda: not sub.state.connected)
        await serve_and_see_it_sent(pods[0], ids_of(2))  # its batches leave the pod...
        await asyncio.sleep(0.1)  # ...and a still-connected subscriber would read them
        assert "pod-0" not in rig.index.pods() and not rig.mode.precise.is_attached("pod-0")
    finally:
        await rig.mode.close()


async def test_a_new_start_time_on_a_page_is_one_restart_even_with_counters_higher(
    pods: list[RunningPod],
):
    """The store's pages feed the pod's `process_start_time_seconds` to its subscriber:
    a new one (a process started after the subscriber's last resync) drops the entries and
    resyncs, once (the store's `reset` and the `updated` after it carry the same page),
    and pages with the same one change nothing."""
    rig = Rig()
    await rig.mode.start()
    try:
        rig.store.sync([endpoint("pod-0", pods[0], model=MODEL)])
        pod0 = rig.store.get("pod-0")
        assert pod0 is not None
        old = time.time() - 600
        rig.store.scraped(pod0, PodMetrics(model=MODEL, prefix_queries=500, start_time=old))
        await until(lambda: rig.attached("pod-0"))
        await serve(pods[0], ids_of(1))
        await until(lambda: rig.holds("pod-0", ids_of(1)) == 10)
        sub = rig.mode.subscriber("pod-0")
        assert sub is not None
        rig.store.scraped(pod0, PodMetrics(model=MODEL, prefix_queries=600, start_time=old))
        assert sub.state.restarts == 0 and rig.holds("pod-0", ids_of(1)) == 10
        new = time.time()  # started after the subscriber's resync: its entries may be old
        rig.store.scraped(pod0, PodMetrics(model=MODEL, prefix_queries=900, start_time=new))
        assert sub.state.restarts == 1 and sub.state.restart_drops_skipped == 0
        assert rig.holds("pod-0", ids_of(1)) == 0  # dropped at once...
        await until(lambda: rig.holds("pod-0", ids_of(1)) == 10)  # ...and replayed
        rig.store.scraped(pod0, PodMetrics(model=MODEL, prefix_queries=950, start_time=new))
        assert sub.state.restarts == 1
    finally:
        await rig.mode.close()


async def test_a_reset_of_a_precise_pod_is_its_subscribers_to_decide_an_approximate_one_clears(
    pods: list[RunningPod],
):
    """The app's index listener and precise mode on one store, in the app's order. A
    page with a new start time for a precise pod whose subscriber resynced well after that
    start (its entries come from the new process) keeps them: neither the listener nor
    the subscriber drops them. A start time after the resync drops them. An approximate
    pod's reset still clears what the router recorded for it."""
    rig = Rig(app_index_listener=True, pod_modes={"pod-1": "approximate"})
    resets: list[str] = []
    rig.store.on_change(lambda event, e: resets.append(e.name) if event == "reset" else None)
    await rig.mode.start()
    try:
        rig.store.sync([endpoint("pod-0", pods[0], model=MODEL), endpoint("pod-1", pods[1])])
        pod0, pod1 = rig.store.get("pod-0"), rig.store.get("pod-1")
        assert pod0 is not None and pod1 is not None
        old = time.time() - 600
        for pod in (pod0, pod1):
            rig.store.scraped(pod, PodMetrics(model=MODEL, start_time=old))
        await until(lambda: rig.attached("pod-0"))
        sub = rig.mode.subscriber("pod-0")
        assert sub is not None and rig.mode.subscriber("pod-1") is None
        await serve(pods[0], ids_of(1))
        # The blocks may arrive in the connection's resync, which finishes after them.
        await until(
            lambda: rig.holds("pod-0", ids_of(1)) == 10 and sub.state.resynced_at is not None
        )
        rig.index.record("pod-1", ours(ids_of(2)))  # as the router records a decision
        assert rig.mode.owns_entries("pod-0") and not rig.mode.owns_entries("pod-1")

        resyncs = sub.state.resyncs
        # The new process started 5 s before the subscriber's resync (more than its 3 s
        # margin): what the subscriber holds came from it.
        before = sub.state.resynced_at - 5.0
        rig.store.scraped(pod0, PodMetrics(model=MODEL, start_time=before))
        assert resets == ["pod-0"]
        assert rig.holds("pod-0", ids_of(1)) == 10  # kept by both listeners
        assert (sub.state.restarts, sub.state.restart_drops_skipped) == (1, 1)
        assert rig.mode.stats.counts["restart_drops_skipped"] == 1
        # Positive signal first: the subscriber reads a later batch (so a resync it had
        # decided on would have run), then nothing of the kept entries changed.
        await serve(pods[0], ids_of(5))
        await until(lambda: rig.holds("pod-0", ids_of(5)) == 10)
        assert sub.state.resyncs == resyncs and rig.holds("pod-0", ids_of(1)) == 10

        # A process started after the resync: the entries may be the old one's.
        rig.store.scraped(pod0, PodMetrics(model=MODEL, start_time=time.time()))
        assert rig.holds("pod-0", ids_of(1)) == 0
        assert (sub.state.restarts, sub.state.restart_drops_skipped) == (2, 1)
        await until(lambda: rig.holds("pod-0", ids_of(1)) == 10)  # replayed
        assert sub.state.resyncs == resyncs + 1

        assert rig.holds("pod-1", ids_of(2)) == 10
        rig.store.scraped(pod1, PodMetrics(model=MODEL, start_time=time.time()))
        assert resets[-1] == "pod-1" and rig.holds("pod-1", ids_of(2)) == 0
    finally:
        await rig.mode.close()


async def test_approximate_pods_get_no_subscriber_and_a_silent_publisher_stays_approximate(
    pods: list[RunningPod],
):
    rig = Rig(pod_modes={"pod-1": "approximate"})
    await rig.mode.start()
    try:
        rig.store.sync(
            [
                endpoint("pod-0", pods[0], model=MODEL),
                endpoint("pod-1", pods[1], model=MODEL),
                # auto, but nothing publishes there: it stays approximate.
                EndpointConfig(
                    name="pod-2",
                    address="127.0.0.1:1",
                    model=MODEL,
                    labels={"kv_events_endpoint": "tcp://127.0.0.1:1", "kv_events_replay": ""},
                ),
            ]
        )
        assert rig.mode.subscriber("pod-1") is None
        assert rig.mode.subscriber("pod-2") is not None
        await until(lambda: rig.attached("pod-0"))
        assert not rig.index.is_precise("pod-2")
        # The operator turns pod-0 approximate (a label): its subscriber goes.
        # (pod-1 and pod-2 are removed; a pod that stays gets its new labels without an
        # event: they take effect with its next page.)
        rig.store.sync([endpoint("pod-0", pods[0], model=MODEL, kv_events_mode="approximate")])
        assert rig.mode.subscriber("pod-2") is None
        pod0 = rig.store.get("pod-0")
        assert pod0 is not None
        rig.store.scraped(pod0, PodMetrics(model=MODEL))
        assert rig.mode.subscribers == {} and not rig.index.is_precise("pod-0")
    finally:
        await rig.mode.close()


async def test_the_service_checks_stale_routing_of_precise_pods_from_their_events(
    pods: list[RunningPod],
):
    config = EppConfig.model_validate(
        {
            "endpoints": [
                endpoint(f"pod-{i}", p, model=MODEL).model_dump() for i, p in enumerate(pods)
            ],
            "kv_events": FAST,
            "prefix": {"block_size": 16},
        }
    )
    service = EppService(config)
    service.store.sync(config.endpoints)
    await service.precise.start()
    try:
        await until(lambda: all(service.index.is_precise(f"pod-{i}") for i in range(2)))
        ids = ids_of(7)
        body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode()
        routed = service.router.route_now(
            IncomingRequest(path="/v1/completions", body=body, request_id="r0")
        )
        name = routed.endpoint.name
        pod = pods[int(name[-1])]
        await serve(pod, ids)  # the request runs on the pod the EPP chose
        service.router.complete(routed, 200)
        await until(lambda: service.index.reported(name, ours(ids)[-1]))
        check = service.precise.precise.stale
        again = service.router.route_now(
            IncomingRequest(path="/v1/completions", body=body, request_id="r1")
        )
        assert again.endpoint.name == name  # the engine's own blocks drew it there
        assert check.open_claims == 1
        await serve(pod, ids)
        service.router.complete(again, 200)
        await asyncio.sleep(check.grace_s + 0.1)
        service._check_precise_stale()
        assert (check.checked, check.stale) == (1, 0)  # the engine reused them: not stale
        page = service.metrics.exposition().decode()
        assert "epp_stale_cache_checked_total 1.0" in page
        assert f'epp_pod_kv_events_attached{{pod="{name}"}} 1.0' in page
        assert 'epp_kv_events_total{reason="blocks_stored"}' in page
        endpoints = {e.name: e for e in service.store.all()}
        assert service.index.blocks(name) == len(engine_view(pod))
        assert service.precise.mode_of(endpoints[name].name) == "precise"
    finally:
        await service.precise.close()


async def test_pods_sharing_a_host_do_not_follow_one_templated_publisher() -> None:
    """The default endpoint template names a host's port: pods on one host (several on one
    machine, data-parallel ranks) would all read one publisher's events as theirs. None of
    them follows it; a pod with its own endpoint label still does."""
    rig = Rig()
    await rig.mode.start()
    try:
        one = EndpointConfig(name="a", address="127.0.0.1:8001", model=MODEL)
        rig.store.sync([one])
        assert rig.mode.subscriber("a") is not None  # alone on its host: followed
        two = EndpointConfig(name="b", address="127.0.0.1:8002", model=MODEL)
        own = EndpointConfig(
            name="c",
            address="127.0.0.1:8003",
            model=MODEL,
            labels={"kv_events_endpoint": "tcp://127.0.0.1:1", "kv_events_replay": ""},
        )
        rig.store.sync([one, two, own])
        assert rig.mode.subscriber("a") is None and rig.mode.subscriber("b") is None
        assert not rig.index.is_precise("a") and not rig.index.is_precise("b")
        assert rig.mode.subscriber("c") is not None
        rig.store.sync([one, own])  # b leaves: a alone on its host again
        rig.store.scraped(rig.store.get("a"), PodMetrics(model=MODEL))
        assert rig.mode.subscriber("a") is not None
    finally:
        await rig.mode.close()


def live_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-live-")]


async def test_each_precise_mode_owns_one_receiver_thread_and_close_ends_it(
    pods: list[RunningPod],
) -> None:
    """The thread that reads the live sockets is its PreciseMode's: one per PreciseMode,
    whatever the number of pods; closing one ends its thread and leaves the other's
    pods followed."""
    first, second = Rig(), Rig()
    await first.mode.start()
    await second.mode.start()
    try:
        first.store.sync([endpoint("pod-0", pods[0], model=MODEL)])
        second.store.sync([endpoint("pod-1", pods[1], model=MODEL)])
        await until(lambda: first.attached("pod-0") and second.attached("pod-1"))
        assert live_threads() == ["kv-live-receiver"] * 2
        await first.mode.close()
        await until(lambda: live_threads() == ["kv-live-receiver"], timeout=2.0)
        await serve(pods[1], ids_of(5))
        await until(lambda: second.holds("pod-1", ids_of(5)) == 10)
    finally:
        await first.mode.close()
        await second.mode.close()
    await until(lambda: live_threads() == [], timeout=2.0)


async def test_four_hundred_pods_read_on_the_loop() -> None:
    """Live sockets read on the loop (`receive_in_thread` off): three sockets a pod in
    PreciseMode's context; 400 pods are 1,200, beyond libzmq's default of 1,023 per
    context, which would fail the 342nd pod's start."""
    rig = Rig(reconnect_max_s=5.0)
    rig.mode.settings = dataclasses.replace(
        rig.mode.settings, receive_in_thread=False, reconnect_ivl_s=1.0
    )
    await rig.mode.start()
    try:
        nobody = {"kv_events_endpoint": "tcp://127.0.0.1:1", "kv_events_mode": "precise"}
        rig.store.sync(
            [
                EndpointConfig(
                    name=f"p{i}",
                    address=f"10.0.{i // 250}.{i % 250}:8000",
                    model=MODEL,
                    labels=nobody,
                )
                for i in range(400)
            ]
        )
        subs = rig.mode.subscribers
        assert len(subs) == 400
        await until(lambda: all(s.state.connect_retries >= 1 for s in subs.values()), 20.0)
        assert live_threads() == []
    finally:
        await rig.mode.close()


async def test_a_receiver_thread_ended_by_a_bug_is_told_and_replaced(
    pods: list[RunningPod],
) -> None:
    """A bug in the receiver thread itself: its pods are told (an error each: entries
    dropped, a resync due) and move to a new thread, on which their events arrive again;
    the next pod PreciseMode follows joins that thread."""
    rig = Rig()
    await rig.mode.start()
    try:
        rig.store.sync([endpoint("pod-0", pods[0], model=MODEL)])
        await until(lambda: rig.attached("pod-0"))
        hub = rig.mode._hub
        assert hub is not None

        def broken() -> None:
            raise RuntimeError("hub bug")

        hub._turn = broken  # type: ignore[method-assign]
        hub.wake()
        await until(lambda: hub.failed and not hub.running and not hub._thread.is_alive())
        sub0 = rig.mode.subscriber("pod-0")
        assert sub0 is not None
        await until(lambda: sub0.state.errors >= 1)
        # pod-0, followed before the failure, is read by a new thread: its events arrive.
        await until(lambda: rig.mode._hub is not hub and live_threads() == ["kv-live-receiver"])
        await until(lambda: sub0.state.connected)
        await serve(pods[0], ids_of(5))
        await until(lambda: rig.holds("pod-0", ids_of(5)) == 10)
        replacement = rig.mode._hub
        rig.store.sync(
            [endpoint("pod-0", pods[0], model=MODEL), endpoint("pod-1", pods[1], model=MODEL)]
        )
        await until(lambda: rig.attached("pod-1"))
        assert rig.mode._hub is replacement and live_threads() == ["kv-live-receiver"]
        await serve(pods[1], ids_of(7))
        await until(lambda: rig.holds("pod-1", ids_of(7)) == 10)
    finally:
        await rig.mode.close()
    await until(lambda: live_threads() == [], timeout=2.0)
