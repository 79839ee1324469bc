"""KV events over real ZMQ sockets: a SUB for the live stream, a DEALER for replays."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator

import aiohttp
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from vllm_sim.hashing import block_hashes
from vllm_sim.kv_events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    decode_event_batch,
    decode_seq,
    encode_seq,
)
from vllm_sim.kv_publisher import KvEventPublisher, KvEventsConfig
from vllm_sim.server import RunningPod

from .conftest import StartPod

RECV_TIMEOUT_S = 3.0


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def subscribe(context: zmq.asyncio.Context, port: int) -> zmq.asyncio.Socket:
    """A SUB socket on every topic, returned once the PUB side has its subscription."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(f"tcp://127.0.0.1:{port}")
    await asyncio.wait_for(recv_monitor_message(monitor), RECV_TIMEOUT_S)
    sub.disable_monitor()
    monitor.close(linger=0)
    # PUB drops messages until the subscription, sent right after the handshake, lands.
    await asyncio.sleep(0.05)
    return sub


async def receive(sub: zmq.asyncio.Socket) -> tuple[bytes, int, KvEventBatch, bytes]:
    topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), RECV_TIMEOUT_S)
    return topic, decode_seq(seq), decode_event_batch(payload), payload


async def replay_frames(
    context: zmq.asyncio.Context, port: int, start: int
) -> list[tuple[bytes, bytes, bytes]]:
    """Ask the ROUTER for every batch from `start`: [(topic, seq frame, payload)] after the
    empty delimiter, as vLLM 0.32 sends them, end marker last."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        await dealer.send_multipart([b"", encode_seq(start)])
        frames: list[tuple[bytes, bytes, bytes]] = []
        while not frames or frames[-1][1] != REPLAY_END_SEQ:
            message = await asyncio.wait_for(dealer.recv_multipart(), RECV_TIMEOUT_S)
            assert len(message) == 4, message
            empty, topic, seq, payload = message
            assert empty == b""
            frames.append((topic, seq, payload))
        return frames
    finally:
        dealer.close(linger=0)


async def replay(context: zmq.asyncio.Context, port: int, start: int) -> list[tuple[bytes, bytes]]:
    """`replay_frames` without the topics: [(seq frame, payload)], end marker last."""
    return [(seq, payload) for _, seq, payload in await replay_frames(context, port, start)]


async def complete(http: aiohttp.ClientSession, pod: RunningPod, prompt: list[int]) -> int:
    body = {"prompt": prompt, "max_tokens": 1}
    async with http.post(pod.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_live_batches_number_and_describe_a_request_sequence(
    start: StartPod, http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context
) -> None:
    # 12 blocks of 16 tokens: A (4 blocks) fits; B (10 blocks) forces A's tail out.
    pod = await start(num_gpu_blocks=12, kv_events=KvEventsConfig(port=0, replay_port=0))
    assert pod.kv_publisher is not None and pod.kv_publisher.pub_port is not None
    sub = await subscribe(zmq_context, pod.kv_publisher.pub_port)
    a, b = list(range(64)), list(range(1000, 1160))
    a_hashes = block_hashes(array("I", a), 16)
    b_hashes = block_hashes(array("I", b), 16)

    assert await complete(http, pod, a) == 0
    topic, seq, batch, _ = await receive(sub)
    assert topic == f"kv@127.0.0.1:{pod.port}@sim-llama-8b".encode()
    assert seq == 0
    assert batch.data_parallel_rank == 0
    assert batch.events == [
        BlockStored(
            block_hashes=a_hashes,
            parent_block_hash=None,
            token_ids=a,
            block_size=16,
            extra_keys=[None] * 4,
        )
    ]

    # Reused, but the last block is recomputed (the last prompt token is never a hit) and
    # cached as a second copy, announced again under its hash, as vLLM does.
    assert await complete(http, pod, a) == 48
    _, seq, batch, _ = await receive(sub)
    assert seq == 1
    assert batch.events == [
        BlockStored(
            block_hashes=a_hashes[3:],
            parent_block_hash=a_hashes[2],
            token_ids=a[48:],
            block_size=16,
            extra_keys=[None],
        )
    ]

    assert await complete(http, pod, b) == 0
    _, seq, batch, _ = await receive(sub)
    assert seq == 2
    # 5 blocks cached, 7 free: 3 evicted, the tail first, each copy of a3 on its own.
    evicted = [a_hashes[3], a_hashes[3], a_hashes[2]]
    assert batch.events[:3] == [BlockRemoved(block_hashes=[h]) for h in evicted]
    assert batch.events[3:] == [
        BlockStored(
            block_hashes=b_hashes,
            parent_block_hash=None,
            token_ids=b,
            block_size=16,
            extra_keys=[None] * 10,
        )
    ]

    async with http.post(pod.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    # Like vLLM, the reset alone publishes nothing: its AllBlocksCleared leaves with the
    # next batch, here the next request's.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sub.recv_multipart(), 0.2)
    assert await complete(http, pod, a) == 0
    _, seq, batch, _ = await receive(sub)
    assert seq == 3
    assert [type(e) for e in batch.events] == [AllBlocksCleared, BlockStored]


async def test_replay_sends_buffered_batches_from_the_asked_sequence_then_the_end_marker(
    start: StartPod, http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context
) -> None:
    pod = await start(kv_events=KvEventsConfig(port=0, replay_port=0))
    publisher = pod.kv_publisher
    assert publisher is not None and publisher.pub_port and publisher.replay_port
    sub = await subscribe(zmq_context, publisher.pub_port)
    live = []
    for start_token in (0, 100, 200):
        await complete(http, pod, list(range(start_token, start_token + 32)))
        _, seq, _, payload = await receive(sub)
        live.append((encode_seq(seq), payload))
    assert [decode_seq(s) for s, _ in live] == [0, 1, 2]
    end = (REPLAY_END_SEQ, b"")
    assert await replay(zmq_context, publisher.replay_port, 1) == [*live[1:], end]
    assert await replay(zmq_context, publisher.replay_port, 0) == [*live, end]
    assert await replay(zmq_context, publisher.replay_port, 99) == [end]
    # Each batch comes with its topic, the end marker with an empty one (vLLM 0.32).
    topics = [t for t, _, _ in await replay_frames(zmq_context, publisher.replay_port, 0)]
    assert topics == [publisher.topic.encode()] * 3 + [b""]


async def test_replay_buffer_keeps_only_the_newest_batches(
    zmq_context: zmq.asyncio.Context,
) -> None:
    publisher = KvEventPublisher(KvEventsConfig(port=0, replay_port=0, replay_buffer=2), "t")
    await publisher.start()
    try:
        assert publisher.replay_port is not None
        for _ in range(3):
            publisher.publish([AllBlocksCleared()], ts=1.0)
        frames = await replay(zmq_context, publisher.replay_port, 0)
        assert [decode_seq(seq) for seq, _ in frames[:-1]] == [1, 2]
        assert decode_event_batch(frames[0][1]).events == [AllBlocksCleared()]
    finally:
        await publisher.close()


async def test_the_first_sequence_number_can_continue_an_earlier_publishers(
    zmq_context: zmq.asyncio.Context,
) -> None:
    publisher = KvEventPublisher(KvEventsConfig(port=0, replay_port=0, first_seq=7), "t")
    await publisher.start()
    try:
        assert publisher.replay_port is not None
        for _ in range(2):
            publisher.publish([AllBlocksCleared()], ts=1.0)
        frames = await replay(zmq_context, publisher.replay_port, 0)
        assert [decode_seq(seq) for seq, _ in frames[:-1]] == [7, 8]
    finally:
        await publisher.close()
    with pytest.raises(ValueError, match="first_seq"):
        KvEventsConfig(port=0, first_seq=-1)


async def test_a_malformed_replay_request_is_ignored(zmq_context: zmq.asyncio.Context) -> None:
    publisher = KvEventPublisher(KvEventsConfig(port=0, replay_port=0), "t")
    await publisher.start()
    try:
        assert publisher.replay_port is not None
        publisher.publish([AllBlocksCleared()])
        dealer = zmq_context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{publisher.replay_port}")
        await dealer.send_multipart([b"", b"\x01"])  # not 8 bytes
        dealer.close(linger=0)
        frames = await replay(zmq_context, publisher.replay_port, 0)
        assert [seq for seq, _ in frames] == [encode_seq(0), REPLAY_END_SEQ]
    finally:
        await publisher.close()


async def test_custom_topic_and_no_replay_socket(
    start: StartPod, http: aiohttp.ClientSession, zmq_context: zmq.asyncio.Context
) -> None:
    pod = await start(kv_events=KvEventsConfig(port=0, topic="kv@pod-7"))
    publisher = pod.kv_publisher
    assert publisher is not None and publisher.pub_port is not None
    assert publisher.replay_port is None
    sub = await subscribe(zmq_context, publisher.pub_port)
    await complete(http, pod, list(range(16)))
    topic, seq, _, _ = await receive(sub)
    assert (topic, seq) == (b"kv@pod-7", 0)


async def test_closing_the_pod_closes_the_sockets(start: StartPod) -> None:
    pod = await start(kv_events=KvEventsConfig(port=0, replay_port=0))
    publisher = pod.kv_publisher
    assert publisher is not None
    await pod.close()
    assert pod.pod.kv_publisher is None
    # The ports are free again.
    again = KvEventPublisher(
        KvEventsConfig(port=publisher.pub_port or 0, replay_port=publisher.replay_port), "t"
    )
    await again.start()
    await again.close()


def test_config_refuses_bad_ports_and_buffers() -> None:
    for bad in ({"port": -1}, {"port": 70000}, {"port": 0, "replay_port": 65536}):
        with pytest.raises(ValueError):
            KvEventsConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        KvEventsConfig(port=0, replay_buffer=0)


async def test_sim_kv_lists_the_engines_cached_hashes_each_once(
    start: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start(num_gpu_blocks=12, kv_events=KvEventsConfig(port=0, replay_port=0))
    a = list(range(64))
    await complete(http, pod, a)
    await complete(http, pod, a)  # a second copy of the last block: listed once
    async with http.get(pod.url + "/sim/kv") as resp:
        view = await resp.json()
    assert view == {
        "block_size": 16,
        "blocks": sorted(f"{h:016x}" for h in block_hashes(array("I", a), 16)),
    }
