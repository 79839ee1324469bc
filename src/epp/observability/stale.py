"""`epp_stale_cache_routing_total`: decisions whose predicted cache hit the pod did not have.

The EPP predicts, for each decision, how many of the prompt's tokens the chosen pod holds
in its prefix cache (its index's match x block size). Nothing on the request path tells
whether the pod really had them: the observer filter sees response headers, never the
body's `usage.prompt_tokens_details.cached_tokens`, and without KV events (precise mode)
the EPP never learns what a pod evicted. What the EPP does see is the pod's own
`vllm:prefix_cache_hits_total` (prompt tokens served from its cache), on every scrape.

So the check runs per pod, per scrape page, on aggregates:

1. `dispatched`: each decision with a predicted hit of at least one block is queued for
   the pod, in dispatch order, with its predicted tokens. The prediction is capped as the
   engine caps hits: at most `(prompt_tokens - 1) // block_size` blocks (vLLM always
   computes the last prompt token).
2. On every good page, the increase of the pod's hit counter since the previous page
   is handed out to the queued decisions oldest first, each taking at most what it still
   lacks of its prediction. Hits nobody predicted (other routers, an index that forgot
   a prefix) fill older decisions first or are dropped.
3. A decision is checked on the first page fetched after the page on which it was seen
   finished (no longer open on the endpoint: completed, released by the pod's counts or
   expired), so that its prefill is certainly on that page. It is stale when the hits it
   received are less than `required` (half) of its prediction, and counts in
   `epp_stale_cache_routing_total`; every checked decision counts in
   `epp_stale_cache_checked_total`.

What it is not: a per-request truth. Hits the pod gives to requests the EPP did not
predict (other replicas' or other routers' traffic, a request the engine scheduled twice)
can cover a miss, so it undercounts where the EPP is not the pod's only client. A pod whose
counter went backwards (engine restart) or whose first page arrives starts afresh: the
decisions queued then are dropped unchecked. At most `max_pending` decisions wait per
pod; older ones are dropped unchecked. The half threshold keeps a tokenizer that counts a
few percent differently from the engine's (the EPP estimates tokens) from counting as
stale; a prefix that is gone entirely gives the decision no hits at all. Precise mode (KV
events) will replace this estimate with the engine's per-block truth.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from epp.datalayer.endpoint import Endpoint

DEFAULT_REQUIRED = 0.5
DEFAULT_MAX_PENDING = 10_000


@dataclass(slots=True)
class _Pending:
    seq: int  # the endpoint's dispatch number
    predicted: int  # tokens the EPP expected from the pod's cache
    credit: int = 0  # hits the pod's counter gave it so far
    due: bool = False  # seen finished on a page: checked on the next one


@dataclass(slots=True)
class _Ledger:
    hits: float | None = None  # the pod's hit counter on its last page
    pending: deque[_Pending] = field(default_factory=deque)


class StaleCacheTracker:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        required: float = DEFAULT_REQUIRED,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.stale = Counter(
            "epp_stale_cache_routing_total",
            "Routing decisions whose predicted prefix-cache hit the pod did not deliver:"
            " less than half of the predicted tokens showed up in the pod's own"
            " vllm:prefix_cache_hits_total (estimated per scrape; docs/metrics.md).",
            registry=registry,
        )
        self.checked = Counter(
            "epp_stale_cache_checked_total",
            "Routing decisions with a predicted prefix-cache hit that were checked against"
            " the pod's vllm:prefix_cache_hits_total (stale or not).",
            registry=registry,
        )
        self._required = required
        self._max_pending = max_pending
        self._ledgers: dict[Endpoint, _Ledger] = {}
        self.dropped = 0  # decisions dropped unchecked (restart, first page, overflow)

    def dispatched(
        self, endpoint: Endpoint, seq: int, matched_tokens: int, prompt_tokens: int, block_size: int
    ) -> None:
        """A decision sent to `endpoint` (dispatch number `seq`) expecting `matched_tokens`
        of its `prompt_tokens` from the pod's cache."""
        cap = (prompt_tokens - 1) // block_size * block_size if prompt_tokens > 0 else 0
        predicted = min(matched_tokens, cap)
        if predicted < block_size or predicted <= 0:
            return
        ledger = self._ledgers.get(endpoint)
        if ledger is None:
            ledger = self._ledgers[endpoint] = _Ledger()
        if len(ledger.pending) >= self._max_pending:
            ledger.pending.popleft()
            self.dropped += 1
        ledger.pending.append(_Pending(seq, predicted))

    def scraped(self, endpoint: Endpoint) -> None:
        """A good page of `endpoint` was stored (`endpoint.metrics` is the new one)."""
        metrics = endpoint.metrics
        if metrics is None:
            return
        hits = metrics.prefix_hits
        ledger = self._ledgers.get(endpoint)
        if ledger is None:
            self._ledgers[endpoint] = _Ledger(hits=hits)
            return
        if ledger.hits is None or hits < ledger.hits:
            # First page, or the engine restarted (its counters start again from zero):
            # the queued decisions cannot be told apart from the old counts.
            self.dropped += len(ledger.pending)
            ledger.pending.clear()
            ledger.hits = hits
            return
        credit = int(hits - ledger.hits)
        ledger.hits = hits
        pending = ledger.pending
        if not pending:
            return
        if credit > 0:
            for entry in pending:
                need = entry.predicted - entry.credit
                if need > 0:
                    take = need if need < credit else credit
                    entry.credit += take
                    credit -= take
                    if credit <= 0:
                        break
        still_open = endpoint.open
        keep: deque[_Pending] = deque()
        checked = stale = 0
        for entry in pending:
            if entry.due:
                checked += 1
                if entry.credit < entry.predicted * self._required:
                    stale += 1
                continue
            if entry.seq not in still_open:
                entry.due = True
            keep.append(entry)
        ledger.pending = keep
        if checked:
            self.checked.inc(checked)
        if stale:
            self.stale.inc(stale)

    def removed(self, endpoint: Endpoint) -> None:
        ledger = self._ledgers.pop(endpoint, None)
        if ledger is not None:
            self.dropped += len(ledger.pending)

    def pending(self, endpoint: Endpoint) -> int:
        ledger = self._ledgers.get(endpoint)
        return 0 if ledger is None else len(ledger.pending)
