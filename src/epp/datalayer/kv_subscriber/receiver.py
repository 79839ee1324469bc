"""Every followed pod's live SUB socket, read and decoded in one shared thread.

Receiving and decoding live batches on the routing loop costs it about as much as
applying them (pyzmq's asyncio sockets wake the loop once per message, and msgpack
decoding is not sliced): docs/benchmarks/loop.md. What changes the index or a
subscriber's sequence bookkeeping stays on the loop. Here, per pod (`LiveReceiver`),
in arrival order:

- `Connected`, `Disconnected`, `Retried`: the socket monitor's events;
- `Message`: a live message, its payload decoded (`batch`; None: refused, counted in
  `counts`), or its frames malformed (`seq` None);
- `Failed`: an unexpected error handling that pod's sockets; its sockets rest for
  `reconnect_ivl_s`, the other pods' do not.

One thread reads every pod's sockets (`hub.ReceiverHub`: its invariants there); the
decoder's counters are each receiver's own (`KvEventStats` is not thread-safe): each
item carries what its decoding counted, for the loop to add.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from epp.datalayer.kv_subscriber.hub import HubClosed, ReceiverHub
from epp.datalayer.kv_subscriber.sockets import open_sub_socket
from epp.datalayer.kv_subscriber.state import SubscriberSettings
from epp.prefix.kv_events import EventBatch, KvEventDecoder, KvEventStats, decode_seq

TURN_MESSAGES = 64  # live messages read from one pod per poll (fairness between pods)


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
    """One pod's live socket as the loop sees it: `start()` on the consuming loop,
    `await items(timeout)` there, `await stop()`. The reading is the hub's."""

    def __init__(
        self,
        pod: str,
        hub: ReceiverHub,
        endpoint: str,
        topic: bytes,
        settings: SubscriberSettings,
    ) -> None:
        self.pod = pod
        self.settings = settings
        self._hub = hub  # the thread that reads this pod's sockets (owned by the caller)
        self._endpoint = endpoint
        self._topic = topic
        self._decoder = KvEventDecoder(settings.limits, KvEventStats())
        self._items: deque[Item] = deque()
        self._lock = threading.Lock()
        self._notified = False  # a wake-up is on its way to the loop
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handed = False  # the hub holds the sockets
        self._closed: asyncio.Future[None] | None = None
        # The hub thread's own: whether it polls the SUB socket now.
        self.full = False  # rcvhwm items wait for the loop
        self.resting_until = 0.0  # after a failure (time.monotonic)

    @property
    def hub_failed(self) -> bool:
        """A bug ended the thread reading this pod's sockets: this receiver is dead."""
        return self._hub.failed

    def start(self) -> None:
        """Open the sockets here, so that a bad endpoint raises to the caller, then hand
        them to the hub; from then on only its thread touches them."""
        loop = self._loop = asyncio.get_running_loop()
        if not self._hub.running:
            raise HubClosed("the KV-event receiver thread is closed")
        # The hub's context is a sync one: so are the sockets it makes.
        sockets = open_sub_socket(self._hub.context, self._endpoint, self._topic, self.settings)  # type: ignore[arg-type]  # fmt: skip
        sub, monitor = cast(tuple[zmq.Socket[bytes], zmq.Socket[bytes]], sockets)
        self._closed = loop.create_future()
        self._hub.add(self, sub, monitor)  # HubClosed: the sockets are closed
        self._handed = True

    async def stop(self) -> None:
        """Leave the hub; this pod's sockets are closed when this returns."""
        handed, self._handed = self._handed, False
        if not handed or self._closed is None:
            return
        self._hub.remove(self)
        await asyncio.shield(self._closed)

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
            was_full = self.full
        if was_full and self._handed:
            self._hub.wake()  # room again: the hub polls this pod's socket again
        return items

    # -- called by the hub thread ----------------------------------------------------------

    def closed(self) -> None:
        """The hub closed this pod's sockets."""
        if self._loop is not None and self._closed is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(_resolve, self._closed)

    def failed(self, error: str) -> None:
        """An error handling this pod's sockets (in the hub thread): the loop is told."""
        self.put(Failed(error[:200]))

    def resume(self) -> None:
        """The hub polls this pod's socket again (it has room)."""
        with self._lock:
            self.full = False

    def has_room(self) -> bool:
        return len(self._items) < self.settings.rcvhwm

    def put(self, item: Item) -> None:
        with self._lock:
            self._items.append(item)
            notify, self._notified = not self._notified, True
        if notify and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the service is gone
                self._loop.call_soon_threadsafe(self._ready.set)

    def monitor_events(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.put(Connected())
            elif event == zmq.EVENT_DISCONNECTED:
                self.put(Disconnected())
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.put(Retried())

    def messages(self, sub: zmq.Socket[bytes]) -> None:
        """What is queued now, up to `TURN_MESSAGES` and the room left for the loop."""
        for _ in range(TURN_MESSAGES):
            if not self.has_room():
                with self._lock:
                    self.full = True
                return
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.put(self._decode(frames))

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


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
