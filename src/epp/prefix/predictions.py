"""Precise mode's predicted entries: what the router sent a precise pod, held until the
engine's events speak.

A burst of requests sharing a new prefix lands on one pod before the engine's events
arrive, so each `record` on a precise pod predicts the prompt's blocks the engine has not
reported. An event storing the block confirms the entry (it becomes a reported one, owned
by `epp.prefix.engine_blocks`); else the entry goes `predicted_ttl_s` after its request
ended (`completed`), or `predicted_max_s` after it was predicted whatever happens (a
completion that never comes). The TTL runs from the request's end, not from dispatch: the
engine reports a request's blocks only when its prefill starts, which can be long after
dispatch when the pod queues (docs/benchmarks/precise.md). A block predicted by several
requests lives as long as the last of them.

A pod's predicted entries (a dict that churns) are copied into a right-sized table once as
many entries were removed as it holds: CPython never shrinks a dict, and one that has
churned keeps a table up to 3x its size.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

from epp.prefix.hashing import BlockHash
from epp.prefix.holders import Holders
from epp.prefix.pod_blocks import PodBlocks

_COMPACT_AFTER = 4096  # removals from a churning dict before its size is checked
# A predicted entry's value: the sequence number of the prediction that created it (high
# bits) and how many live predictions hold it (low bits).
_COUNT_BITS = 32
_COUNT = (1 << _COUNT_BITS) - 1


def _compact(table: dict) -> dict:
    """`table`, or a right-sized copy of it when its table is more than about twice what
    its entries need (a fresh dict of ints costs 30-60 bytes an entry)."""
    if sys.getsizeof(table) > 64 * len(table) + 4096:
        return dict(table)
    return table


class _Prediction:
    """One `record` on a precise pod: the blocks it predicted (None once released)."""

    __slots__ = ("deadline", "keys", "seq", "slot", "token")

    def __init__(
        self, slot: PodBlocks, keys: list[BlockHash], seq: int, deadline: float, token: str | None
    ) -> None:
        self.slot = slot
        self.keys: list[BlockHash] | None = keys
        self.seq = seq
        self.deadline = deadline  # released then at the latest
        self.token = token  # the request's route token while it is in flight


class Predictions:
    """Every precise pod's predictions and their release. Each prediction is released
    once, from whichever queue reaches it first; both queues are FIFO in time order (one
    TTL, one maximum), so `now` must not go backwards."""

    def __init__(self, holders: Holders, ttl_s: float, max_s: float) -> None:
        self._holders = holders
        self.ttl_s = ttl_s
        self.max_s = max_s
        # (release time, prediction) of those whose request ended (or that have none).
        self._expiring: deque[tuple[float, _Prediction]] = deque()
        # Those with a request, in deadline order; released ones stay until popped or
        # until the queue is rebuilt without them (`completed`).
        self.in_flight: deque[_Prediction] = deque()
        # route token -> prediction, until its request ends or its deadline.
        self._by_token: dict[str, _Prediction] = {}
        self._seq = 0
        # Predictions released at their deadline while their request was still open (its
        # completion was lost, or the request outlived max_s).
        self.capped = 0

    def predict(
        self, slot: PodBlocks, hashes: Sequence[BlockHash], now: float, token: str | None
    ) -> None:
        """The router sent the precise pod these blocks (see `PrefixIndex.record`)."""
        seq = self._seq = self._seq + 1
        fresh = self._enter(slot, hashes, seq)
        if not fresh:
            return
        if token is None:
            prediction = _Prediction(slot, fresh, seq, now + self.ttl_s, None)
            self._expiring.append((prediction.deadline, prediction))
        else:
            if token in self._by_token:  # one token recorded twice: the first one ends
                self.completed(token, now)
            prediction = _Prediction(slot, fresh, seq, now + self.max_s, token)
            self.in_flight.append(prediction)
            self._by_token[token] = prediction
        if len(slot.predicted) > slot.capacity:
            self.bound(slot)

    def _enter(self, slot: PodBlocks, hashes: Sequence[BlockHash], seq: int) -> list[BlockHash]:
        """Create or share the predicted entries of the blocks the engine has not reported;
        mark the reported ones a hit uses. The keys this prediction holds."""
        created = (seq << _COUNT_BITS) | 1
        predicted = slot.predicted
        predicted_of = predicted.get
        bits = self._holders.bits
        holders_of = bits.get
        hold, mark, both = slot.hold, slot.mark, slot.both
        fresh: list[BlockHash] = []
        hit = True  # still within the prefix the pod holds (what this decision reuses)
        for block in hashes:
            value = predicted_of(block)
            if value is None:
                mask = holders_of(block)
                if mask is None:
                    bits[block] = hold
                elif mask & hold:
                    # Reported by the engine: nothing to predict. A hit uses it: the mark
                    # keeps it through the engine bound's next turn (CLOCK).
                    if hit and not mask & mark:
                        # The pod's own int when it alone holds it: no int object per key.
                        bits[block] = both if mask == hold else mask | mark
                    continue
                else:
                    bits[block] = mask | hold
                predicted[block] = created
                hit = False
            else:
                predicted[block] = value + 1  # one more prediction holds it
            fresh.append(block)
        return fresh

    def completed(self, token: str, now: float) -> None:
        """The request recorded with `token` ended: its entries live `ttl_s` more, for the
        engine's events to arrive (never past their deadline). O(1); unknown tokens are
        ignored."""
        prediction = self._by_token.pop(token, None)
        if prediction is None or prediction.keys is None:
            return
        expires = now + self.ttl_s
        if expires < prediction.deadline:  # else the in-flight queue releases it
            self._expiring.append((expires, prediction))
        in_flight = self.in_flight
        # Released predictions stay in the in-flight queue until their deadline: rebuild
        # it once they are most of it (amortised O(1) a request, memory bounded by the
        # requests in flight rather than by the request rate x max_s).
        if len(in_flight) > 1024 and len(in_flight) > 4 * (
            len(self._by_token) + len(self._expiring)
        ):
            self.in_flight = deque(p for p in in_flight if p.keys is not None)

    def expire_due(self, clock: Callable[[], float]) -> None:
        """`expire` at `clock()` if a prediction's time is up then (the clock is read only
        while predictions are queued: the lookup's hot path)."""
        expiring, in_flight = self._expiring, self.in_flight
        if expiring or in_flight:
            now = clock()
            if (expiring and expiring[0][0] <= now) or (in_flight and in_flight[0].deadline <= now):
                self.expire(now)

    def expire(self, now: float) -> int:
        """Release predictions whose time is up; how many entries were dropped."""
        dropped = 0
        expiring = self._expiring
        while expiring and expiring[0][0] <= now:
            prediction = expiring.popleft()[1]
            if prediction.keys is not None:
                dropped += self._release(prediction)
        in_flight = self.in_flight
        while in_flight and in_flight[0].deadline <= now:
            prediction = in_flight.popleft()
            if prediction.keys is not None:
                token = prediction.token
                if token is not None and self._by_token.get(token) is prediction:
                    del self._by_token[token]
                    self.capped += 1
                dropped += self._release(prediction)
        return dropped

    def _release(self, prediction: _Prediction) -> int:
        """Drop this prediction's share of its entries; the entries no other live
        prediction holds go (and the pod's bit with them). How many went."""
        keys = prediction.keys
        prediction.keys = None
        if not keys:
            return 0
        slot = prediction.slot
        predicted = slot.predicted
        seq = prediction.seq
        drop = self._holders.drop
        dropped = 0
        for key in keys:
            value = predicted.get(key)
            # Confirmed by an event, bounded, or the pod cleared; or a later prediction
            # created the entry anew (it never held this one's share): not ours.
            if value is None or value >> _COUNT_BITS > seq:
                continue
            if value & _COUNT > 1:
                predicted[key] = value - 1
            else:
                del predicted[key]
                drop(key, slot.hold, slot.both)
                dropped += 1
        slot.predicted_churn += len(keys)
        if slot.predicted_churn > _COMPACT_AFTER and slot.predicted_churn > len(predicted):
            slot.predicted = _compact(predicted)
            slot.predicted_churn = 0
        return dropped

    def bound(self, slot: PodBlocks) -> None:
        """Drop the oldest predicted entries beyond the pod's capacity."""
        excess = len(slot.predicted) - slot.capacity
        if excess > 0:
            predicted = slot.predicted
            drop = self._holders.drop
            for block in list(islice(predicted, excess)):
                del predicted[block]
                drop(block, slot.hold, slot.both)

    def forget(self, slot: PodBlocks) -> None:
        """The pod's predicted entries go (its predictions, released later, find none)."""
        drop = self._holders.drop
        for block in slot.predicted:
            drop(block, slot.hold, slot.both)
        slot.predicted = {}
        slot.predicted_churn = 0

    def count(self) -> int:
        """Predictions not yet released (requests in flight and their TTL after)."""
        return len(self._by_token) + sum(1 for _, p in self._expiring if p.keys is not None)

    def open(self, slot: PodBlocks) -> Iterator[list[BlockHash]]:
        """The keys of each of the pod's unreleased predictions: requests in flight, newest
        first, then those in their TTL, newest first."""
        for prediction in reversed(self._by_token.values()):
            if prediction.slot is slot and prediction.keys:
                yield prediction.keys
        for _, prediction in reversed(self._expiring):
            if prediction.slot is slot and prediction.keys:
                yield prediction.keys
