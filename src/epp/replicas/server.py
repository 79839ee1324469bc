"""The receiving side: peers connect here and send their decisions.

Per connection: the peer's `Hello` first (within a timeout), this replica's `Hello` back,
then `Decision` and `Completion` frames, each handed to the inbox as it arrives.

With a shared secret (`replicas.secret_file`, auth.py) this replica's Hello carries a
fresh nonce and its proofs, and the peer's next frame must be its `Auth` proof, within
the same timeout: a peer that sends no nonce, anything else, or a proof that does not
hold is closed as "unauthenticated" before any of its frames is applied, and before it
can replace a connection of the replica it claims to be. Without a secret, a peer whose
Hello carries a nonce (it has a secret) is closed as "unauthenticated" as well: the two
must not exchange decisions. Nothing is logged about the secret or the proofs.

Hostile or broken input never gets further than its own connection: a frame longer than
the bound, bytes that are not msgpack, a message of the wrong shape, a second hello, or a
decision signed with another replica's id than the hello's closes that connection, counts
in `epp_replica_connections_rejected_total{reason}` and is logged (once per reason per
`LOG_EVERY_S`, so a peer that keeps reconnecting with garbage cannot flood the log). A
replica that reconnects replaces its older connection, so one replica's decisions are
never applied twice.

Connections that say nothing cannot keep peers out:
- a connection that has not completed its handshake (Hello, and with a secret the proof)
  within `handshake_timeout_s` is closed (`reason="handshake_timeout"`), and so is one
  that has sent no frame for `idle_timeout_s` (`reason="idle"`; a peer of this version
  pings within it, protocol.py);
- at most `max_connections` are open. A connection beyond that makes room: the oldest
  connection still in its handshake goes, taken from the source address that holds the
  most connections (an address opening many cannot push out a peer that opens one); with
  no secret, where anything completes a handshake, the connection silent the longest goes
  when none is in its handshake (a peer pings, an idle intruder does not), again from the
  address holding the most. Closed so,
  `reason="evicted"`. Only when every connection is an authenticated peer is the new one
  refused (`reason="limit"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog

from epp.addresses import format_host_port
from epp.observability.replica_metrics import ReplicaMetrics
from epp.replicas.auth import PeerAuth, new_nonce
from epp.replicas.inbox import PeerInbox
from epp.replicas.protocol import (
    PROTOCOL_VERSION,
    Auth,
    Completion,
    Decision,
    Hello,
    Ping,
    ProtocolError,
    decode,
    encode,
    read_frame,
)

log = structlog.get_logger("epp.replicas")

HANDSHAKE_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 30.0
HELLO_MAX_BYTES = 4096
MAX_CONNECTIONS = 64
LOG_EVERY_S = 10.0


@dataclass(slots=True, eq=False)
class _Connection:
    """One open connection as the limit sees it."""

    writer: asyncio.StreamWriter
    source: str  # the remote address (no port)
    opened_at: float
    last_frame_at: float
    established: bool = False  # the handshake (and proof) completed


class Rejected(Exception):
    """The connection is closed for `reason` (a label of the rejected counter)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class PeerServer:
    def __init__(
        self,
        host: str,
        port: int,
        hello: Hello,
        inbox: PeerInbox,
        metrics: ReplicaMetrics,
        *,
        max_frame_bytes: int,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        on_peer: Callable[[str], None] | None = None,
        auth: PeerAuth | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.hello = hello
        self._hello_frame = encode(hello)
        self._inbox = inbox
        self._metrics = metrics
        self._max_frame = max_frame_bytes
        self._max_connections = max_connections
        self._handshake_timeout = handshake_timeout_s
        self._idle_timeout = idle_timeout_s
        self._on_peer = on_peer  # called with each peer's replica id after its hello
        self._auth = auth  # None: no secret, peers are not authenticated
        self._server: asyncio.Server | None = None
        self._open: dict[asyncio.StreamWriter, _Connection] = {}
        self._by_replica: dict[str, asyncio.StreamWriter] = {}
        self._logged: dict[str, float] = {}

    @property
    def connections(self) -> int:
        return len(self._open)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info(
            "replica_listening",
            address=format_host_port(self.host, self.port),
            replica=self.hello.replica,
            authentication="shared_secret" if self._auth is not None else "none",
        )
        if self._auth is None:
            log.warning(
                "replica_peers_unauthenticated",
                address=format_host_port(self.host, self.port),
                detail="whatever reaches this port is taken for a peer: set "
                "replicas.secret_file (the chart does with replicaCount > 1)",
            )

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._open):
            writer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self._max_connections and not self._make_room():
            self._reject(writer, Rejected("limit", f"{self._max_connections} peers connected"))
            writer.close()
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        address = writer.get_extra_info("peername")
        connection = _Connection(writer, str(address[0]) if address else "?", now, now)
        self._open[writer] = connection
        replica: str | None = None
        try:
            # The whole handshake, the proof included, within one timeout (asyncio.timeout:
            # wait_for on Python 3.11 can drop a cancellation).
            try:
                async with asyncio.timeout(self._handshake_timeout):
                    replica = await self._handshake(reader, writer)
            except TimeoutError:
                raise Rejected("handshake_timeout", "no hello (or proof) in time") from None
            if replica is None:
                return
            connection.established = True
            await self._receive(reader, writer, connection, replica)
        except ProtocolError as exc:
            self._reject(writer, Rejected("bad_frame", str(exc)))
        except Rejected as exc:
            self._reject(writer, exc)
        except TimeoutError:
            self._reject(writer, Rejected("idle", f"no frame for {self._idle_timeout} s"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer went away, or this side closed it (evicted, stopping)
        except Exception:  # a bug applying a message must cost one connection, no more
            log.exception("replica_connection_failed", peer=_peer(writer))
        finally:
            self._open.pop(writer, None)
            if replica is not None and self._by_replica.get(replica) is writer:
                del self._by_replica[replica]
            writer.close()

    async def _receive(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        connection: _Connection,
        replica: str,
    ) -> None:
        """Hand an authenticated peer's frames to the inbox until it is replaced by its
        newer connection (returns) or fails (raises: TimeoutError when silent for the
        idle timeout, Rejected or ProtocolError for a frame out of place)."""
        loop = asyncio.get_running_loop()
        connection.last_frame_at = loop.time()
        inbox = self._inbox
        idle = self._idle_timeout
        # One deadline moved on by every frame: a connection silent for `idle` ends.
        async with asyncio.timeout_at(loop.time() + idle) as deadline:
            while True:
                message = decode(await read_frame(reader, self._max_frame))
                connection.last_frame_at = at = loop.time()
                deadline.reschedule(at + idle)
                if self._by_replica.get(replica) is not writer:
                    return  # replaced by the replica's newer connection
                if isinstance(message, Decision):
                    if message.replica != replica:
                        raise Rejected("bad_frame", "a decision signed by another replica")
                    inbox.decision(message)
                elif isinstance(message, Completion):
                    inbox.completion(message)
                elif not isinstance(message, Ping):
                    raise Rejected("bad_frame", f"a {type(message).__name__} after the handshake")

    def _make_room(self) -> bool:
        """Close one connection that may go for a new one (see the module docstring);
        False when none may (every connection is an established, authenticated peer)."""
        per_source = Counter(c.source for c in self._open.values())
        pending = [c for c in self._open.values() if not c.established]
        if pending:
            victim = min(pending, key=lambda c: (-per_source[c.source], c.opened_at))
        elif self._auth is None and self._open:
            victim = min(
                self._open.values(), key=lambda c: (-per_source[c.source], c.last_frame_at)
            )
        else:
            return False
        del self._open[victim.writer]  # its slot is the new one's now
        self._reject(victim.writer, Rejected("evicted", f"{self._max_connections} connections"))
        victim.writer.close()  # its reader sees the end: its task ends as the peer's would
        return True

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> str | None:
        """The peer's replica id, or None when the connection ends here (it is this
        replica itself: it learns so from the hello sent back)."""
        hello = decode(await read_frame(reader, HELLO_MAX_BYTES))
        if not isinstance(hello, Hello):
            raise Rejected("bad_frame", "the first frame is not a hello")
        ours, frame = self._answer(hello)
        writer.write(frame)
        await writer.drain()
        if hello.replica == self.hello.replica:
            return None
        if hello.version != PROTOCOL_VERSION or hello.block_size != self.hello.block_size:
            raise Rejected(
                "incompatible",
                f"version {hello.version} block_size {hello.block_size}, ours "
                f"{PROTOCOL_VERSION} {self.hello.block_size}",
            )
        await self._authenticate(hello, ours, reader)
        previous = self._by_replica.get(hello.replica)
        if previous is not None:
            previous.close()  # a reconnect: the old connection must not deliver twice
        self._by_replica[hello.replica] = writer
        if self._on_peer is not None:
            self._on_peer(hello.replica)
        return hello.replica

    def _answer(self, hello: Hello) -> tuple[Hello, bytes]:
        """This replica's Hello for the peer's: with a secret, a fresh nonce and the
        proofs over both (a new frame per connection); without, the same frame always."""
        if self._auth is None:
            return self.hello, self._hello_frame
        nonce = new_nonce()
        proofs = self._auth.listener_proofs(hello, self.hello.replica, nonce)
        ours = msgspec.structs.replace(self.hello, nonce=nonce, proofs=proofs)
        return ours, encode(ours)

    async def _authenticate(self, hello: Hello, ours: Hello, reader: asyncio.StreamReader) -> None:
        """Returns when the peer may send decisions; raises Rejected("unauthenticated")."""
        auth = self._auth
        if auth is None:
            if hello.nonce is not None:
                raise Rejected(
                    "unauthenticated",
                    "the peer authenticates with a shared secret (replicas.secret_file) "
                    "and this replica has none",
                )
            return
        if hello.nonce is None:
            raise Rejected(
                "unauthenticated",
                "the peer sent no nonce: it has no replicas.secret_file, or runs a version "
                "without it",
            )
        message = decode(await read_frame(reader, HELLO_MAX_BYTES))
        if not isinstance(message, Auth):
            raise Rejected(
                "unauthenticated", f"a {type(message).__name__} where the peer's proof was due"
            )
        if not auth.dialler_proved(hello, ours, message.proof):
            raise Rejected(
                "unauthenticated",
                "the peer's proof does not hold: its replicas.secret_file differs",
            )

    def _reject(self, writer: asyncio.StreamWriter, exc: Rejected) -> None:
        self._metrics.rejected.labels(exc.reason).inc()
        now = time.monotonic()
        if now - self._logged.get(exc.reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[exc.reason] = now
            log.warning(
                "replica_connection_rejected",
                peer=_peer(writer),
                reason=exc.reason,
                detail=str(exc),
            )


def _peer(writer: asyncio.StreamWriter) -> str:
    address = writer.get_extra_info("peername")
    return f"{address[0]}:{address[1]}" if address else "?"
