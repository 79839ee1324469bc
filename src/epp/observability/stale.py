"""`epp_stale_cache_routing_total`: decisions whose predicted cache hit the pod did not have.

The EPP predicts, for each decision, how many of the prompt's tokens the chosen pod holds
in its prefix cache (its index's match x block size). Nothing on the request path tells
whether the pod really had them: the access log (or observer filter) reports the response's end, never the
body's `usage.prompt_tokens_details.cached_tokens`, and without KV events (precise mode)
the EPP never learns what a pod evicted. What the EPP does see is the pod's own
`vllm:prefix_cache_hits_total` (prompt tokens served from its cache), on every scrape.

So the check runs per pod, per scrape page, on aggregates:

1. `dispatched`: every decision for the pod is queued, in dispatch order, with its prompt
   tokens and its predicted hit. The prediction is capped as the engine caps hits: at
   most `(prompt_tokens - 1) // block_size` blocks (vLLM always computes the last prompt
   token); under one block, the decision is not checked (it only counts in the ratio).
2. The pod counts tokens with its own tokenizer, the EPP with its own (often the byte
   estimate: 2.1-2.4x fewer tokens than a real vLLM, ~1.3x fewer than the simulator on
   chat prompts). Hits are converted into the EPP's tokens with the pod's ratio: the
   EPP's prompt tokens over the pod's, for the requests the pod finished since its first
   page. The pod's side is `vllm:request_prompt_tokens` (sum and count, observed as a
   request ends). The EPP's side is its decisions in dispatch order, as many as the
   pod's count grew: the EPP may hear of an end after the pod's page shows it, so "the
   decisions seen over" would lag the pod's sum. A decision seen over before a page's
   fetch is in that page's count whatever the order, so it is counted then if the
   order skipped it (a request the engine never counted, e.g. one without a prompt,
   shifts the order by one). Requests of other clients only raise the pod's side: the
   EPP's hits are then its share of the pod's. The conversion is what keeps a hit from
   covering a miss: in the pod's (more numerous) tokens, a decision that hit would leave
   a surplus beyond its prediction, and step 3 would hand it to a later decision the pod
   could not serve at all (tests/observability/test_stale.py,
   tests/e2e/test_prometheus_e2e.py). A page without the histogram (a vLLM that does not
   export it) leaves the ratio at 1.
3. On every good page, the increase of the pod's hit counter since the previous page,
   so converted, is handed out to the queued decisions oldest first, each taking at most
   what it still lacks of its prediction. Hits nobody predicted (other routers, an index
   that forgot a prefix) fill older decisions first or are dropped, never banked.
4. A decision is checked on the first page fetched after the page on which it was seen
   finished (no longer open on the endpoint: completed, released by the pod's counts or
   expired), so that its prefill is certainly on that page. It is stale when the hits it
   received are less than `required` (half) of its prediction, and counts in
   `epp_stale_cache_routing_total`; every checked decision counts in
   `epp_stale_cache_checked_total`.

What it is not: a per-request truth. Hits the pod gives to requests the EPP did not
predict (other replicas' or other routers' traffic, a request the engine scheduled twice)
can cover a miss, so it undercounts where the EPP is not the pod's only client. A
restarted server (its counters went backwards, or the store saw its start time change:
`restarted`) or a pod's first page starts afresh: the decisions queued then are dropped
unchecked. At most `max_pending` decisions wait per pod; older ones are dropped
unchecked. The half threshold keeps a prompt whose tokens per byte differ a little from
the pod's average from counting as stale; a prefix that is gone entirely gives the
decision no hits at all. Precise pods (KV events) are checked from the engine's own
events instead (`epp.prefix.precise_stale`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_parser import PodMetrics
from epp.observability.loop_metrics import LoopCounter

DEFAULT_REQUIRED = 0.5
DEFAULT_MAX_PENDING = 10_000
# The ratio's sums are halved beyond this many EPP tokens, so that it follows a change of
# the workload's mix (tokens per byte differ between prose, code and numbers).
_RATIO_WINDOW_TOKENS = 50_000_000


@dataclass(slots=True)
class _Pending:
    seq: int  # the endpoint's dispatch number
    prompt: int  # the prompt's tokens, as the EPP counts them
    predicted: int  # tokens the EPP expected from the pod's cache (0: not checked)
    credit: int = 0  # hits the pod's counter gave it so far (in the EPP's tokens)
    finished_on: int = 0  # the ledger's page on which it was seen finished (0: open)
    counted: bool = False  # matched with a request in the pod's prompt histogram


@dataclass(slots=True)
class _Ledger:
    hits: float | None = None  # the pod's hit counter on its last page
    finished: tuple[float, float] | None = None  # its prompt histogram: (count, sum)
    own_tokens: float = 0.0  # the EPP's prompt tokens of the requests the pod finished
    engine_tokens: float = 0.0  # the pod's prompt tokens of the same (and others')
    page: int = 0  # pages with decisions queued, counted
    pending: deque[_Pending] = field(default_factory=deque)

    def ratio(self) -> float:
        """EPP tokens per pod token (1 until both sides have counted some)."""
        if self.engine_tokens > 0 and self.own_tokens > 0:
            return self.own_tokens / self.engine_tokens
        return 1.0

    def count(self, entry: _Pending) -> None:
        entry.counted = True
        self.own_tokens += entry.prompt

    def match_finished(self, finished: tuple[float, float] | None) -> None:
        """Move the ratio with a new page's prompt histogram (step 2)."""
        before, self.finished = self.finished, finished
        if finished is None or before is None or finished[0] < before[0]:
            for entry in self.pending:
                entry.counted = True  # nothing to match them with
            return
        done = int(finished[0] - before[0])
        page = self.page
        for entry in self.pending:
            if entry.counted:
                continue
            if done > 0:
                done -= 1
                self.count(entry)
            elif 0 < entry.finished_on < page:  # over before this page's fetch
                self.count(entry)
        self.engine_tokens += finished[1] - before[1]
        if self.own_tokens > _RATIO_WINDOW_TOKENS:
            self.own_tokens /= 2
            self.engine_tokens /= 2

    def hand_out(self, give: int) -> None:
        """Step 3: a page's hits (in the EPP's tokens) to the queued decisions, oldest
        first, each taking at most what it still lacks of its prediction."""
        if give <= 0:
            return
        for entry in self.pending:
            need = entry.predicted - entry.credit
            if need > 0:
                take = need if need < give else give
                entry.credit += take
                give -= take
                if give <= 0:
                    return

    def take_checked(self, required: float) -> tuple[int, int]:
        """Step 4: drop the decisions seen finished on an earlier page than this one
        (their prefill is on it, and in its prompt histogram); returns how many of them
        had a prediction (checked) and how many of those got less than `required` of it
        (stale)."""
        page = self.page
        keep: deque[_Pending] = deque()
        checked = stale = 0
        for entry in self.pending:
            if entry.finished_on and entry.finished_on < page:
                if entry.predicted:
                    checked += 1
                    if entry.credit < entry.predicted * required:
                        stale += 1
                continue
            keep.append(entry)
        self.pending = keep
        return checked, stale


