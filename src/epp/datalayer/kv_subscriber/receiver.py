"""The live SUB socket of one pod, read and decoded in a thread of its own.

Receiving and decoding a pod's live batches costs the routing loop about as much as
applying them (pyzmq's asyncio sockets wake the loop once per message, and msgpack
decoding is not sliced): `epp bench loop` (docs/benchmarks/loop.md) measured routing p99
several times lower with that work here. What changes the index or the subscriber's
sequence bookkeeping stays on the loop: this thread only produces, in arrival order,

- `Connected`, `Disconnected`, `Retried`: the socket monitor's events;
- `Message`: a live message, its payload decoded (`batch`; None: refused, counted in
  `counts`), or its frames malformed (`seq` None);
- `Failed`: an unexpected error in the thread, which goes on after `reconnect_ivl_s`.

Invariants: once started, the thread alone touches its sockets (ZMQ sockets are not
thread-safe; `start` opens them, so that a bad endpoint raises to its caller) and
closes them before `stop` returns, so the context can be terminated after it; items
reach the loop in the order they were received; at most `rcvhwm` items wait for the
loop, then the thread stops reading and ZMQ's own queue (`rcvhwm` more) fills and drops,
which the subscriber sees as a gap, as it would without the thread. The decoder's
counters are the thread's own (`KvEventStats` is not thread-safe): each item carries
what its decoding counted, for the loop to add.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.datalayer.kv_subscriber.sockets import open_sub_socket
from epp.datalayer.kv_subscriber.state import SubscriberSettings
from epp.prefix.kv_events import EventBatch, KvEventDecoder, KvEventStats, decode_seq

POLL_MS = 500  # how soon the thread sees `stop` (an idle thread wakes this often)


@dataclass(frozen=True, slots=True)
class Message:
    seq: int | None  # None: not [topic, seq (8 bytes), payload]
    payload: bytes
    batch: EventBatch | None  # None: refused by the decoder (or malformed frames)
    counts: dict[str, int]  # what decoding it counted (KvEventStats reasons)
    frames: int


@dataclass(frozen=True, slots=True)
class Connected:
    pass


@dataclass(frozen=True, slots=True)
class Disconnected:
    pass


@dataclass(frozen=True, slots=True)
class Retried:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    error: str


Item = Message | Connected | Disconnected | Retried | Failed


class LiveReceiver:
    """`start()` on the loop that consumes; `await items(timeout)` there; `await stop()`."""

    def __init__(
        self,
        pod: str,
        context: zmq.asyncio.Context,
        endpoint: str,
        topic: bytes,
        settings: SubscriberSettings,
    ) -> None:
        self.pod = pod
        # The same context, with sync sockets.
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context.underlying)
        self._endpoint = endpoint
        self._topic = topic
        self._settings = settings
        self._decoder = KvEventDecoder(settings.limits, KvEventStats())
        self._items: deque[Item] = deque()
        self._lock = threading.Lock()
        self._notified = False  # a wake-up is on its way to the loop
        self._room = threading.Event()
        self._stopping = threading.Event()
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Open the sockets here, so that a bad endpoint raises to the caller, then hand
        them to the thread (starting it is the memory barrier ZMQ asks for a socket to
        change threads); from then on only the thread touches them."""
        self._loop = asyncio.get_running_loop()
        sockets = open_sub_socket(self._context, self._endpoint, self._topic, self._settings)  # type: ignore[arg-type]  # fmt: skip
        self._thread = threading.Thread(
            target=self._run, args=sockets, name=f"kv-live-{self.pod}", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        """End the thread; its sockets are closed when this returns."""
        self._stopping.set()
        self._room.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        while thread.is_alive():  # within POLL_MS; no executor thread held meanwhile
            await asyncio.sleep(0.005)
        thread.join()

    async def items(self, timeout_s: float) -> list[Item]:
        """Every item received so far, in order; waits up to `timeout_s` for the first."""
        if not self._items:
            # Not asyncio.wait_for: on 3.11 it can swallow a cancellation that arrives
            # as the event is set, and `close` would wait for this task forever.
            timer = asyncio.get_running_loop().call_later(timeout_s, self._ready.set)
            try:
                await self._ready.wait()
            finally:
                timer.cancel()
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._notified = False
            self._ready.clear()
        self._room.set()
        return items

    # -- the thread ---------------------------------------------------------------------

    def _put(self, item: Item) -> None:
        with self._lock:
            self._items.append(item)
            notify, self._notified = not self._notified, True
        loop = self._loop
        if notify and loop is not None:
            try:
                loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop is closed: the service is gone
                self._stopping.set()

    def _run(self, sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        try:
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stopping.is_set():
                try:
                    self._cycle(poller, sub, monitor)
                except Exception as exc:
                    self._put(Failed(repr(exc)[:200]))
                    self._stopping.wait(self._settings.reconnect_ivl_s)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            sub.close(linger=0)
            monitor.close(linger=0)

    def _cycle(self, poller: zmq.Poller, sub: zmq.Socket, monitor: zmq.Socket) -> None:
        if len(self._items) >= self._settings.rcvhwm:
            self._room.clear()
            self._room.wait(POLL_MS / 1000)  # the loop is behind: let ZMQ's queue hold
            return
        ready = dict(poller.poll(POLL_MS))
        if monitor in ready:
            self._monitor_events(monitor)
        if sub in ready:
            self._messages(sub)

    def _monitor_events(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._put(Connected())
            elif event == zmq.EVENT_DISCONNECTED:
                self._put(Disconnected())
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._put(Retried())

    def _messages(self, sub: zmq.Socket) -> None:
        """What is queued now, up to the room left for the loop."""
        while len(self._items) < self._settings.rcvhwm:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._put(self._decode(frames))

    def _decode(self, frames: list[bytes]) -> Message:
        seq = decode_seq(frames[1]) if len(frames) == 3 else None
        if seq is None:
            return Message(None, b"", None, {}, len(frames))
        payload = frames[2]
        batch = self._decoder.decode(payload, self.pod)
        counts = self._decoder.stats.counts
        counted = {reason: n for reason, n in counts.items() if n}
        for reason in counted:
            counts[reason] = 0
        return Message(seq, payload, batch, counted, 3)
