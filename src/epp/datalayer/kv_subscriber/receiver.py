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

One thread (`ReceiverHub`), not one per pod: a zmq Poller over every pod's SUB and
monitor sockets, so that 1,000 followed pods cost one thread. Its invariants:

- Once a receiver's sockets are handed over, only the hub thread touches them (ZMQ
  sockets are not thread-safe; the handover goes through a lock, the memory barrier ZMQ
  asks for when a socket changes threads); it closes them before `stop` returns.
- Per-pod isolation: whatever one pod sends (garbage, truncated frames) or whatever
  fails handling its sockets reaches that pod's items only; a pod reads at most
  `TURN_MESSAGES` per poll, so a storming pod delays the others by one turn at most.
- Per-pod bound: at most `rcvhwm` items wait for the loop per pod; then the hub stops
  polling that pod's SUB socket, ZMQ's own queue (`rcvhwm` more) fills and drops, which
  the subscriber sees as a gap, as it would without the thread.
- The live sockets live in the hub's own ZMQ context, whose socket limit is raised
  (libzmq's default, 1,023 sockets, is ~340 pods at three sockets each); replay sockets
  stay on the subscriber's context.
- One hub per subscriber context (PreciseMode shares one context among its pods), alive
  while it has receivers: the last `stop` ends its thread and its context.
- The decoder's counters are each receiver's own (`KvEventStats` is not thread-safe):
  each item carries what its decoding counted, for the loop to add.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import cast

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.datalayer.kv_subscriber.sockets import open_sub_socket
from epp.datalayer.kv_subscriber.state import SubscriberSettings
from epp.prefix.kv_events import EventBatch, KvEventDecoder, KvEventStats, decode_seq

log = structlog.get_logger("epp.kv_subscriber")

POLL_MS = 500  # the longest the hub sleeps with nothing to do (it is woken for changes)
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
        context: zmq.asyncio.Context,
        endpoint: str,
        topic: bytes,
        settings: SubscriberSettings,
    ) -> None:
        self.pod = pod
        self.settings = settings
        self._hub_key = context.underlying  # the hub shared by this context's pods
        self._endpoint = endpoint
        self._topic = topic
        self._decoder = KvEventDecoder(settings.limits, KvEventStats())
        self._items: deque[Item] = deque()
        self._lock = threading.Lock()
        self._notified = False  # a wake-up is on its way to the loop
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hub: ReceiverHub | None = None
        self._closed: asyncio.Future[None] | None = None
        # The hub thread's own: whether it polls the SUB socket now.
        self.full = False  # rcvhwm items wait for the loop
        self.resting_until = 0.0  # after a failure (time.monotonic)

    def start(self) -> None:
        """Open the sockets here, so that a bad endpoint raises to the caller, then hand
        them to the hub; from then on only its thread touches them."""
        loop = self._loop = asyncio.get_running_loop()
        hub = ReceiverHub.join(self._hub_key)
        try:
            # The hub's context is a sync one: so are the sockets it makes.
            sockets = open_sub_socket(hub.context, self._endpoint, self._topic, self.settings)  # type: ignore[arg-type]  # fmt: skip
            sub, monitor = cast(tuple[zmq.Socket[bytes], zmq.Socket[bytes]], sockets)
        except BaseException:
            hub.leave()
            raise
        self._hub, self._closed = hub, loop.create_future()
        hub.add(self, sub, monitor)

    async def stop(self) -> None:
        """Leave the hub; this pod's sockets are closed when this returns."""
        hub, self._hub = self._hub, None
        if hub is None or self._closed is None:
            return
        hub.remove(self)
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
        if was_full and self._hub is not None:
            self._hub.wake()  # room again: the hub polls this pod's socket again
        return items

    # -- called by the hub thread ----------------------------------------------------------

    def closed(self) -> None:
        """The hub closed this pod's sockets."""
        if self._loop is not None and self._closed is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(_resolve, self._closed)

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


@dataclass(slots=True, eq=False)
class _Member:
    receiver: LiveReceiver
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    polled: bool = False  # the SUB socket is registered with the poller


