"""KvEventSubscriber against a real simulated pod's publisher over real ZMQ on loopback
(`vllm_sim.server.start_pod` with `KvEventsConfig`): live events, gaps filled from the
replay socket, gaps it cannot fill, publisher restarts, restarts seen elsewhere, bad
frames and payloads, auto mode, fallback and removal. Lost batches are made by putting a
batch in the publisher's replay buffer without sending it, which is what a PUB socket
dropping it looks like to a subscriber."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
import time
from array import array
from collections.abc import Callable, Sequence

import aiohttp
import pytest

from epp.config import KvEventsConfig as EppKvEventsConfig
from epp.datalayer.kv_subscriber import (
    KvEventSubscriber,
    SubscriberSettings,
    format_endpoint,
    resolve_pod,
    topic_prefix,
)
from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.prefix.kv_events import KvEvent, KvEventStats, encode_seq
from epp.prefix.precise import PreciseIndex
from vllm_sim import hashing as sim_hashing
from vllm_sim import kv_events as sim_events
from vllm_sim.kv_publisher import KvEventPublisher, KvEventsConfig
from vllm_sim.server import RunningPod, SimPodConfig, start_pod

MODEL = "m"
TOPIC = "kv@test@m"
FAST = SubscriberSettings(resync_timeout_s=1.0, reconnect_ivl_s=0.05, reconnect_max_s=0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def pod_with_events(
    port: int = 0, replay_port: int | None = 0, replay_buffer: int = 10_000
) -> RunningPod:
    config = SimPodConfig(
        pod_name="pod-0",
        model=MODEL,
        time_scale=0.001,
        kv_events=KvEventsConfig(
            port=port, replay_port=replay_port, topic=TOPIC, replay_buffer=replay_buffer
        ),
    )
    return await start_pod(config)


def ids_of(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 100_000) for _ in range(n)]


def ours(ids: list[int]) -> list:
    return block_hashes(array("I", ids), 16, chain_seed(MODEL))


async def serve(pod: RunningPod, ids: list[int]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            pod.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}
        ) as response,
    ):
        assert response.status == 200, await response.text()


def lose(publisher: KvEventPublisher, events: Sequence[sim_events.KvEvent]) -> int:
    """Publish a batch that only reaches the replay buffer, as if the PUB socket had
    dropped it on the way."""
    seq = publisher._next_seq
    publisher._next_seq += 1
    publisher._buffer.append((seq, sim_events.encode_event_batch(events, time.time())))
    return seq


def stored(ids: list[int]) -> sim_events.BlockStored:
    return sim_events.BlockStored(
        block_hashes=sim_hashing.block_hashes(ids, 16),
        parent_block_hash=None,
        token_ids=ids[: len(ids) // 16 * 16],
        block_size=16,
    )


class Rig:
    def __init__(self, pod: RunningPod, **kwargs: object) -> None:
        publisher = pod.kv_publisher
        assert publisher is not None
        self.pod = pod
        self.publisher = publisher
        self.index = PrefixIndex(100_000)
        self.stats = KvEventStats()
        self.precise = PreciseIndex(self.index, 16, self.stats)
        replay = (
            None if publisher.replay_port is None else f"tcp://127.0.0.1:{publisher.replay_port}"
        )
        options: dict = {
            "model": MODEL,
            "replay_endpoint": replay,
            "topic": TOPIC,
            "settings": FAST,
            "stats": self.stats,
        }
        options.update(kwargs)
        self.sub = KvEventSubscriber(
            "pod-0", f"tcp://127.0.0.1:{publisher.pub_port}", self.precise, **options
        )

    async def start(self) -> Rig:
        await self.sub.start()
        await until(lambda: self.sub.state.attached and self.sub.state.resyncs >= 1)
        return self

    def holds(self, ids: list[int]) -> int:
        return self.index.match(ours(ids)).get("pod-0", 0)

    def engine_view(self) -> set[int]:
        return set(self.pod.pod.engine._pool._copies)


@pytest.fixture
async def rig():
    pod = await pod_with_events()
    rig = await Rig(pod).start()
    yield rig
    await rig.sub.close()
    await pod.close()


async def test_live_events_make_the_index_hold_exactly_the_pods_blocks(rig: Rig):
    prompts = [ids_of(i) for i in range(5)]
    for ids in prompts:
        await serve(rig.pod, ids)
    await until(lambda: all(rig.holds(ids) == 10 for ids in prompts))
    await until(lambda: set(rig.index.engine_blocks("pod-0")) == rig.engine_view())
    assert rig.sub.state.gaps == 0 and rig.stats.counts["malformed_payload"] == 0


async def test_a_lost_batch_is_fetched_from_the_replay_socket(rig: Rig):
    lost = ids_of(1)
    lose(rig.publisher, [stored(lost)])
    await serve(rig.pod, ids_of(2))  # the next live batch reveals the gap
    await until(lambda: rig.holds(ids_of(2)) == 10)
    assert rig.holds(lost) == 10
    assert rig.sub.state.gaps == 1 and rig.sub.state.replay_failures == 0


async def test_a_gap_the_replay_buffer_no_longer_covers_drops_the_pods_entries():
    pod = await pod_with_events(replay_buffer=1)
    rig = await Rig(pod).start()
    try:
        before = ids_of(1)
        await serve(pod, before)
        await until(lambda: rig.holds(before) == 10)
        lose(rig.publisher, [stored(ids_of(2))])
        lose(
            rig.publisher,
            [sim_events.BlockRemoved(block_hashes=sim_hashing.block_hashes(before, 16))],
        )
        after = ids_of(3)
        await serve(pod, after)
        await until(lambda: rig.holds(after) == 10)
        assert rig.holds(before) == 0  # what it held may have been evicted: not trusted
        assert rig.sub.state.replay_failures == 1
    finally:
        await rig.sub.close()
        await pod.close()


async def test_without_a_replay_socket_a_gap_drops_the_pods_entries():
    pod = await pod_with_events(replay_port=None)
    rig = await Rig(pod).start()
    try:
        first = ids_of(1)
        await serve(pod, first)
        await until(lambda: rig.holds(first) == 10)
        lose(rig.publisher, [sim_events.AllBlocksCleared()])
        second = ids_of(2)
        await serve(pod, second)
        await until(lambda: rig.holds(second) == 10)
        assert rig.holds(first) == 0
        assert rig.sub.state.gaps == 1
    finally:
        await rig.sub.close()
        await pod.close()


async def test_a_replay_socket_that_does_not_answer_is_left_alone_and_events_flow():
    pod = await pod_with_events(replay_port=None)
    settings = SubscriberSettings(resync_timeout_s=0.2, reconnect_ivl_s=0.05)
    rig = Rig(pod, replay_endpoint=f"tcp://127.0.0.1:{free_port()}", settings=settings)
    try:
        await rig.start()
        await until(lambda: rig.sub.state.replay_failures == 1)  # the first resync waited
        first = ids_of(1)
        await serve(pod, first)
        await until(lambda: rig.holds(first) == 10)
        lose(rig.publisher, [stored(ids_of(2))])
        second = ids_of(3)
        await serve(pod, second)
        await until(lambda: rig.holds(second) == 10)
        assert rig.holds(first) == 0  # the gap dropped the entries: nobody asked to wait
        assert rig.sub.state.gaps == 1 and rig.sub.state.replay_failures == 2
    finally:
        await rig.sub.close()
        await pod.close()


async def test_a_restarted_publisher_leaves_no_stale_entries():
    """The pod's process restarts on the same ports: the old engine's blocks must go,
    and the new one's arrive (through the full resync after the reconnect)."""
    port, replay_port = free_port(), free_port()
    old = await pod_with_events(port, replay_port)
    rig = await Rig(old).start()
    try:
        stale = ids_of(1)
        await serve(old, stale)
        await until(lambda: rig.holds(stale) == 10)
        await old.close()
        await until(lambda: rig.sub.state.disconnects == 1)
        assert rig.holds(stale) == 0  # dropped as soon as the publisher went away
        new = await pod_with_events(port, replay_port)
        rig.pod = new
        try:
            fresh = ids_of(2)
            await serve(new, fresh)  # published maybe before the subscriber reconnects
            await until(lambda: rig.holds(fresh) == 10)
            assert rig.holds(stale) == 0
            assert rig.sub.state.resyncs >= 2
            await until(lambda: set(rig.index.engine_blocks("pod-0")) == rig.engine_view())
        finally:
            await new.close()
    finally:
        await rig.sub.close()


