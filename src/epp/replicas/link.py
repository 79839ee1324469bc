"""`PeerLink`: one peer address, its bounded queue and the task that keeps one connection
to it (the rules: `peers.py`'s docstring). The link asks its `PeerSet` for the greeting,
the verdict on the peer's Hello (`admit`), the history and the queue bound, and tells it
when its state changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from typing import TYPE_CHECKING, Literal

import structlog

from epp.replicas.protocol import Hello, Ping, ProtocolError, decode, encode, read_frame

if TYPE_CHECKING:
    from epp.replicas.peers import PeerSet

log = structlog.get_logger("epp.replicas")

Address = tuple[str, int]
LinkState = Literal[
    "connecting", "connected", "self", "duplicate", "incompatible", "unauthenticated", "stopped"
]

BACKOFF_MIN_S = 0.05
CONNECT_TIMEOUT_S = 2.0
HANDSHAKE_TIMEOUT_S = 5.0
HELLO_MAX_BYTES = 4096
# An unauthenticated peer is logged at most this often per address (as the server does).
LOG_EVERY_S = 10.0
# Unacknowledged data fails a connection after this long (a peer's node gone without a
# FIN or RST); idle connections are probed.
TCP_USER_TIMEOUT_MS = 10_000
# A connection that sent the history and failed sooner than this after may have lost it
# (the peer replaced or closed it before reading): the history goes again next time.
HISTORY_SETTLE_S = 5.0
# A frame is about 1 KB for a 2,000-token prompt but up to 74 KB at 8,192 blocks.
MAX_QUEUE_BYTES = 16 * 1024 * 1024  # per peer, beside replicas.queue_size
PING_FRAME = encode(Ping())
# A link with nothing to send pings this often within the listener's idle timeout.
PINGS_PER_IDLE_TIMEOUT = 3


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)


class PeerLink:
    """One peer address: its queue and the task that keeps a connection to it."""

    def __init__(self, address: Address, owner: PeerSet) -> None:
        self.address = address
        self._owner = owner
        # (is a decision, frame): decisions are what the sent/dropped counters count.
        self.queue: deque[tuple[bool, bytes]] = deque()
        self.queued_bytes = 0
        self.state: LinkState = "connecting"
        self.peer_id: str | None = None  # learned from the peer's Hello
        self.refusal_logged_at = -LOG_EVERY_S  # when "unauthenticated" was last logged
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()  # ends a reconnect delay early
        self._stopped = False

    @property
    def connected(self) -> bool:
        return self.state == "connected"

    @property
    def current(self) -> LinkState:
        """The state as it is now (a property: type checkers do not pin it)."""
        return self.state

    def push(self, frame: bytes, decision: bool = True) -> None:
        """Queue a frame; never waits. A full queue loses its oldest frame."""
        if self.state == "self":
            return
        queue = self.queue
        limit = self._owner.queue_size
        while queue and (len(queue) >= limit or self.queued_bytes + len(frame) > MAX_QUEUE_BYTES):
            dropped, old = queue.popleft()
            self.queued_bytes -= len(old)
            if dropped:
                self._owner.metrics.dropped.inc()
        queue.append((decision, frame))
        self.queued_bytes += len(frame)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"replica-peer-{self.address}")

    async def stop(self) -> None:
        self.state = "stopped"
        self._stopped = True
        task = self._task
        # Cancel until it ends: a cancellation can be lost where an awaited step finishes
        # at the same instant (asyncio on Python 3.11), and stop() must not wait forever.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        if task is not None and task.done() and not task.cancelled():
            task.exception()  # retrieved: a task that ended on its own is not an error here

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        owner = self._owner
        while not self._stopped:
            self.state = "connecting"
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError) as exc:
                if self.connected:
                    log.info("replica_peer_disconnected", peer=self._name, error=repr(exc))
                    backoff = BACKOFF_MIN_S  # it was up: try again soon
            except Exception:  # a bug must cost this connection, never the link for good
                log.exception("replica_peer_link_failed", peer=self._name)
            finally:
                if self.connected:
                    self.state = "connecting"
                    owner.changed()
            state = self.current
            if state == "self":
                log.info("replica_peer_is_self", peer=self._name)
                owner.changed()
                return  # parked: never dialled again
            if state in ("duplicate", "incompatible", "unauthenticated"):
                backoff = owner.backoff_max_s
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):  # not wait_for (see _session)
                    await self._kick.wait()
            backoff = min(backoff * 2, owner.backoff_max_s)

    def kick(self) -> None:
        """Reconnect now if waiting to."""
        self._kick.set()

    async def _session(self) -> None:
        """One connection: handshake, history, then frames until it fails (raises)."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
        # that arrives as the awaited step completes, and a link stopped at that instant
        # would go on dialling while stop() waits for it forever.
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(*self.address)
        loop = asyncio.get_running_loop()
        history_sent_at = -1.0  # when this connection sent the history (never: -1)
        try:
            hello = await self._handshake(reader, writer)
            if hello is None:
                return
            if self._send_history(writer, hello.replica):
                history_sent_at = loop.time()
            # A listener that closes silent connections said so: ping within its timeout.
            ping_s = hello.idle_timeout_s / PINGS_PER_IDLE_TIMEOUT
            await self._pump(reader, writer, ping_s or None)
        finally:
            writer.close()
            sent = history_sent_at >= 0.0
            if sent and self.peer_id and loop.time() - history_sent_at < HISTORY_SETTLE_S:
                self._owner.history_unsettled(self.peer_id)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Hello | None:
        """Exchange Hellos and set `state` from the owner's verdict: the peer's Hello
        when the link is connected, else None (the session ends)."""
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.getsockname() == sock.getpeername():
            raise ConnectionRefusedError("connected to itself: nothing listens there")
        _tune(writer)
        owner = self._owner
        ours, ours_frame = owner.greeting()
        writer.write(ours_frame)
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            hello = decode(await read_frame(reader, HELLO_MAX_BYTES))
        if not isinstance(hello, Hello):
            raise ProtocolError("the peer's first frame is not a hello")
        verdict, answer = owner.admit(self, hello, ours)
        if answer is not None:
            writer.write(answer)  # the proof, before any decision
        self.state = verdict
        if verdict != "connected":
            return None
        self.peer_id = hello.replica
        owner.changed()
        log.info("replica_peer_connected", peer=self._name, replica=hello.replica)
        return hello

    def _send_history(self, writer: asyncio.StreamWriter, replica: str) -> bool:
        """Write the history to a replica seen for the first time; whether any went."""
        history = self._owner.history_for(replica)
        if not history:
            return False
        # The history is the last decisions; the queue older ones or the same.
        self.queue.clear()
        self.queued_bytes = 0
        for frame in history:
            writer.write(frame)
        self._owner.metrics.sent.inc(len(history))
        return True

    @property
    def _name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ping_s: float | None
    ) -> None:
        """Write queued frames until the connection fails. The peer sends nothing after
        its Hello, so anything from it (end of stream included) means it is gone. With
        `ping_s`, a Ping goes when nothing else went for that long."""
        loop = asyncio.get_running_loop()
        gone = asyncio.ensure_future(reader.read(1))
        gone.add_done_callback(lambda _: self._wake())
        sent = self._owner.metrics.sent
        try:
            while True:
                queue = self.queue
                decisions = 0
                while queue:
                    decision, frame = queue.popleft()
                    self.queued_bytes -= len(frame)
                    writer.write(frame)
                    decisions += decision
                if decisions:
                    sent.inc(decisions)
                await writer.drain()  # a slow peer holds this; push() drops meanwhile
                if gone.done():
                    raise ConnectionResetError("the peer closed the connection")
                if not self.queue:
                    waiter = self._waiter = loop.create_future()
                    if ping_s is None:
                        await waiter
                    else:
                        done, _ = await asyncio.wait((waiter,), timeout=ping_s)
                        if not done:
                            writer.write(PING_FRAME)
                    self._waiter = None
        finally:
            self._waiter = None
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gone