class ReceiverHub:
    """The thread that reads every live socket of one subscriber context's pods."""

    # Subscriber context -> its hub, while it has pods. Process-wide on purpose: a
    # subscriber is given only a context (PreciseMode shares one among its pods), so
    # the context is what says which pods share a thread; an entry goes with its last pod.
    _hubs: dict[int, ReceiverHub] = {}
    _hubs_lock = threading.Lock()  # guards _hubs and every hub's commands and users

    def __init__(self, key: int) -> None:
        self._key = key
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, self.context.get(zmq.SOCKET_LIMIT))
        self._users = 0  # receivers joined and not gone
        self._commands: deque[tuple[str, LiveReceiver, tuple[zmq.Socket[bytes], ...]]] = deque()
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="kv-live-receiver", daemon=True)
        self._thread.start()

    # -- the loop's side (any thread) ---------------------------------------------------

    @classmethod
    def join(cls, key: int) -> ReceiverHub:
        """The hub of subscriber context `key`, started if it has no thread; `add` or
        `leave` must follow."""
        with cls._hubs_lock:
            hub = cls._hubs.get(key)
            if hub is None:
                hub = cls._hubs[key] = ReceiverHub(key)
            hub._users += 1
            return hub

    def leave(self) -> None:
        """A receiver that joined gives up before handing sockets over."""
        self._command("leave", None, ())

    def add(self, receiver: LiveReceiver, sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:  # fmt: skip
        self._command("add", receiver, (sub, monitor))

    def remove(self, receiver: LiveReceiver) -> None:
        self._command("remove", receiver, ())

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending) or closed
            self._wake_out.send(b"\0")

    def _command(self, kind: str, receiver: LiveReceiver | None, sockets: tuple) -> None:
        with self._hubs_lock:
            self._commands.append((kind, receiver, sockets))  # type: ignore[arg-type]
        self.wake()

    # -- the hub thread: it alone touches the sockets, the poller and these maps ---------

    def _run(self) -> None:
        self._members: dict[LiveReceiver, _Member] = {}
        self._sockets: dict[zmq.Socket[bytes], tuple[_Member, bool]] = {}  # -> is monitor
        self._parked: set[_Member] = set()  # SUB socket not polled: full, or resting
        self._poller = zmq.Poller()
        self._poller.register(self._wake_in, zmq.POLLIN)
        try:
            while self._apply_commands():
                self._resume()
                self._turn()
        except Exception as exc:  # a bug in the hub itself: said, and every pod told
            log.error("kv_events_receiver_failed", error=repr(exc)[:200])
            for member in self._members.values():
                member.receiver.put(Failed(f"receiver thread: {exc!r}"[:200]))
        finally:
            self._shut()

    def _apply_commands(self) -> bool:
        """Carry out adds and removes; False when the hub has no receiver left (and is
        gone from `_hubs`: a later `join` makes a new one)."""
        with self._hubs_lock:
            commands = list(self._commands)
            self._commands.clear()
            self._users -= sum(1 for kind, _, _ in commands if kind != "add")
            done = self._users == 0
            if done:
                del ReceiverHub._hubs[self._key]
        for kind, receiver, sockets in commands:
            if kind == "add":
                self._add(receiver, *sockets)
            elif kind == "remove" and receiver in self._members:
                self._close(self._members.pop(receiver))
        return not done

    def _add(self, receiver: LiveReceiver, sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:  # fmt: skip
        member = self._members[receiver] = _Member(receiver, sub, monitor)
        self._sockets[sub] = (member, False)
        self._sockets[monitor] = (member, True)
        self._poller.register(monitor, zmq.POLLIN)
        self._poll_sub(member, True)

    def _resume(self) -> None:
        """Poll again the SUB sockets of pods that have room again and rested enough."""
        now = time.monotonic()
        for member in list(self._parked):
            receiver = member.receiver
            if now >= receiver.resting_until and receiver.has_room():
                with receiver._lock:
                    receiver.full = False
                self._poll_sub(member, True)

    def _turn(self) -> None:
        for ready, _ in self._poller.poll(self._timeout_ms()):
            found = self._sockets.get(ready)
            if found is None:  # the wake-up socket (the poller gives its fd)
                with contextlib.suppress(OSError):
                    self._wake_in.recv(4096)
                continue
            member, is_monitor = found
            try:
                if is_monitor:
                    member.receiver.monitor_events(member.monitor)
                elif member.polled:
                    member.receiver.messages(member.sub)
                    if member.receiver.full:
                        self._poll_sub(member, False)
            except Exception as exc:  # this pod's alone: the others go on
                self._rest(member, exc)

    def _timeout_ms(self) -> int:
        """Until the first resting pod may be polled again (POLL_MS at most): a pod
        waiting for room is woken by the loop instead."""
        resting = [m.receiver.resting_until for m in self._parked]
        until = (min(resting) - time.monotonic()) if resting else POLL_MS / 1000
        return max(1, min(POLL_MS, int(until * 1000) + 1))

    def _rest(self, member: _Member, exc: Exception) -> None:
        """A failure handling one pod's sockets: reported to it, its SUB socket rests."""
        receiver = member.receiver
        receiver.put(Failed(repr(exc)[:200]))
        receiver.resting_until = time.monotonic() + receiver.settings.reconnect_ivl_s
        self._poll_sub(member, False)

    def _poll_sub(self, member: _Member, polled: bool) -> None:
        if polled and not member.polled:
            self._poller.register(member.sub, zmq.POLLIN)
            self._parked.discard(member)
        elif not polled and member.polled:
            self._poller.unregister(member.sub)
            self._parked.add(member)
        member.polled = polled

    def _close(self, member: _Member) -> None:
        self._poll_sub(member, False)
        self._parked.discard(member)
        self._poller.unregister(member.monitor)
        del self._sockets[member.sub], self._sockets[member.monitor]
        with contextlib.suppress(zmq.ZMQError):
            member.sub.disable_monitor()
        member.sub.close(linger=0)
        member.monitor.close(linger=0)
        member.receiver.closed()

    def _shut(self) -> None:
        """The thread's end: every socket closed (and its waiter told), then the context."""
        with self._hubs_lock:
            if ReceiverHub._hubs.get(self._key) is self:
                del ReceiverHub._hubs[self._key]  # ended by a failure: a new join starts over
            pending = list(self._commands)
            self._commands.clear()
        for member in self._members.values():
            member.sub.close(linger=0)
            member.monitor.close(linger=0)
            member.receiver.closed()
        for _, receiver, sockets in pending:
            for sock in sockets:
                sock.close(linger=0)
            if receiver is not None:
                receiver.closed()
        self._wake_in.close()
        self._wake_out.close()
        self.context.term()