async def test_a_sequence_that_goes_back_is_a_restart(rig: Rig):
    old = ids_of(1)
    await serve(rig.pod, old)
    await until(lambda: rig.holds(old) == 10)
    # A new publisher numbering from 0 with an empty buffer, on the same connection.
    rig.publisher._next_seq = 0
    rig.publisher._buffer.clear()
    new = ids_of(2)
    rig.publisher.publish([stored(new)])
    await until(lambda: rig.holds(new) == 10)
    assert rig.holds(old) == 0
    assert rig.sub.state.restarts == 1


async def test_a_restart_seen_in_the_metrics_drops_entries_now_and_resyncs(rig: Rig):
    ids = ids_of(1)
    await serve(rig.pod, ids)
    await until(lambda: rig.holds(ids) == 10)
    running = time.time() - 600
    rig.sub.observe_start_time(running)
    rig.sub.observe_start_time(running)
    assert rig.holds(ids) == 10
    rig.sub.observe_start_time(time.time())  # a new engine, started after the last resync
    assert rig.holds(ids) == 0
    # The pod did not really lose its cache here: the replay buffer brings it back.
    await until(lambda: rig.holds(ids) == 10)
    assert rig.sub.state.restarts == 1 and rig.sub.state.restart_drops_skipped == 0