class StaleCacheTracker:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        required: float = DEFAULT_REQUIRED,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.stale = LoopCounter(
            "epp_stale_cache_routing_total",
            "Routing decisions whose predicted prefix-cache hit the pod did not have."
            " Approximate pods: less than half of the predicted tokens showed up in the"
            " pod's vllm:prefix_cache_hits_total (per scrape, converted to the EPP's"
            " tokens). Precise pods: the engine computed the last predicted block"
            " (a BlockStored event). See docs/metrics.md.",
            registry=registry,
        )
        self.checked = LoopCounter(
            "epp_stale_cache_checked_total",
            "Routing decisions with a predicted prefix-cache hit that were checked (stale"
            " or not): against the pod's vllm:prefix_cache_hits_total, or its KV events.",
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
        of its `prompt_tokens` from the pod's cache (0: no hit predicted; the decision
        still counts in the pod's token ratio)."""
        cap = (prompt_tokens - 1) // block_size * block_size if prompt_tokens > 0 else 0
        predicted = min(matched_tokens, cap)
        if predicted < block_size:
            predicted = 0
        ledger = self._ledgers.get(endpoint)
        if ledger is None:
            ledger = self._ledgers[endpoint] = _Ledger()
        if len(ledger.pending) >= self._max_pending and ledger.pending.popleft().predicted:
            self.dropped += 1
        # No prompt (not a generation request): the pod's prompt histogram never has it.
        counted = prompt_tokens <= 0 or ledger.finished is None
        ledger.pending.append(_Pending(seq, max(0, prompt_tokens), predicted, counted=counted))

    def scraped(self, endpoint: Endpoint) -> None:
        """A good page of `endpoint` was stored (`endpoint.metrics` is the new one)."""
        metrics = endpoint.metrics
        if metrics is None:
            return
        hits = metrics.prefix_hits
        ledger = self._ledgers.get(endpoint)
        if ledger is None:
            ledger = self._ledgers[endpoint] = _Ledger()
        if not metrics.prefix_counters:
            # No hit counter on the page (SGLang, Triton): a hit cannot be told from a
            # miss, so nothing queued for this pod is checked (each would count stale).
            self.dropped += sum(1 for entry in ledger.pending if entry.predicted)
            ledger.pending.clear()
            ledger.hits = None
            return
        if ledger.hits is None or hits < ledger.hits:
            # First page, or the engine restarted (its counters start again from zero):
            # the queued decisions cannot be told apart from the old counts.
            self._start_afresh(ledger, endpoint, metrics)
            return
        credit = hits - ledger.hits
        ledger.hits = hits
        pending = ledger.pending
        ledger.page += 1
        page = ledger.page
        still_open = endpoint.open
        for entry in pending:
            if not entry.finished_on and entry.seq not in still_open:
                entry.finished_on = page
        ledger.match_finished(_finished(metrics))
        if not pending:
            return
        ledger.hand_out(int(credit * ledger.ratio()))
        checked, stale = ledger.take_checked(self._required)
        if checked:
            self.checked.inc(checked)
        if stale:
            self.stale.inc(stale)

    def restarted(self, endpoint: Endpoint) -> None:
        """The pod's server restarted (the store's `reset`: its counters went back or its
        start time changed): what is queued cannot be told apart from the old counts."""
        ledger = self._ledgers.get(endpoint)
        if ledger is not None:
            ledger.hits = None  # the next page is a first page

    def removed(self, endpoint: Endpoint) -> None:
        ledger = self._ledgers.pop(endpoint, None)
        if ledger is not None:
            self.dropped += sum(1 for entry in ledger.pending if entry.predicted)

    def pending(self, endpoint: Endpoint) -> int:
        """Decisions with a predicted hit waiting to be checked on `endpoint`."""
        ledger = self._ledgers.get(endpoint)
        return 0 if ledger is None else sum(1 for entry in ledger.pending if entry.predicted)

    def ratio(self, endpoint: Endpoint) -> float:
        """The pod's EPP tokens per pod token, as the check uses it."""
        ledger = self._ledgers.get(endpoint)
        return 1.0 if ledger is None else ledger.ratio()

    def _start_afresh(self, ledger: _Ledger, endpoint: Endpoint, metrics: PodMetrics) -> None:
        # The ratio's sums stay: the two tokenizers did not change with the engine.
        self.dropped += sum(1 for entry in ledger.pending if entry.predicted)
        finished = ledger.finished = _finished(metrics)
        ledger.hits = metrics.prefix_hits
        pending, ledger.pending = ledger.pending, deque()
        if finished is None:
            return
        # Which of the decisions not seen over yet does this page's count have? The EPP may
        # hear of an end after the pod's page shows it: the oldest, as many as the pod
        # finished (since it started: the EPP was its only client so far, or the pod has
        # finished more than all of them). The others stay, unchecked, for the ratio.
        still_open = endpoint.open
        unseen = [e for e in pending if e.prompt > 0 and (e.seq in still_open or not e.finished_on)]
        ledger.pending.extend(
            _Pending(e.seq, e.prompt, 0, finished_on=0 if e.seq in still_open else ledger.page)
            for e in unseen[int(finished[0]) :]
        )


def _finished(metrics: PodMetrics) -> tuple[float, float] | None:
    count, total = metrics.finished_requests, metrics.finished_prompt_tokens
    return None if count is None or total is None else (count, total)
