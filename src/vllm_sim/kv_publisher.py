"""Publishes KV-cache event batches over ZMQ exactly as vLLM's `ZmqEventPublisher` does.

- A PUB socket sends each batch as three frames: topic, sequence number (8 bytes,
  big-endian, from 0, +1 per batch), msgpack payload (`vllm_sim.kv_events`). PUB drops
  what no subscriber is connected for, so a gap in the sequence numbers means lost batches.
- A ROUTER socket serves replays: a DEALER sends `[b"", start_seq]` and gets
  `[b"", topic, seq, payload]` for every buffered batch with seq >= start_seq, then
  `[b"", b"", ff..ff, b""]` (an empty topic). That is vLLM 0.32's layout
  (`ZmqEventPublisher._service_replay`), one frame more than older notes describe, so a
  replay client should take the last two frames as seq and payload. The buffer keeps
  the last `replay_buffer` batches.

`publish` is synchronous (it is called right after an engine call, from request handlers
and their cleanup): it numbers, encodes and buffers the batch at once and hands it to a
sender task, so batches go out in the order they were published.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from vllm_sim.failures import KvEventsFault
from vllm_sim.kv_events import (
    REPLAY_END_SEQ,
    SEQ_BYTES,
    KvEvent,
    encode_event_batch,
    encode_seq,
)

log = logging.getLogger("vllm_sim.kv_events")

DEFAULT_REPLAY_BUFFER = 10_000  # vLLM's default `buffer_steps`


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """Where a pod publishes its KV events (port 0: any free port)."""

    port: int
    replay_port: int | None = None  # None: no replay socket
    host: str = "127.0.0.1"
    topic: str | None = None  # None: kv@<host>:<http port>@<model>, set when serving
    replay_buffer: int = DEFAULT_REPLAY_BUFFER
    data_parallel_rank: int | None = 0
    # The first batch's sequence number. vLLM starts at 0; a later one stands for a
    # publisher whose numbering survives its restart (tests: a restart that the
    # sequence numbers do not reveal, only the pod's start time).
    first_seq: int = 0

    def __post_init__(self) -> None:
        for name in ("port", "replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be a TCP port (0 for any free one)")
        if self.replay_buffer < 1:
            raise ValueError("replay_buffer must be at least 1")
        if not 0 <= self.first_seq < 2**63:
            raise ValueError("first_seq must be a sequence number (0 <= seq < 2**63)")


def default_topic(host: str, http_port: int, model: str) -> str:
    return f"kv@{host}:{http_port}@{model}"


class KvEventPublisher:
    """The PUB and replay ROUTER sockets of one pod; `start()`, `publish()`, `close()`."""

    def __init__(self, config: KvEventsConfig, topic: str) -> None:
        self.config = config
        self.topic = topic
        self._topic_frame = topic.encode()
        self._context = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_buffer)
        self._outbox: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._next_seq = config.first_seq
        self.pub_port: int | None = None
        self.replay_port: int | None = None
        self.fault: KvEventsFault | None = None  # what happens to each batch sent (tests)
        self._held: tuple[bytes, bytes] | None = None  # a batch `reorder` sends late
        # Batches handed to the PUB socket (read-only, for tests: a "nothing reached the
        # index" check first waits until the batch has actually left the publisher).
        self.sent = 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def start(self) -> None:
        """Bind the sockets (raises zmq.ZMQError if a port is taken) and start serving."""
        config = self.config
        try:
            self._pub = self._context.socket(zmq.PUB)
            self.pub_port = _bind(self._pub, config.host, config.port)
            if config.replay_port is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self.replay_port = _bind(self._replay, config.host, config.replay_port)
        except BaseException:
            await self.close()
            raise
        self._tasks.append(asyncio.create_task(self._send_loop(), name="kv-events-pub"))
        if self._replay is not None:
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kv-events-replay"))

    def publish(self, events: Sequence[KvEvent], ts: float | None = None) -> int:
        """Number, encode, buffer and queue one batch; returns its sequence number."""
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_event_batch(
            events, time.time() if ts is None else ts, self.config.data_parallel_rank
        )
        self._buffer.append((seq, payload))
        message = (encode_seq(seq), payload)
        fault = self.fault
        if fault is KvEventsFault.DROP:
            return seq
        if fault is KvEventsFault.REORDER and self._held is None:
            self._held = message
            return seq
        self._outbox.put_nowait(message)
        if fault is KvEventsFault.DUPLICATE:
            self._outbox.put_nowait(message)
        if self._held is not None:
            self._outbox.put_nowait(self._held)
            self._held = None
        return seq

    async def restart(self) -> None:
        """Close and rebind both sockets on the same ports, as a restarted publisher: the
        sequence starts again at `first_seq`, the replay buffer is empty, batches not sent
        yet are gone."""
        await self.close()
        self._context = zmq.asyncio.Context()
        self._buffer.clear()
        self._outbox = asyncio.Queue()
        self._held = None
        self._next_seq = self.config.first_seq
        self.config = dataclasses.replace(
            self.config, port=self.pub_port or 0, replay_port=self.replay_port
        )
        await self.start()

    async def close(self) -> None:
        """Stop the tasks, close the sockets, end the context; safe to call twice."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._replay = None
        self._context.term()

    async def _send_loop(self) -> None:
        pub = self._pub
        assert pub is not None
        while True:
            seq, payload = await self._outbox.get()
            await pub.send_multipart((self._topic_frame, seq, payload))
            self.sent += 1

    async def _replay_loop(self) -> None:
        router = self._replay
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            # [identity, b"", start_seq] from a DEALER; anything else is not a replay ask.
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
                log.debug("ignoring a malformed replay request frames=%d", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            topic = self._topic_frame
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart((identity, b"", topic, encode_seq(seq), payload))
            await router.send_multipart((identity, b"", b"", REPLAY_END_SEQ, b""))


def _bind(socket: zmq.asyncio.Socket, host: str, port: int) -> int:
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IPV6, 1)  # else ZMQ refuses an IPv6 address (and `::` / `*` stay IPv4)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    if port == 0:
        return socket.bind_to_random_port(f"tcp://{host}")
    socket.bind(f"tcp://{host}:{port}")
    return port
