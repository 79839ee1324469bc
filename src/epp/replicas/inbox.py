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

Bounded and fading: a peer's values are checked against what a real request can carry
before anything is applied, and a decision that fails is dropped and counted
(`epp_replica_decisions_invalid_total{reason}`): `prompt_tokens` above
`replicas.max_prompt_tokens`, `uncached` above `prompt_tokens`, `matched` above the hashes
sent, or a time that is not a finite number. What an applied one changes fades: its count
in the pod's load within `replicas.load_ttl_s` (sooner when a page shows it), its share of
the pod's prefill lane ends within `load_ttl_s` of its arrival (`Dispatched.lane_limit`),
and its hashes are evicted from the prefix index like any other. Its uncached tokens add
to the pod's lifetime share of work (`Endpoint.dispatched_tokens`, a tie-break weighted
1e-13 per token), at most `max_prompt_tokens` each.

A `Completion` (a response end that this replica's decision got, seen by a peer's
observer stream) goes to `Router.complete`, as if the local observer had seen it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import structlog

from epp.datalayer.store import EndpointStore
from epp.observability.replica_metrics import ReplicaMetrics
from epp.prefix.hashing import BlockHash
from epp.prefix.index import PrefixIndex
from epp.replicas.protocol import Completion, Decision
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Dispatched, SchedulingRequest

log = structlog.get_logger("epp.replicas")

# An invalid decision is logged at most this often per reason (counted every time).
LOG_EVERY_S = 10.0
INVALID_REASONS = ("prompt_tokens", "uncached", "matched", "at")


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
        max_prompt_tokens: int = 1_048_576,
        load_ttl_s: float = 5.0,
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
        self._max_prompt_tokens = max_prompt_tokens
        self._load_ttl = load_ttl_s
        self._wall = wall_clock
        self._outcomes = {
            name: metrics.received.labels(name)
            for name in ("applied", "late", "unknown_pod", "self", "invalid")
        }
        self._invalid = {reason: metrics.invalid.labels(reason) for reason in INVALID_REASONS}
        self._logged: dict[str, float] = {}

    def decision(self, message: Decision) -> str:
        """Apply one peer decision; returns its outcome (the metric's label)."""
        outcome = self._apply(message)
        self._outcomes[outcome].inc()
        return outcome

    def invalid(self, message: Decision) -> str | None:
        """Why no real request could have made this decision, or None (it could)."""
        if message.prompt_tokens > self._max_prompt_tokens:
            return "prompt_tokens"
        if message.uncached > message.prompt_tokens:
            return "uncached"
        if message.matched > len(message.hashes):
            return "matched"
        if not math.isfinite(message.at):
            return "at"
        return None

    def _apply(self, message: Decision) -> str:
        if message.replica == self.replica_id:
            return "self"  # listed among its own peers (a headless Service lists all)
        reason = self.invalid(message)
        if reason is not None:
            self._invalid[reason].inc()
            self._log_invalid(message, reason)
            return "invalid"
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
        for woken in self._router.hooks.peer_dispatched:
            woken(endpoint.name)
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
        # Its share of the lane ends within load_ttl_s of its arrival, however long the
        # prompt: nothing a peer says keeps a pod looking busy for longer.
        self._scheduler.observe(Dispatched(request, endpoint, lane_limit=now + self._load_ttl))
        return "applied"

    def _log_invalid(self, message: Decision, reason: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning(
                "replica_decision_invalid",
                replica=message.replica,
                reason=reason,
                prompt_tokens=message.prompt_tokens,
                uncached=message.uncached,
                matched=message.matched,
                hashes=len(message.hashes),
                max_prompt_tokens=self._max_prompt_tokens,
            )

    def completion(self, message: Completion) -> None:
        """A response end of one of this replica's decisions, seen by a peer."""
        self._metrics.completions_received.inc()
        if message.token.startswith(self._router.hooks.token_prefix):
            self._router.complete(message.token, message.status, message.served)