async def test_a_start_time_read_after_the_resync_from_the_restarted_publisher_keeps_the_entries():
    """The pod's process restarts on the same ports; the subscriber reconnects to the new
    publisher and rebuilds the entries from its replay. Only then does the new process's
    page (its start time) arrive, as with vLLM, whose page is served once the engine is up:
    the entries are the new process's already, and stay. (A 0.5 s margin here instead of
    3 s, and the new publisher bound after it, as vLLM's engine binds its publisher 20-70 s
    after the process started.)"""
    settings = dataclasses.replace(FAST, restart_margin_s=0.5)
    port, replay_port = free_port(), free_port()
    old_started = time.time()
    old = await pod_with_events(port, replay_port)
    rig = await Rig(old, settings=settings).start()
    try:
        stale = ids_of(1)
        await serve(old, stale)
        await until(lambda: rig.holds(stale) == 10)
        assert rig.sub.observe_start_time(old_started) is False  # its first page
        await old.close()
        await until(lambda: rig.sub.state.disconnects == 1)
        new_started = time.time()
        await asyncio.sleep(settings.restart_margin_s + 0.1)  # its engine loads
        new = await pod_with_events(port, replay_port)
        rig.pod = new
        try:
            fresh = ids_of(2)
            await serve(new, fresh)
            await until(lambda: rig.holds(fresh) == 10 and rig.sub.state.resynced_at is not None)
            resynced_at = rig.sub.state.resynced_at
            assert resynced_at is not None and resynced_at >= new_started + 0.5
            resyncs = rig.sub.state.resyncs

            assert rig.sub.observe_start_time(new_started) is True  # a restart, seen...
            assert rig.holds(fresh) == 10  # ...whose entries were rebuilt already: kept
            assert rig.sub.state.restarts == 1 and rig.sub.state.restart_drops_skipped == 1
            assert rig.stats.counts["publisher_restarts"] == 1
            assert rig.stats.counts["restart_drops_skipped"] == 1
            # Positive signal first: a later batch read (a replay it had decided on would
            # have run before it), then no replay again.
            later = ids_of(3)
            await serve(new, later)
            await until(lambda: rig.holds(later) == 10)
            assert rig.sub.state.resyncs == resyncs  # no replay again
            assert rig.holds(fresh) == 10 and rig.holds(stale) == 0
            assert set(rig.index.engine_blocks("pod-0")) == rig.engine_view()
        finally:
            await new.close()
    finally:
        await rig.sub.close()


