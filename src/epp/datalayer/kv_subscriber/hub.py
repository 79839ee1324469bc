"""The thread that reads the live sockets of every followed pod (`receiver.LiveReceiver`
is one pod's side of it, on the loop).

One thread (`ReceiverHub`), not one per pod: a zmq Poller over every pod's SUB and
monitor sockets, so that 1,000 followed pods cost one thread. Its invariants:

- Once a receiver's sockets are handed over (`add`), only the hub thread touches them
  (ZMQ sockets are not thread-safe; the handover goes through a lock, the memory barrier
  ZMQ asks for when a socket changes threads); it closes them before its thread ends.
- Per-pod isolation: whatever one pod sends (garbage, truncated frames) or whatever
  fails handling its sockets reaches that pod's items only; a pod reads at most
  `receiver.TURN_MESSAGES` per poll, so a storming pod delays the others by one turn at most.
- Per-pod bound: at most `rcvhwm` items wait for the loop per pod; then the hub stops
  polling that pod's SUB socket, ZMQ's own queue (`rcvhwm` more) fills and drops, which
  the subscriber sees as a gap, as it would without the thread.
- The live sockets live in the hub's own ZMQ context, whose socket limit is raised
  (libzmq's default, 1,023 sockets, is ~340 pods at three sockets each); replay sockets
  stay on the subscriber's context.
- One owner: whoever builds the subscribers (`PreciseMode`: one hub for all its pods; a
  subscriber given none makes its own) makes the hub and closes it after its receivers;
  `close` ends the thread, the sockets still handed over and the context. A closed hub
  refuses new sockets (`HubClosed`); so does one whose thread a bug ended (`failed`: its
  pods were told, `Failed`), which its owner then replaces; each of its subscribers opens
  its socket again on the replacement (`KvEventSubscriber._rehome`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import zmq

from epp.datalayer.kv_subscriber.sockets import raise_socket_limit

if TYPE_CHECKING:
    from epp.datalayer.kv_subscriber.receiver import LiveReceiver

log = structlog.get_logger("epp.kv_subscriber")

POLL_MS = 500  # the longest the hub sleeps with nothing to do (it is woken for changes)


@dataclass(slots=True, eq=False)
class _Member:
    receiver: LiveReceiver
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    polled: bool = False  # the SUB socket is registered with the poller


class HubClosed(RuntimeError):
    """Sockets handed to a hub that is closing (or ended by a failure)."""


class ReceiverHub:
    """The thread that reads the live sockets of the pods handed to it. Its owner (the
    one that builds the subscribers: `PreciseMode`, or a subscriber given none) closes
    it; `close` ends the thread, every socket it holds and its context."""

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        raise_socket_limit(self.context)
        self._lock = threading.Lock()  # guards _commands and _stopping
        self._commands: deque[tuple[str, LiveReceiver, tuple[zmq.Socket[bytes], ...]]] = deque()
        self._stopping = False
        self._failed = False  # a bug ended the thread (its owner makes a new hub)
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="kv-live-receiver", daemon=True)
        self._thread.start()

    # -- the owner's and the loop's side (any thread) -------------------------------------

    @property
    def running(self) -> bool:
        """Whether it takes new receivers (not closing, not ended by a failure)."""
        with self._lock:
            return not self._stopping

    @property
    def failed(self) -> bool:
        """Whether a bug ended the thread (not its owner's `stop`): its pods' receivers
        are dead, and each subscriber opens its socket again on the owner's new hub."""
        with self._lock:
            return self._failed

    def add(self, receiver: LiveReceiver, sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:  # fmt: skip
        """Hand over a receiver's sockets (made on `context`): from here only the hub
        thread touches them. A hub that is closing closes them here and raises HubClosed."""
        with self._lock:
            accepted = not self._stopping
            if accepted:
                self._commands.append(("add", receiver, (sub, monitor)))
        if not accepted:
            sub.close(linger=0)
            monitor.close(linger=0)
            raise HubClosed("the KV-event receiver thread is closed")
        self.wake()

    def remove(self, receiver: LiveReceiver) -> None:
        """The receiver's sockets are closed, then `receiver.closed()` is called."""
        with self._lock:
            self._commands.append(("remove", receiver, ()))
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending) or closed
            self._wake_out.send(b"\0")

    def stop(self) -> None:
        """Ask the thread to end (it closes every socket it holds, then the context)."""
        with self._lock:
            self._stopping = True
        self.wake()

    async def close(self) -> None:
        """`stop`, and wait until the thread has ended."""
        self.stop()
        await asyncio.to_thread(self._thread.join)

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
            with self._lock:
                self._failed = True
            for member in self._members.values():
                member.receiver.failed(f"receiver thread: {exc!r}")
        finally:
            self._shut()

    def _apply_commands(self) -> bool:
        """Carry out adds and removes; False once the hub is asked to stop."""
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
            stopping = self._stopping
        for kind, receiver, sockets in commands:
            if kind == "add":
                self._add(receiver, *sockets)
            elif kind == "remove" and receiver in self._members:
                self._close(self._members.pop(receiver))
        return not stopping

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
                receiver.resume()
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
        receiver.failed(repr(exc))
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
        """The thread's end: every socket closed (and its waiter told), then the context;
        from here `add` refuses (also when a failure ended the thread)."""
        with self._lock:
            self._stopping = True
            pending = list(self._commands)
            self._commands.clear()
        for member in self._members.values():
            member.sub.close(linger=0)
            member.monitor.close(linger=0)
            member.receiver.closed()
        for _, receiver, sockets in pending:
            for sock in sockets:
                sock.close(linger=0)
            receiver.closed()
        self._wake_in.close()
        self._wake_out.close()
        self.context.term()
