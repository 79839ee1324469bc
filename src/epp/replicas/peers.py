"""The sending side: one long-lived connection per peer address, fed without waiting.

`PeerSet` turns `replicas.peers` into addresses (a name resolving to several addresses,
such as a Kubernetes headless Service, stands for all of them; re-resolved every
`resolve_s`, and a failed lookup keeps the last answer) and runs one `PeerLink` (link.py) per
address. Routing hands it encoded frames (`broadcast`, `send_to`) and never waits:

- each link has a bounded queue; when it is full (a slow peer, or one that is down) the
  oldest frame is dropped and counted (`epp_replica_decisions_dropped_total`);
- a link connects, exchanges `Hello` frames, then writes whatever is queued; after any
  failure it reconnects after a delay that doubles from 50 ms up to `backoff_max_s`;
- a peer that answers with this replica's own id is this replica (it is listed among its
  own peers): that link parks for good. A second address of a replica already connected
  (one replica listed twice) waits instead of sending every decision twice;
- the last `history` decision frames are kept, and a replica seen for the first time
  (a new or restarted one: replica ids are random per process) gets them before the
  live queue, so it does not start with an empty prefix index. A connection that fails
  within `link.HISTORY_SETTLE_S` of sending them may not have delivered them: the next
  connection to that replica sends them again;
- a listener that announces an idle timeout in its Hello gets a `Ping` whenever the link
  has written nothing for a third of it (protocol.py);
- a connection to a free port on this host can be connected to itself (TCP's
  simultaneous open, when the kernel picks that port as the source port): it is a
  failed attempt, not a peer answering with this replica's id;
- with a shared secret (`replicas.secret_file`, auth.py) the link sends a fresh nonce in
  its Hello and checks the peer's proof before anything else, `self` included (an
  impostor answering with this replica's id must not park the link); then it sends its
  own proof. A peer without a proof, with one that does not hold, or (without a secret
  here) one that asks for a proof, is never sent a decision: the link is
  "unauthenticated", logs it (once per `LOG_EVERY_S`) and retries after `backoff_max_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import msgspec
import structlog

from epp.addresses import parse_host_port
from epp.observability.replica_metrics import ReplicaMetrics
from epp.replicas.auth import PeerAuth, new_nonce
from epp.replicas.link import LOG_EVERY_S, Address, LinkState, PeerLink
from epp.replicas.protocol import PROTOCOL_VERSION, Auth, Hello, encode

log = structlog.get_logger("epp.replicas")

Resolver = Callable[[str, int], Awaitable[list[Address]]]

MAX_GREETED = 10_000
# Memory bound beside the frame count (replicas.history): a frame is about 1 KB for a
# 2,000-token prompt but up to 74 KB at 8,192 blocks.
MAX_HISTORY_BYTES = 32 * 1024 * 1024


async def resolve(host: str, port: int) -> list[Address]:
    """Every address `host` resolves to, with `port`."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({(str(info[4][0]), int(info[4][1])) for info in infos})