@pytest.mark.parametrize(
    ("resync_after_start", "dropped"),
    [
        (3.5, False),  # the resync began after the start, by more than the 3 s margin
        (2.5, True),  # within the margin: the clocks may differ, the start reads early
        (0.0, True),
        (-30.0, True),  # the process started after the resync: nothing rebuilt it since
    ],
)
async def test_a_new_start_time_keeps_the_entries_only_after_a_resync_well_after_it(
    rig: Rig, resync_after_start: float, dropped: bool
):
    ids = ids_of(1)
    await serve(rig.pod, ids)
    await until(lambda: rig.holds(ids) == 10)
    resynced_at = rig.sub.state.resynced_at
    assert resynced_at is not None  # the resync at the connection, finished
    assert rig.sub.settings.restart_margin_s == 3.0
    rig.sub.observe_start_time(resynced_at - 3600)  # the running process's page
    assert rig.sub.observe_start_time(resynced_at - resync_after_start) is True
    assert rig.holds(ids) == (0 if dropped else 10)
    assert rig.sub.state.restart_drops_skipped == (0 if dropped else 1)
    assert rig.stats.counts["restart_drops_skipped"] == (0 if dropped else 1)


async def test_a_restart_seen_after_a_disconnect_or_a_failed_replay_drops_the_entries():
    """Nothing finished rebuilding the entries since: a start time well before the last
    resync's still drops them (when in doubt, drop)."""
    port = free_port()
    pod = await pod_with_events(port, replay_port=None)
    settings = SubscriberSettings(resync_timeout_s=0.2, reconnect_ivl_s=0.05)
    rig = Rig(pod, replay_endpoint=f"tcp://127.0.0.1:{free_port()}", settings=settings)
    try:
        await rig.start()
        await until(lambda: rig.sub.state.replay_failures == 1)  # the resync's replay failed
        assert rig.sub.state.resynced_at is None
        ids = ids_of(1)
        await serve(pod, ids)
        await until(lambda: rig.holds(ids) == 10)
        rig.sub.observe_start_time(time.time() - 3600)
        assert rig.sub.observe_start_time(time.time() - 60) is True
        assert rig.holds(ids) == 0 and rig.sub.state.restart_drops_skipped == 0
    finally:
        await rig.sub.close()
        await pod.close()

    pod = await pod_with_events()  # with a replay socket: the resync finishes
    rig = await Rig(pod).start()
    try:
        await until(lambda: rig.sub.state.resynced_at is not None)
        rig.sub.observe_start_time(time.time() - 3600)
        await pod.close()
        await until(lambda: rig.sub.state.disconnects == 1)
        assert rig.sub.state.resynced_at is None
        assert rig.sub.observe_start_time(time.time() - 60) is True
        assert rig.sub.state.restart_drops_skipped == 0
    finally:
        await rig.sub.close()


async def test_an_idle_probe_finds_a_lost_last_batch():
    pod = await pod_with_events()
    settings = SubscriberSettings(resync_timeout_s=1.0, probe_interval_s=0.2)
    rig = await Rig(pod, settings=settings).start()
    try:
        first = ids_of(1)
        await serve(pod, first)
        await until(lambda: rig.holds(first) == 10)
        last = ids_of(2)
        lose(rig.publisher, [stored(last)])  # nothing live follows it
        await until(lambda: rig.holds(last) == 10)
    finally:
        await rig.sub.close()
        await pod.close()


