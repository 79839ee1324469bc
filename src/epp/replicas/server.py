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
`LOG_EVERY_S`, so a peer that keeps reconnecting with garbage cannot flood the log). At most
`max_connections` connections are open at once. A replica that reconnects replaces its
older connection, so one replica's decisions are never applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import msgspec
import structlog

from epp.observability.replica_metrics import ReplicaMetrics
from epp.replicas.auth import PeerAuth, new_nonce
from epp.replicas.inbox import PeerInbox
from epp.replicas.protocol import (
    PROTOCOL_VERSION,
    Auth,
    Completion,
    Decision,
    Hello,
    ProtocolError,
    decode,
    encode,
    read_frame,
)

log = structlog.get_logger("epp.replicas")

HANDSHAKE_TIMEOUT_S = 5.0
HELLO_MAX_BYTES = 4096
MAX_CONNECTIONS = 64
LOG_EVERY_S = 10.0


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
        self._on_peer = on_peer  # called with each peer's replica id after its hello
        self._auth = auth  # None: no secret, peers are not authenticated
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
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
            address=f"{self.host}:{self.port}",
            replica=self.hello.replica,
            authentication="shared_secret" if self._auth is not None else "none",
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
        if len(self._open) >= self._max_connections:
            self._reject(writer, Rejected("limit", f"more than {self._max_connections} peers"))
            writer.close()
            return
        self._open.add(writer)
        replica: str | None = None
        try:
            # The whole handshake, the proof included, within one timeout (asyncio.timeout:
            # wait_for on Python 3.11 can drop a cancellation).
            async with asyncio.timeout(self._handshake_timeout):
                replica = await self._handshake(reader, writer)
            if replica is None:
                return
            inbox = self._inbox
            while True:
                message = decode(await read_frame(reader, self._max_frame))
                if self._by_replica.get(replica) is not writer:
                    return  # replaced by the replica's newer connection
                if isinstance(message, Decision):
                    if message.replica != replica:
                        raise Rejected("bad_frame", "a decision signed by another replica")
                    inbox.decision(message)
                elif isinstance(message, Completion):
                    inbox.completion(message)
                else:
                    raise Rejected("bad_frame", f"a {type(message).__name__} after the handshake")
        except ProtocolError as exc:
            self._reject(writer, Rejected("bad_frame", str(exc)))
        except Rejected as exc:
            self._reject(writer, exc)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the peer went away, or said nothing in time
        except Exception:  # a bug applying a message must cost one connection, no more
            log.exception("replica_connection_failed", peer=_peer(writer))
        finally:
            self._open.discard(writer)
            if replica is not None and self._by_replica.get(replica) is writer:
                del self._by_replica[replica]
            writer.close()

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
