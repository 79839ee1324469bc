"""Stale routing in precise mode, decided from the engine's own KV events.

A decision is **stale** when the prefix match the EPP predicted for the chosen pod was
not in the pod's cache when the request ran. For a precise pod (its KV events followed),
the engine says so itself: a block it had to compute is announced in a `BlockStored`, and
a block it reused is not. So:

1. At dispatch, a decision with a predicted match of `m` blocks *claims* its last matched
   block, `hashes[c - 1]`, where `c = min(m, cap)` and `cap` is the most blocks an engine
   can reuse for the prompt (it always computes the prompt's last token, so never the
   last engine block when the prompt fills it exactly:
   `(prompt_tokens - 1) // engine_block_size` engine blocks, in our blocks). If the pod
   lacked any claimed block, it computed every block after the first one missing,
   `hashes[c - 1]` included: one claimed key tells.
2. If, at dispatch, the claimed block was held only as a *prediction* (an earlier
   decision sent that prefix to the pod and the engine has not reported it yet), one
   store of it is expected: that earlier request computes it. A block the engine had
   already reported expects none. Decisions claiming the same block share that one
   expected store.
3. Each `BlockStored` of a claimed block on that pod first consumes an expected store;
   any store beyond makes the oldest open claimant of that block stale, unless the event
   goes on with a block that is not the claimant's next one: then another prompt sharing
   the block computed it again (it was evicted after the claimant's hit), not the
   claimant (real vLLM does this under eviction: tests/e2e/test_vllm_precise_e2e.py).
4. A claim is checked `grace_s` after its request completed (the engine publishes a
   step's events within milliseconds), or after `max_open_s` if no completion ever came
   (then it is dropped, not counted). Every checked claim counts in `checked`; stale ones
   in `stale` too.

What it is not: exact when the engine computes a claimed block for a reason of its own
(a second copy when two requests need it in the same step counts against the later
claimant, which is right; a request that failed before computing the predicted block
leaves the expected store unconsumed, so a sibling's miss can go unnoticed). Decisions
for approximate pods are not checked here (`epp.observability.stale` estimates those
from the pods' hit counters). No I/O and no clock: times are passed in.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.prefix.hashing import BlockHash

DEFAULT_GRACE_S = 1.0
DEFAULT_MAX_OPEN_S = 300.0


@dataclass(slots=True, eq=False)
class _Claim:
    token: str
    pod: str
    key: BlockHash
    opened: float
    # The prompt's blocks after the claimed one, up to its last full engine block; `whole`:
    # that is where its prompt ends (False: only the head of a long prompt was hashed).
    after: tuple[BlockHash, ...]
    whole: bool
    due: float | None = None  # completion + grace
    stale: bool = False
    closed: bool = False


@dataclass(slots=True)
class _Ledger:
    expected: int  # stores still expected from earlier decisions' computations
    claims: deque[_Claim] = field(default_factory=deque)


class PreciseStaleCheck:
    """Claims of decisions on precise pods, settled by the pods' BlockStored events."""

    def __init__(
        self, grace_s: float = DEFAULT_GRACE_S, max_open_s: float = DEFAULT_MAX_OPEN_S
    ) -> None:
        self.grace_s = grace_s
        self.max_open_s = max_open_s
        self.stale = 0  # checked claims found stale
        self.checked = 0  # claims checked (stale or not)
        self.dropped = 0  # claims never completed: not counted
        self._claims: dict[str, _Claim] = {}  # token -> claim
        self._ledgers: dict[str, dict[BlockHash, _Ledger]] = {}  # pod -> key -> ledger
        self._due: deque[_Claim] = deque()  # completed, in completion order
        self._open: deque[_Claim] = deque()  # every claim, in dispatch order

    def dispatched(
        self,
        token: str,
        pod: str,
        hashes: Sequence[BlockHash],
        matched: int,
        prompt_tokens: int,
        *,
        block_size: int,
        engine_block_size: int,
        confirmed: bool,
        now: float,
    ) -> bool:
        """A decision sent `hashes` to `pod` predicting `matched` leading blocks cached.
        `confirmed`: the engine had reported the last claimed block (`claimed_key`), as
        opposed to a prediction only. Returns whether a claim was opened."""
        cap = claim_cap(prompt_tokens, block_size, engine_block_size)
        claimed = min(matched, cap, len(hashes))
        if claimed < 1 or token in self._claims:
            return False
        key = hashes[claimed - 1]
        full = prompt_tokens // engine_block_size * max(1, engine_block_size // block_size)
        claim = _Claim(token, pod, key, now, tuple(hashes[claimed:full]), len(hashes) >= full)
        ledgers = self._ledgers.setdefault(pod, {})
        ledger = ledgers.get(key)
        if ledger is None:
            ledger = ledgers[key] = _Ledger(0 if confirmed else 1)
        elif not confirmed and ledger.expected == 0:
            ledger.expected = 1  # reported, evicted, sent again: a new computation is due
        ledger.claims.append(claim)
        self._claims[token] = claim
        self._open.append(claim)
        return True

    def completed(self, token: str, now: float) -> None:
        claim = self._claims.get(token)
        if claim is not None and claim.due is None:
            claim.due = now + self.grace_s
            self._due.append(claim)

    def stored(self, pod: str, keys: Sequence[BlockHash]) -> None:
        """The pod's engine stored blocks with these keys, in prompt order (one event:
        one request's new blocks). A claimant that had to compute its claimed block
        stores its own prompt's next blocks in the same event (all or, with chunked
        prefill, the first ones), never others: an event going on with other blocks, or
        beyond the claimant's prompt, is another request's (the block was evicted and
        computed again by a prompt that shares it), not the claimant's."""
        ledgers = self._ledgers.get(pod)
        if not ledgers:
            return
        for i, key in enumerate(keys):
            ledger = ledgers.get(key)
            if ledger is None:
                continue
            if ledger.expected > 0:
                ledger.expected -= 1
                continue
            following = tuple(keys[i + 1 :])
            for claim in ledger.claims:
                if not claim.stale and _could_be_its_own(claim, following):
                    claim.stale = True
                    break

    def poll(self, now: float) -> None:
        """Check the claims whose time came; `stale` and `checked` grow."""
        due = self._due
        while due and due[0].due is not None and due[0].due <= now:
            claim = due.popleft()
            if not claim.closed:
                self.checked += 1
                self.stale += claim.stale
                self._close(claim)
        opened = self._open
        while opened and (opened[0].closed or opened[0].opened + self.max_open_s <= now):
            claim = opened.popleft()
            if not claim.closed:
                self.dropped += 1
                self._close(claim)

    def forget_pod(self, pod: str) -> None:
        """The pod left or its entries were dropped: its open claims are not checked."""
        ledgers = self._ledgers.pop(pod, None)
        for ledger in (ledgers or {}).values():
            for claim in ledger.claims:
                claim.closed = True
                self._claims.pop(claim.token, None)
                self.dropped += 1

    @property
    def open_claims(self) -> int:
        return len(self._claims)

    def _close(self, claim: _Claim) -> None:
        claim.closed = True
        self._claims.pop(claim.token, None)
        ledgers = self._ledgers.get(claim.pod)
        if ledgers is None:
            return
        ledger = ledgers.get(claim.key)
        if ledger is None:
            return
        with contextlib.suppress(ValueError):
            ledger.claims.remove(claim)
        if not ledger.claims:
            del ledgers[claim.key]
            if not ledgers:
                del self._ledgers[claim.pod]


def _could_be_its_own(claim: _Claim, following: tuple[BlockHash, ...]) -> bool:
    """Whether an event that stored the claimed block and then `following` can be the
    claimant's own computation."""
    after = claim.after
    if following[: len(after)] != after[: len(following)]:
        return False
    return len(following) <= len(after) or not claim.whole


def claim_cap(prompt_tokens: int, block_size: int, engine_block_size: int) -> int:
    """The most of our blocks an engine can serve from its cache for a prompt: it computes
    the last prompt token, so at most `(prompt_tokens - 1) // engine_block_size` engine
    blocks, each `engine_block_size // block_size` of ours."""
    if prompt_tokens < 1 or engine_block_size < 1 or block_size < 1:
        return 0
    per = max(1, engine_block_size // block_size)
    return (prompt_tokens - 1) // engine_block_size * per