async def test_bad_frames_and_payloads_are_counted_and_never_fatal(rig: Rig):
    good = ids_of(1)
    await serve(rig.pod, good)
    await until(lambda: rig.holds(good) == 10)
    pub = rig.publisher._pub
    assert pub is not None
    await pub.send_multipart([TOPIC.encode(), b"short"])  # not [topic, seq, payload]
    await pub.send_multipart([TOPIC.encode(), b"\x00" * 3, b"x"])  # a bad seq frame
    seq = rig.publisher._next_seq
    rig.publisher._next_seq += 1
    await pub.send_multipart([TOPIC.encode(), encode_seq(seq), b"\xc1 not msgpack"])
    await until(lambda: rig.stats.counts["malformed_payload"] == 1)
    assert rig.stats.counts["malformed_frames"] == 2
    assert rig.holds(good) == 0  # a batch we cannot read may have removed anything
    after = ids_of(2)
    await serve(rig.pod, after)
    await until(lambda: rig.holds(after) == 10)
    assert rig.sub.state.errors == 0


async def test_a_huge_batch_is_applied_in_slices_that_yield_to_the_loop(rig: Rig):
    ticks = 0
    seen: list[int] = []
    apply_events = rig.precise.apply_events

    def recording(pod: str, events: Sequence[KvEvent]) -> int:
        seen.append(ticks)
        return apply_events(pod, events)

    rig.sub._sink.apply_events = recording  # type: ignore[method-assign]
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    big = ids_of(7, 16 * 8192)  # a 128k-token prompt stored at once
    rig.publisher.publish([stored(big)])
    await until(lambda: rig.index.blocks("pod-0") >= 8192, timeout=30)
    stop.set()
    await task
    assert len(seen) >= 8192 // FAST.slice_blocks
    assert len(set(seen)) > 1  # the loop ran between slices
    assert rig.holds(big[:1600]) == 100


async def test_auto_mode_stays_approximate_until_a_publisher_answers_then_falls_back():
    port, replay_port = free_port(), free_port()
    now = [0.0]
    index = PrefixIndex(1000)
    precise = PreciseIndex(index, 16)
    sub = KvEventSubscriber(
        "pod-0",
        f"tcp://127.0.0.1:{port}",
        precise,
        model=MODEL,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=TOPIC,
        settings=SubscriberSettings(fallback_after_s=5.0, reconnect_ivl_s=0.05),
        clock=lambda: now[0],
    )
    await sub.start()
    try:
        # Positive signal first: ZMQ has retried the connection (nobody listens), twice.
        await until(lambda: sub.state.connect_retries >= 2)
        assert not sub.state.attached and not index.is_precise("pod-0")
        pod = await pod_with_events(port, replay_port)
        try:
            await until(lambda: index.is_precise("pod-0"))
        finally:
            await pod.close()
        await until(lambda: not sub.state.connected)
        assert index.is_precise("pod-0")  # not yet: a restart takes a moment
        now[0] += 6.0
        await until(lambda: not index.is_precise("pod-0"), timeout=5)
        assert not sub.state.attached
    finally:
        await sub.close()


async def test_closing_for_a_removed_pod_leaves_no_entries(rig: Rig):
    ids = ids_of(1)
    await serve(rig.pod, ids)
    await until(lambda: rig.holds(ids) == 10)
    await rig.sub.close()
    assert rig.holds(ids) == 0 and not rig.index.is_precise("pod-0")
    assert rig.index.blocks("pod-0") == 0


async def test_precise_mode_is_precise_before_any_connection():
    index = PrefixIndex(1000)
    precise = PreciseIndex(index, 16)
    sub = KvEventSubscriber(
        "pod-0", f"tcp://127.0.0.1:{free_port()}", precise, model=MODEL, mode="precise"
    )
    await sub.start()
    try:
        assert index.is_precise("pod-0")
    finally:
        await sub.close()