class PeerSet:
    """Every peer address of `replicas.peers`, one PeerLink each."""

    def __init__(
        self,
        peers: Iterable[str],
        hello: Hello,
        metrics: ReplicaMetrics,
        *,
        resolve_s: float = 5.0,
        queue_size: int = 4096,
        history: int = 4096,
        backoff_max_s: float = 2.0,
        resolver: Resolver = resolve,
        auth: PeerAuth | None = None,
    ) -> None:
        self.specs = [(a.host, a.port) for a in map(parse_host_port, peers)]
        self.hello = hello
        self.hello_frame = encode(hello)
        self.auth = auth  # None: no secret, peers are not authenticated
        self.metrics = metrics
        self.resolve_s = resolve_s
        self.queue_size = queue_size
        self.backoff_max_s = backoff_max_s
        self._resolver = resolver
        self.links: dict[Address, PeerLink] = {}
        self._last: dict[Address, list[Address]] = {}  # spec -> last good answer
        self._history: deque[bytes] = deque()
        self._history_size = history
        self._history_bytes = 0
        self._greeted: set[str] = set()  # replica ids that got the history
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    # -- routing side (synchronous, never waits) -----------------------------------------
    def broadcast(self, frame: bytes) -> None:
        """A decision frame to every peer (and to the history)."""
        if self._history_size:
            kept = self._history
            kept.append(frame)
            self._history_bytes += len(frame)
            while len(kept) > self._history_size or self._history_bytes > MAX_HISTORY_BYTES:
                self._history_bytes -= len(kept.popleft())
        for link in self.links.values():
            link.push(frame)

    def send_to(self, replica_id: str, frame: bytes) -> bool:
        """A frame for one replica (a completion of its decision); False if no link
        has ever reached a replica of that id."""
        for link in self.links.values():
            if link.peer_id == replica_id and link.state != "self":
                link.push(frame, decision=False)
                return True
        return False

    # -- links' callbacks ----------------------------------------------------------------
    def greeting(self) -> tuple[Hello, bytes]:
        """This replica's Hello for a new connection: with a secret, a fresh nonce each."""
        if self.auth is None:
            return self.hello, self.hello_frame
        hello = msgspec.structs.replace(self.hello, nonce=new_nonce())
        return hello, encode(hello)

    def admit(self, link: PeerLink, hello: Hello, sent: Hello) -> tuple[LinkState, bytes | None]:
        """What a link does with the peer's Hello (send to it, or not), and the frame to
        write first (this replica's proof, when authenticating). `sent`: the Hello the
        link sent on this connection (greeting())."""
        if hello.version != PROTOCOL_VERSION or hello.block_size != self.hello.block_size:
            log.error(
                "replica_peer_incompatible",
                peer=f"{link.address[0]}:{link.address[1]}",
                version=hello.version,
                block_size=hello.block_size,
                ours=[PROTOCOL_VERSION, self.hello.block_size],
            )
            return "incompatible", None
        refused, answer = self._authenticate(link, hello, sent)
        if refused is not None:
            return refused, answer
        if hello.replica == self.hello.replica:
            return "self", None
        for other in self.links.values():
            if other is not link and other.connected and other.peer_id == hello.replica:
                return "duplicate", answer
        return "connected", answer

    def _authenticate(
        self, link: PeerLink, hello: Hello, sent: Hello
    ) -> tuple[LinkState | None, bytes | None]:
        """The shared-secret check of `admit`: a verdict when it settles the link (self,
        or unauthenticated), else None; and this replica's proof to send, if any."""
        if self.auth is None:
            if hello.nonce is None:
                return None, None
            self._refused(
                link,
                "the peer requires a shared secret (its replicas.secret_file is set) "
                "and this replica has none",
            )
            return "unauthenticated", None
        if hello.nonce is None or sent.nonce is None:
            self._refused(
                link,
                "the peer does not authenticate: it has no replicas.secret_file, or runs "
                "a version without it",
            )
            return "unauthenticated", None
        proof, proved = self.auth.dialler_proof(sent, hello)
        if proved and hello.replica == self.hello.replica:
            return "self", None  # this replica's listener, which closed after its hello
        # Sent even when the peer's proof fails, so that its listener sees the mismatch
        # too and counts it (bound to both fresh nonces, the proof proves nothing on any
        # other connection).
        answer = encode(Auth(proof))
        if not proved:
            self._refused(link, "the peer's proof does not hold: its replicas.secret_file differs")
            return "unauthenticated", answer
        return None, answer

    def _refused(self, link: PeerLink, detail: str) -> None:
        """Log an unauthenticated peer, at most once per LOG_EVERY_S per address."""
        now = asyncio.get_running_loop().time()
        if now - link.refusal_logged_at >= LOG_EVERY_S:
            link.refusal_logged_at = now
            log.error(
                "replica_peer_unauthenticated",
                peer=f"{link.address[0]}:{link.address[1]}",
                detail=detail,
            )

    def history_for(self, replica_id: str) -> list[bytes]:
        """The history frames for a replica seen for the first time, else none."""
        if replica_id in self._greeted:
            return []
        if len(self._greeted) >= MAX_GREETED:
            self._greeted.clear()
        self._greeted.add(replica_id)
        return list(self._history)

    def history_unsettled(self, replica_id: str) -> None:
        """The connection that sent the replica its history failed soon after: it may
        not have got it, so the next connection sends it again."""
        self._greeted.discard(replica_id)

    def peer_appeared(self, replica_id: str) -> None:
        """A replica connected to this one's listener (PeerServer): if it is new (just
        started), the links waiting to reconnect try now, so it gets the history within
        milliseconds of starting rather than after a reconnect delay."""
        if replica_id in self._greeted:
            return
        for link in self.links.values():
            if link.current == "connecting":
                link.kick()

    def changed(self) -> None:
        self.metrics.connected.set(sum(1 for link in self.links.values() if link.connected))
        self.metrics.peers.set(sum(1 for link in self.links.values() if link.state != "self"))

    # -- membership ----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._resolve_loop(), name="replica-peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for link in list(self.links.values()):
            await link.stop()
        for task in list(self._stopping):
            await task
        self.links.clear()
        self.changed()

    async def _resolve_loop(self) -> None:
        while True:
            try:
                self.update(await self.resolve_all())
            except Exception:  # a bug must cost one round, never the membership for good
                log.exception("replica_peers_update_failed")
            await asyncio.sleep(self.resolve_s)

    async def resolve_all(self) -> set[Address]:
        targets: set[Address] = set()
        for spec in self.specs:
            try:
                found = await self._resolver(*spec)
            except (OSError, UnicodeError) as exc:
                found = self._last.get(spec, [])
                log.warning("replica_peer_unresolved", peer=f"{spec[0]}:{spec[1]}", error=str(exc))
            else:
                self._last[spec] = found
            targets.update(found)
        return targets

    def update(self, targets: set[Address]) -> None:
        """Start links to new addresses, stop links to addresses gone."""
        for address in targets - self.links.keys():
            link = self.links[address] = PeerLink(address, self)
            link.start()
        for address in self.links.keys() - targets:
            task = asyncio.create_task(self.links.pop(address).stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        self.changed()
