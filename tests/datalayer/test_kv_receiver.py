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

    def attach(self, pod: str, model: str | None) -> None:
        pass

    def detach(self, pod: str) -> None:
        pass

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
    sub = KvEventSubscriber(
        "pod-0",
        "nosuchtransport://127.0.0.1:1",
        RecordingSink(),
        model="m",
        mode="precise",
        settings=_replace(FAST, receive_in_thread=in_thread),
    )
    with pytest.raises(zmq.ZMQError):
        await sub.start()
    assert live_threads() == []
    await asyncio.wait_for(sub.close(), 5.0)