def test_endpoints_and_topics_from_templates():
    assert format_endpoint("tcp://{host}:5557", "10.1.2.3:8000", None, "p") == "tcp://10.1.2.3:5557"
    assert format_endpoint("kv@{host}:{port}@{model}", "10.1.2.3:8000", None, "p") is None
    assert (
        format_endpoint("kv@{host}:{port}@{model}", "10.1.2.3:8000", "llama", "p")
        == "kv@10.1.2.3:8000@llama"
    )
    assert (
        topic_prefix("kv@{host}:{port}@{model}", "10.1.2.3:8000", None, "p") == "kv@10.1.2.3:8000@"
    )
    assert topic_prefix("", "10.1.2.3:8000", None, "p") == ""


def test_the_kv_events_config_section():
    from pydantic import ValidationError

    from epp.config import EppConfig

    config = EppConfig.model_validate(
        {
            "kv_events": {
                "mode": "approximate",
                "pod_modes": {"pod-1": "precise"},
                "slice_ms": 2,
                "restart_margin_s": 10,
            }
        }
    ).kv_events
    assert config.mode_of("pod-0") == "approximate" and config.mode_of("pod-1") == "precise"
    settings = SubscriberSettings.from_config(config)
    assert (settings.slice_ms, settings.restart_margin_s) == (2, 10)
    assert SubscriberSettings.from_config(EppConfig().kv_events).restart_margin_s == 3.0
    assert EppConfig().kv_events.topic == ""  # vLLM's default topic: take all the pod sends
    bad_sections = (
        {"endpoint": "tcp://{hots}:5557"},
        {"mode": "exact"},
        {"predicted_ttl_s": 0},
        {"restart_margin_s": -1},
    )
    for bad in bad_sections:
        with pytest.raises(ValidationError):
            EppConfig.model_validate({"kv_events": bad})


def test_resolving_a_pods_mode_and_endpoints_from_config_and_labels():
    from epp.config import EppConfig

    config = EppConfig.model_validate(
        {"kv_events": {"pod_modes": {"b": "approximate"}, "topic": "kv@{host}:{port}@{model}"}}
    ).kv_events
    a = resolve_pod(config, "a", "10.0.0.5:8000", None)
    assert (a.mode, a.endpoint, a.replay_endpoint) == (
        "auto",
        "tcp://10.0.0.5:5557",
        "tcp://10.0.0.5:5558",
    )
    assert a.topic == "kv@10.0.0.5:8000@"  # the model is not known yet: a prefix
    assert resolve_pod(config, "b", "10.0.0.6:8000", "m").endpoint is None
    local = resolve_pod(
        config,
        "c",
        "127.0.0.1:8003",
        "m",
        {
            "kv_events_endpoint": "tcp://127.0.0.1:6003",
            "kv_events_replay": "",
            "kv_events_mode": "precise",
        },
    )
    assert (local.mode, local.endpoint, local.replay_endpoint) == (
        "precise",
        "tcp://127.0.0.1:6003",
        None,
    )
    assert resolve_pod(config, "d", "1.2.3.4:1", "m", {"kv_events_mode": "approximate"}).mode == (
        "approximate"
    )


