"""The live socket read and decoded in a thread (kv_subscriber/receiver.py), over real ZMQ
with vLLM-layout batches from the simulator's publisher (`vllm_sim.kv_publisher`): every
batch reaches the sink, in order, as on the loop; the decoder's counts reach the shared
stats; what waits for the loop is bounded; close ends the thread and its sockets (the
context terminates), also when it lands while items keep arriving."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import pytest
import zmq

from epp.datalayer.kv_subscriber import KvEventSubscriber, SubscriberSettings
from epp.datalayer.kv_subscriber.hub import HubClosed, ReceiverHub
from epp.prefix.kv_events import BlockStored, KvEvent, KvEventStats
from vllm_sim import kv_events as sim_events
from vllm_sim.kv_publisher import KvEventPublisher, KvEventsConfig

FAST = SubscriberSettings(resync_timeout_s=1.0, reconnect_ivl_s=0.05, reconnect_max_s=0.2)


class RecordingSink:
    """The sink contract (KvEventSink), recording what is applied, in order."""

    def __init__(self) -> None:
        self.stats = KvEventStats()
        self.applied: list[int] = []  # first block hash of each BlockStored, in order
        self.resets = 0
        self.attached = False

    def attach(self, pod: str, model: str | None) -> None:
        self.attached = True

    def detach(self, pod: str) -> None:
        self.attached = False

    def reset_pod(self, pod: str) -> None:
        self.resets += 1

    def apply_events(self, pod: str, events: Sequence[KvEvent]) -> int:
        for event in events:
            if isinstance(event, BlockStored):
                self.applied.append(event.block_hashes[0])
        return len(events)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def batch(n: int, blocks: int = 4) -> list[sim_events.KvEvent]:
    hashes = [n * 1000 + b for b in range(blocks)]
    return [sim_events.BlockStored(hashes, None, [n % 50_000] * (16 * blocks), 16)]


def _replace(settings: SubscriberSettings, **changes: object) -> SubscriberSettings:
    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


def live_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-live-")]


async def subscribed(settings: SubscriberSettings) -> tuple[KvEventPublisher, KvEventSubscriber, RecordingSink]:  # fmt: skip
    publisher = KvEventPublisher(KvEventsConfig(port=0), topic="t")
    await publisher.start()
    sink = RecordingSink()
    sub = KvEventSubscriber(
        "pod-0",
        f"tcp://127.0.0.1:{publisher.pub_port}",
        sink,
        model="m",
        mode="precise",
        settings=settings,
    )
    await sub.start()
    await until(lambda: sub.state.connected and sub.state.resyncs >= 1)
    return publisher, sub, sink


async def publish_and_collect(settings: SubscriberSettings, count: int) -> tuple[list[int], KvEventSubscriber]:  # fmt: skip
    publisher, sub, sink = await subscribed(settings)
    try:
        for n in range(count):
            publisher.publish(batch(n))
            if n % 50 == 0:
                await asyncio.sleep(0)  # let the sender task put them on the wire
        await until(lambda: len(sink.applied) == count)
        return sink.applied, sub
    finally:
        await sub.close()
        await publisher.close()


async def test_every_batch_reaches_the_sink_in_order_as_on_the_loop() -> None:
    count = 2000
    threaded, sub = await publish_and_collect(FAST, count)
    expected = [n * 1000 for n in range(count)]
    assert threaded == expected
    assert sub.state.messages == count and sub.state.gaps == 0
    # What the thread's decoder counted reached the shared stats, once per batch.
    assert sub.stats.counts["batches"] == count and sub.stats.counts["events"] == count
    on_loop, _ = await publish_and_collect(_replace(FAST, receive_in_thread=False), count)
    assert on_loop == threaded


async def test_a_bad_payload_is_counted_from_the_thread_and_the_next_batch_applies() -> None:
    publisher, sub, sink = await subscribed(FAST)
    try:
        pub = publisher._pub  # a payload the simulator would never send
        assert pub is not None
        seq = publisher.next_seq
        publisher._next_seq += 1
        await pub.send_multipart([b"t", sim_events.encode_seq(seq), b"\xc1 not msgpack"])
        publisher.publish(batch(1))
        await until(lambda: sink.applied == [1000])
        assert sub.stats.counts["malformed_payload"] == 1
        assert sink.resets >= 2  # the connection's resync, then the unreadable batch
    finally:
        await sub.close()
        await publisher.close()


async def test_what_waits_for_the_loop_is_bounded_by_rcvhwm() -> None:
    settings = _replace(FAST, rcvhwm=20)
    publisher, sub, sink = await subscribed(settings)
    try:
        receiver = sub._receiver
        assert receiver is not None
        for n in range(500):
            publisher.publish(batch(n))
        await until(lambda: publisher.sent == 500)
        time.sleep(0.5)  # the loop is busy: the thread fills its queue, then stops reading
        assert 0 < len(receiver._items) <= 20
        publisher.publish(batch(500))  # reveals a gap if ZMQ dropped the tail meanwhile
        await until(lambda: sink.applied[-1:] == [500_000])
        # Whatever ZMQ dropped meanwhile is a gap, as without the thread: never silent.
        assert len(sink.applied) == 501 or sub.state.gaps >= 1
        assert sink.applied == sorted(sink.applied)
    finally:
        await sub.close()
        await publisher.close()


async def test_close_ends_the_thread_and_its_sockets_even_while_items_arrive() -> None:
    publisher = KvEventPublisher(KvEventsConfig(port=0), topic="t")
    await publisher.start()
    stop = asyncio.Event()

    async def publish_forever() -> None:
        n = 0
        while not stop.is_set():
            publisher.publish(batch(n))
            n += 1
            await asyncio.sleep(0.0005)

    feeder = asyncio.create_task(publish_forever())
    try:
        for attempt in range(30):
            # Its own context: close terminates it, which blocks while a socket is open.
            sub = KvEventSubscriber(
                f"pod-{attempt}",
                f"tcp://127.0.0.1:{publisher.pub_port}",
                RecordingSink(),
                model="m",
                mode="precise",
                settings=FAST,
            )
            await sub.start()
            await asyncio.sleep(0.002 * (attempt % 10))
            await asyncio.wait_for(sub.close(), 5.0)
            assert sub._receiver is None
        await until(lambda: live_threads() == [], timeout=2.0)
    finally:
        stop.set()
        await feeder
        await publisher.close()


@pytest.mark.parametrize("in_thread", [True, False])
async def test_close_before_any_connection_is_clean(in_thread: bool) -> None:
    sub = KvEventSubscriber(
        "pod-0",
        "tcp://127.0.0.1:1",  # nothing listens
        RecordingSink(),
        model="m",
        mode="precise",
        settings=_replace(FAST, receive_in_thread=in_thread),
    )
    await sub.start()
    await until(lambda: sub.state.connect_retries >= 1)
    await asyncio.wait_for(sub.close(), 5.0)
    await until(lambda: live_threads() == [], timeout=2.0)


@pytest.mark.parametrize("in_thread", [True, False])
async def test_a_bad_endpoint_raises_on_start_and_leaves_no_thread(in_thread: bool) -> None:
    """...nor a precise pod: no events will come to keep its entries true."""
    sink = RecordingSink()
    sub = KvEventSubscriber(
        "pod-0",
        "nosuchtransport://127.0.0.1:1",
        sink,
        model="m",
        mode="precise",
        settings=_replace(FAST, receive_in_thread=in_thread),
    )
    with pytest.raises(zmq.ZMQError):
        await sub.start()
    assert not sub.state.attached and not sink.attached
    await until(lambda: live_threads() == [], timeout=2.0)
    await asyncio.wait_for(sub.close(), 5.0)


# -- one shared thread for every followed pod ----------------------------------------------


def follower(name: str, port: int, sink: RecordingSink, hub: ReceiverHub, settings: SubscriberSettings = FAST) -> KvEventSubscriber:  # fmt: skip
    return KvEventSubscriber(
        name,
        f"tcp://127.0.0.1:{port}",
        sink,
        model="m",
        topic="t",
        mode="precise",
        settings=settings,
        hub=lambda: hub,
    )


async def test_every_followed_pod_is_read_by_one_thread() -> None:
    hub = ReceiverHub()
    publishers = [KvEventPublisher(KvEventsConfig(port=0), topic="t") for _ in range(12)]
    sinks = [RecordingSink() for _ in publishers]
    for publisher in publishers:
        await publisher.start()
    subs = [follower(f"pod-{i}", p.pub_port, sinks[i], hub) for i, p in enumerate(publishers)]
    try:
        for sub in subs:
            await sub.start()
        await until(lambda: all(s.state.connected and s.state.resyncs >= 1 for s in subs))
        assert live_threads() == ["kv-live-receiver"]
        for n in range(100):
            for i, publisher in enumerate(publishers):
                publisher.publish(batch(n * 100 + i))
            await asyncio.sleep(0)
        expected = [[(n * 100 + i) * 1000 for n in range(100)] for i in range(len(publishers))]
        await until(lambda: [s.applied for s in sinks] == expected)
    finally:
        await asyncio.gather(*(sub.close() for sub in subs))
        for publisher in publishers:
            await publisher.close()
        await hub.close()
    await until(lambda: live_threads() == [], timeout=2.0)


async def test_a_subscriber_whose_own_thread_a_bug_ended_reads_on_a_new_one() -> None:
    """Given no hub, the subscriber makes its own; a bug ending that thread is told (an
    error: entries dropped, a resync due) and the pod's socket moves to a new thread of
    its own, where its batches arrive again."""
    publisher, sub, sink = await subscribed(_replace(FAST, receive_in_thread=True))
    try:
        first = sub._own_hub
        assert first is not None

        def broken() -> None:
            raise RuntimeError("hub bug")

        first._turn = broken  # type: ignore[method-assign]
        first.wake()
        await until(lambda: first.failed and sub.state.errors >= 1)
        await until(lambda: sub._own_hub is not first and sub.state.connected)
        assert live_threads() == ["kv-live-receiver"]
        applied = len(sink.applied)
        publisher.publish(batch(5))
        await until(lambda: sink.applied[applied:] == [5000])
    finally:
        await asyncio.wait_for(sub.close(), 5.0)
        await publisher.close()
    await until(lambda: live_threads() == [], timeout=2.0)


class DetachRecordingSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__()
        self.detached: list[str] = []

    def detach(self, pod: str) -> None:
        self.detached.append(pod)


async def test_an_auto_pod_no_new_thread_takes_still_falls_back_to_approximate() -> None:
    """A bug ended the shared thread and its owner cannot make a new one (`hub()` raises,
    e.g. out of file descriptors): the pod's events stopped, so an auto pod goes back to
    approximate after `fallback_after_s`, as when its publisher is gone."""
    publisher = KvEventPublisher(KvEventsConfig(port=0), topic="t")
    await publisher.start()
    hub = ReceiverHub()

    def live_hub() -> ReceiverHub:
        if not hub.running:
            raise OSError("too many open files")
        return hub

    sink = DetachRecordingSink()
    sub = KvEventSubscriber(
        "pod-0",
        f"tcp://127.0.0.1:{publisher.pub_port}",
        sink,
        model="m",
        topic="t",
        mode="auto",
        settings=_replace(FAST, fallback_after_s=0.3),
        hub=live_hub,
    )
    try:
        await sub.start()
        await until(lambda: sub.state.connected and sub.state.attached)

        def broken() -> None:
            raise RuntimeError("hub bug")

        hub._turn = broken  # type: ignore[method-assign]
        hub.wake()
        await until(lambda: hub.failed and not hub.running)
        await until(lambda: not sub.state.attached, timeout=5.0)
        assert sink.detached == ["pod-0"]
    finally:
        await asyncio.wait_for(sub.close(), 5.0)
        await publisher.close()
        await hub.close()
    await until(lambda: live_threads() == [], timeout=2.0)


async def test_garbage_from_one_pod_never_stops_the_others() -> None:
    """Pod `bad` is a raw PUB socket sending truncated and garbage frames, pod `good` a
    vLLM-layout publisher: every good batch arrives, in order, while the garbage flows;
    the bad pod's problems are counted on its side, and it still applies a valid batch."""
    context = zmq.asyncio.Context()
    raw = context.socket(zmq.PUB)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    hub = ReceiverHub()
    good_pub = KvEventPublisher(KvEventsConfig(port=0), topic="t")
    await good_pub.start()
    bad_sink, good_sink = RecordingSink(), RecordingSink()
    bad = follower("bad", raw_port, bad_sink, hub)
    good = follower("good", good_pub.pub_port, good_sink, hub)
    try:
        await bad.start()
        await good.start()
        await until(lambda: bad.state.connected and good.state.connected)
        await until(lambda: good.state.resyncs >= 1 and bad.state.resyncs >= 1)
        garbage = [
            [b"t"],  # truncated: one frame
            [b"t", sim_events.encode_seq(0)],  # truncated: no payload
            [b"t", b"\x01\x02\x03", b"\x90"],  # a sequence number of 3 bytes
            [b"t", sim_events.encode_seq(0), b"\xc1 not msgpack"],
            [b"t", sim_events.encode_seq(1), b"\x93\xff\xff"],  # msgpack, not a batch
        ]
        for n in range(300):
            await raw.send_multipart(garbage[n % len(garbage)])
            good_pub.publish(batch(n))
            if n % 20 == 0:
                await asyncio.sleep(0.001)
        await until(lambda: good_sink.applied == [n * 1000 for n in range(300)])
        assert good.state.gaps == 0 and good.state.errors == 0
        problems = bad_sink.stats.counts
        await until(lambda: problems["malformed_frames"] >= 180)
        assert problems["malformed_payload"] >= 1
        assert good_sink.stats.counts["malformed_frames"] == 0
        # The bad pod's receiver still works: a valid batch after the garbage applies.
        seq = bad.state.next_seq or 0
        payload = sim_events.encode_event_batch(batch(777), time.time())
        await raw.send_multipart([b"t", sim_events.encode_seq(seq), payload])
        await until(lambda: bad_sink.applied[-1:] == [777_000])
    finally:
        await bad.close()
        await good.close()
        raw.close(linger=0)
        await good_pub.close()
        await hub.close()
        context.term()


