"""Several EPP replicas behind one Envoy, each seeing the others' decisions.

Why: Envoy balances ext_proc streams over the replicas, so the turns of one conversation
(and the requests of one shared prefix) reach different replicas. A replica that knows
only its own decisions finds no prefix for a turn another replica routed, and counts only
its own share of each pod's load between scrapes. This is why the field runs one replica.

How: after every dispatch, a replica sends its peers one small `Decision` (its id, the pod,
the block hashes it recorded in its prefix index, the prompt's size and match, the uncached
tokens it reserved, the time) over a long-lived TCP connection per peer (protocol.py,
peers.py). A receiving replica records the hashes for that pod in its own index and counts
the dispatch in the pod's load until a page scraped after it shows it (inbox.py,
`EndpointStore.peer_dispatched`). Its `prefill` scorer's lane for the pod grows by the
request's prefill too.

Response ends: Envoy's access-log stream is pinned to one replica per Envoy worker (and the
observer filter's streams are balanced apart from the routing streams), so the end of a
request is often seen by another replica than the one that routed it.
Route tokens start with the routing replica's id, and a replica that sees the end of a
decision it did not make sends it to that replica (`Completion`); without this, a
replica's in-flight counts and its request-time estimates would miss about half the ends.

Routing never waits on a peer: frames are encoded on the routing path and queued; a slow
or absent peer loses the oldest ones. A peer down only means decisions it made while
down or disconnected are not seen here; the pods' pages still show their load within a
scrape interval.

Authentication: with `replicas.secret_file`, a connection carries decisions only after
both replicas proved they hold the same secret (auth.py; the chart creates one whenever
it runs several replicas; without one anything that reaches `listen_port` is taken for a
peer). Either way what a peer sends is bounded to what a real request carries and fades
(inbox.py), and connections that say nothing cannot keep peers out (server.py).

Not a consensus: each replica decides alone, on what it knows at that moment. Two
replicas choosing within the same millisecond do not see each other's choice; the next
decision does.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import structlog

from epp.config import EppConfig
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.observability.replica_metrics import ReplicaMetrics
from epp.prefix.index import PrefixIndex
from epp.replicas.auth import PeerAuth, SecretError, SharedSecret
from epp.replicas.inbox import PeerInbox
from epp.replicas.peers import PeerSet, Resolver, resolve
from epp.replicas.protocol import (
    PROTOCOL_VERSION,
    Completion,
    Decision,
    Hello,
    encode,
    frame_limit,
)
from epp.replicas.server import PeerServer
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Dispatched

log = structlog.get_logger("epp.replicas")


def new_replica_id() -> str:
    """Random per process: a restarted replica is a new one to its peers."""
    return secrets.token_hex(6)


class ReplicaSync:
    """Decision sharing for one replica: the peer links, the listener, and the hooks on
    the Router. Built by the app when `replicas.peers` is set; `start`/`stop` with it."""

    def __init__(
        self,
        config: EppConfig,
        store: EndpointStore,
        index: PrefixIndex,
        scheduler: Scheduler,
        router: Router,
        metrics: EppMetrics,
        *,
        replica_id: str | None = None,
        resolver: Resolver = resolve,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        replicas = config.replicas
        # Read first: a secret file that cannot be used stops the process (SecretError).
        self.auth = (
            PeerAuth(SharedSecret(replicas.secret_file))
            if replicas.secret_file is not None
            else None
        )
        self.replica_id = replica_id or new_replica_id()
        self.metrics = ReplicaMetrics(metrics.registry)
        self._wall = wall_clock
        hello = Hello(
            self.replica_id,
            PROTOCOL_VERSION,
            config.prefix.block_size,
            idle_timeout_s=replicas.idle_timeout_s,
        )
        self.inbox = PeerInbox(
            self.replica_id,
            store,
            index,
            scheduler,
            router,
            self.metrics,
            block_size=config.prefix.block_size,
            max_blocks=config.prefix.max_blocks_per_request,
            max_age_s=replicas.max_age_s,
            max_prompt_tokens=replicas.max_prompt_tokens,
            load_ttl_s=replicas.load_ttl_s,
            wall_clock=wall_clock,
        )
        self.peers = PeerSet(
            replicas.peers,
            hello,
            self.metrics,
            resolve_s=replicas.resolve_s,
            queue_size=replicas.queue_size,
            history=replicas.history,
            backoff_max_s=replicas.backoff_max_s,
            resolver=resolver,
            auth=self.auth,
        )
        self.server = PeerServer(
            replicas.listen_host,
            replicas.listen_port,
            hello,
            self.inbox,
            self.metrics,
            max_frame_bytes=frame_limit(config.prefix.max_blocks_per_request),
            max_connections=replicas.max_connections,
            handshake_timeout_s=replicas.handshake_timeout_s,
            idle_timeout_s=replicas.idle_timeout_s,
            on_peer=self.peers.peer_appeared,
            auth=self.auth,
        )
        router.hooks.token_prefix = f"{self.replica_id}."
        router.hooks.shared.append(self.on_dispatch)
        router.hooks.foreign_completion = self.on_foreign_completion

    async def start(self) -> None:
        await self.server.start()
        self.peers.start()

    async def stop(self) -> None:
        await self.peers.stop()
        await self.server.stop()

    # -- Router hooks (on the routing path: encode and queue, nothing else) ----------------
    def on_dispatch(self, event: Dispatched, uncached: int) -> None:
        request = event.request
        pod = event.endpoint.name
        message = Decision(
            self.replica_id,
            pod,
            request.block_hashes,  # type: ignore[arg-type]  # a list of ints
            request.prompt_tokens,
            request.prefix_match.get(pod, 0),
            uncached,
            self._wall(),
        )
        self.peers.broadcast(encode(message))

    def on_foreign_completion(self, token: str, status: int | None, served: str | None) -> None:
        owner, dot, _ = token.partition(".")
        if not dot or owner == self.replica_id:
            return
        message = Completion(token, status, served)
        if self.peers.send_to(owner, encode(message)):
            self.metrics.completions_forwarded.inc()


__all__ = ["ReplicaSync", "SecretError", "new_replica_id"]