def _ipv6_loopback_or_fail() -> None:
    """The IPv6 tests need ::1; a machine without it fails them loudly (they never skip:
    CI must run them)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        pytest.fail(f"no IPv6 loopback here ({exc}): the precise-mode IPv6 tests need ::1")


async def test_an_ipv6_pod_is_followed_over_real_zmq_on_the_ipv6_loopback():
    """A pod at [::1]: the publisher binds ::1, the subscriber dials the endpoint the
    default templates give for the address discovery writes (`[::1]:port`); events flow
    and a gap is filled from the replay socket, both over IPv6."""
    _ipv6_loopback_or_fail()
    config = SimPodConfig(
        pod_name="pod-0",
        model=MODEL,
        time_scale=0.001,
        kv_events=KvEventsConfig(host="::1", port=0, replay_port=0, topic=TOPIC),
    )
    pod = await start_pod(config, host="::1")
    publisher = pod.kv_publisher
    assert publisher is not None
    resolved = resolve_pod(
        EppKvEventsConfig(
            endpoint=f"tcp://{{host}}:{publisher.pub_port}",
            replay_endpoint=f"tcp://{{host}}:{publisher.replay_port}",
        ),
        "pod-0",
        f"[::1]:{pod.port}",
        MODEL,
    )
    assert resolved.endpoint == f"tcp://[::1]:{publisher.pub_port}"
    index = PrefixIndex(100_000)
    precise = PreciseIndex(index, 16)
    sub = KvEventSubscriber(
        "pod-0",
        resolved.endpoint,
        precise,
        model=MODEL,
        replay_endpoint=resolved.replay_endpoint,
        topic=TOPIC,
        settings=FAST,
    )
    try:
        await sub.start()
        await until(lambda: sub.state.attached and sub.state.resyncs >= 1, timeout=5.0)
        live = ids_of(1)
        await serve(pod, live)
        await until(lambda: index.match(ours(live)).get("pod-0", 0) == 10, timeout=5.0)
        lost = ids_of(2)
        lose(publisher, [stored(lost)])
        await serve(pod, ids_of(3))  # the next live batch reveals the gap: replay over ::1
        await until(lambda: index.match(ours(lost)).get("pod-0", 0) == 10, timeout=5.0)
        assert sub.state.gaps == 1 and sub.state.replay_failures == 0
    finally:
        await sub.close()
        await pod.close()


def test_ipv6_addresses_are_bracketed_in_endpoint_urls():
    assert format_endpoint("tcp://{host}:5557", "[fd00::1]:8000", None, "p") == (
        "tcp://[fd00::1]:5557"
    )
    # A template that brackets {host} itself gets the bare address.
    assert format_endpoint("tcp://[{host}]:5557", "[fd00::1]:8000", None, "p") == (
        "tcp://[fd00::1]:5557"
    )
    assert format_endpoint("tcp://{host}:{port}", "[::1]:8000", None, "p") == "tcp://[::1]:8000"
    # An address written without brackets is all host (its port cannot be told apart).
    assert format_endpoint("tcp://{host}:5557", "fd00::1", None, "p") == "tcp://[fd00::1]:5557"
    assert format_endpoint("tcp://{host}:5557", "10.1.2.3:8000", None, "p") == (
        "tcp://10.1.2.3:5557"
    )
    # Topics carry the bare address (as the simulator's default topic does).
    assert topic_prefix("kv@{host}:{port}@", "[fd00::1]:8000", None, "p") == "kv@fd00::1:8000@"


async def test_a_prefix_older_than_the_replay_buffer_is_relearnt_from_a_routed_request():
    """Real ZMQ: the engine stored a system prompt before the subscriber came, and the
    replay buffer (one batch) no longer holds it, so the resync does not tell it. A request
    routed to the pod (its prediction recorded, as the router does) hits it and stores
    only its suffix, whose parent the events never named: the prompt is relearnt."""
    pod = await pod_with_events(replay_buffer=1)
    try:
        system = ids_of(7, 64)
        await serve(pod, system)
        await serve(pod, ids_of(8, 64))  # the buffer's one batch is now this one
        rig = await Rig(pod).start()
        try:
            assert rig.holds(system) == 0
            prompt = system + ids_of(9, 32)
            rig.index.record("pod-0", ours(prompt), token="r1")
            await serve(pod, prompt)
            rig.index.completed("r1", time.monotonic())
            await until(lambda: rig.stats.counts["relearned_blocks"] == 4)
            assert all(rig.index.reported("pod-0", key) for key in ours(prompt))
            assert rig.holds(prompt) == 6
        finally:
            await rig.sub.close()
    finally:
        await pod.close()
