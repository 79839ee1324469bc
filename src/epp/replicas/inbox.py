"""What a peer replica's messages change here: no networking, only local state.

A `Decision` (a peer routed a request to a pod):

- the prefix index records the prompt's block hashes for that pod, as if this replica had
  routed it, so the next request sharing the prefix finds it whichever replica routes it;
- when it is fresh (at most `replicas.max_age_s` old by the sender's clock), the pod's
  load includes it until a page fetched after its arrival shows it
  (`EndpointStore.peer_dispatched`), and the scorers that keep per-pod state hear of it
  as a dispatch (the `prefill` scorer's lane grows by its prefill, priced with the match
  the peer saw);
- a late one (a backlog flushed after a reconnect, the history a new replica gets) feeds
  the index only: the pod's page has shown its load by then;
- a pod this replica does not know (discovery not there yet, or a pod already removed)
  is skipped: the index must not hold pods nothing will ever remove.

A `Completion` (a response end that this replica's decision got, seen by a peer's
observer stream) goes to `Router.complete`, as if the local observer had seen it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from epp.datalayer.store import EndpointStore
from epp.observability.replica_metrics import ReplicaMetrics
from epp.prefix.hashing import BlockHash
from epp.prefix.index import PrefixIndex
from epp.replicas.protocol import Completion, Decision
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Dispatched, SchedulingRequest


class PeerInbox:
    def __init__(
        self,
        replica_id: str,
        store: EndpointStore,
        index: PrefixIndex,
        scheduler: Scheduler,
        router: Router,
        metrics: ReplicaMetrics,
        *,
        block_size: int,
        max_blocks: int,
        max_age_s: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica_id = replica_id
        self._store = store
        self._index = index
        self._scheduler = scheduler
        self._router = router
        self._metrics = metrics
        self._block_size = block_size
        self._max_blocks = max_blocks
        self._max_age = max_age_s
        self._wall = wall_clock
        self._outcomes = {
            name: metrics.received.labels(name)
            for name in ("applied", "late", "unknown_pod", "self")
        }

    def decision(self, message: Decision) -> str:
        """Apply one peer decision; returns its outcome (the metric's label)."""
        outcome = self._apply(message)
        self._outcomes[outcome].inc()
        return outcome

    def _apply(self, message: Decision) -> str:
        if message.replica == self.replica_id:
            return "self"  # listed among its own peers (a headless Service lists all)
        endpoint = self._store.get(message.pod)
        if endpoint is None:
            return "unknown_pod"
        hashes: list[BlockHash] = message.hashes[: self._max_blocks]  # type: ignore[assignment]
        if hashes:
            self._index.record(endpoint.name, hashes)
        age = self._wall() - message.at
        if age > self._max_age:
            return "late"
        self._store.peer_dispatched(endpoint, message.uncached)
        matched = min(message.matched, len(hashes))
        now = self._store.now()
        request = SchedulingRequest(
            request_id="",
            block_hashes=hashes,
            prefix_match={endpoint.name: matched} if matched else {},
            prompt_tokens=message.prompt_tokens,
            block_size=self._block_size,
            # When the peer dispatched it (a clock ahead of ours counts as now).
            now=now - max(0.0, age),
        )
        self._scheduler.observe(Dispatched(request, endpoint))
        return "applied"

    def completion(self, message: Completion) -> None:
        """A response end of one of this replica's decisions, seen by a peer."""
        self._metrics.completions_received.inc()
        if message.token.startswith(self._router.token_prefix):
            self._router.complete(message.token, message.status, message.served)