async def test_a_failure_reading_one_pod_is_that_pods_alone(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """An unexpected error handling one pod's socket (a bug, a ZMQ error) reaches that
    pod's subscriber as an error (its entries dropped, a resync due); its socket rests
    and is read again; the other pod's batches keep arriving meanwhile."""
    hub = ReceiverHub()
    pubs = [KvEventPublisher(KvEventsConfig(port=0), topic="t") for _ in range(2)]
    for publisher in pubs:
        await publisher.start()
    sinks = [RecordingSink(), RecordingSink()]
    subs = [follower(f"pod-{i}", p.pub_port, sinks[i], hub) for i, p in enumerate(pubs)]
    try:
        for sub in subs:
            await sub.start()
        await until(lambda: all(s.state.connected and s.state.resyncs >= 1 for s in subs))
        broken = subs[0]._receiver
        assert broken is not None
        failures = 0
        original = broken._decode

        def decode_failing_thrice(frames: list[bytes]) -> object:
            nonlocal failures
            if failures < 3:
                failures += 1
                raise RuntimeError("decoder bug")
            return original(frames)

        monkeypatch.setattr(broken, "_decode", decode_failing_thrice)
        for n in range(200):
            pubs[0].publish(batch(n))
            pubs[1].publish(batch(n))
            if n % 20 == 0:
                await asyncio.sleep(0.001)
        await until(lambda: sinks[1].applied == [n * 1000 for n in range(200)])
        await until(lambda: subs[0].state.errors == 3)
        # The broken pod goes on after resting: a later batch reaches its sink.
        pubs[0].publish(batch(999))
        await until(lambda: sinks[0].applied[-1:] == [999_000])
        assert subs[1].state.errors == 0 and subs[1].state.gaps == 0
    finally:
        await asyncio.gather(*(sub.close() for sub in subs))
        for publisher in pubs:
            await publisher.close()
        await hub.close()


async def test_more_pods_than_zmqs_default_socket_limit() -> None:
    """Three sockets a pod (SUB, its monitor pair): 400 pods are 1,200 sockets, beyond
    libzmq's default of 1,023 per context, which would fail the 342nd pod's start."""
    hub = ReceiverHub()
    quiet = _replace(FAST, reconnect_ivl_s=1.0, reconnect_max_s=5.0)
    subs = [follower(f"pod-{i}", 1, RecordingSink(), hub, quiet) for i in range(400)]
    try:
        for sub in subs:
            await sub.start()
        assert live_threads() == ["kv-live-receiver"]
        await until(lambda: all(s.state.connect_retries >= 1 for s in subs))
    finally:
        await asyncio.gather(*(sub.close() for sub in subs))
        await hub.close()
    await until(lambda: live_threads() == [], timeout=2.0)


async def test_a_closed_hub_refuses_new_pods_and_closes_what_it_is_handed() -> None:
    hub = ReceiverHub()
    await hub.close()
    assert not hub.running and live_threads() == []
    with pytest.raises(HubClosed):
        await follower("late", 1, RecordingSink(), hub).start()
    # Sockets handed over while it closes are closed by `add`, not leaked.
    context = zmq.Context()
    sub, monitor = context.socket(zmq.SUB), context.socket(zmq.PAIR)
    with pytest.raises(HubClosed):
        hub.add(None, sub, monitor)  # type: ignore[arg-type]
    assert sub.closed and monitor.closed
    context.term()
