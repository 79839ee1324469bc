"""What each pod holds in its KV cache, as far as the router knows.

A map from chained block hash to the pods holding that block. Because a block's hash
chains every block before it, one hash names one whole prefix: the map is a prefix tree
flattened into its nodes, and walking a request's hashes in order is walking the tree
from the root. Lookup stops at the first block nobody holds, so its cost is bounded by
the length of the longest cached prefix, not by the size of the index.

Each pod learns its blocks in one of two modes (`set_precise`):

- **Approximate** (the default): `record` says the router sent the pod this prefix, so
  the pod is assumed to hold it. The pod's blocks are bounded by a capacity (the pod's
  real KV size when known), so the index cannot grow without bound and forgets what the
  pod must have evicted too. Eviction is CLOCK (second chance), the classic close
  approximation of LRU: blocks queue in the order they were first recorded; a block
  recorded again is marked, and when its turn to go comes, a marked block loses its mark
  and goes to the back instead. A prompt's blocks are queued tail first, so an engine's
  order (a sequence's tail before its head) is kept. No single request takes over a
  pod's memory: `record` keeps at most `max_record_fraction` of the pod's capacity (at
  least one block) from the prompt's head and drops the tail.
- **Precise**: the pod's engine says what it stored and evicted (vLLM KV events, applied
  by `epp.prefix.precise`). Each engine block is kept under the engine's own hash with
  the router's key(s) for it (`store_engine_blocks`, `remove_engine_blocks`), so that an
  eviction names what to forget. `record` then adds *predicted* entries: a burst of
  requests sharing a new prefix lands on one pod before the engine's events arrive. An
  event storing the block confirms the entry (it becomes a reported one); else it goes
  `predicted_ttl_s` (about 2 s) after its request ended (`completed`), or after
  `predicted_max_s` whatever happens (a completion that never comes). The engine reports
  a request's blocks only when its prefill starts, which can be long after dispatch when
  the pod queues: a fixed TTL from dispatch forgot queued requests before they started
  (docs/benchmarks/precise.md). A block predicted by several requests lives as long as
  the last of them. The capacity bounds the engine blocks kept (counted in the engine's
  blocks), a safety net for removals that never came, and the predicted entries. That
  bound follows use, not insertion: a routed hit (`record` of blocks the engine
  reported, on the chosen pod, up to the first block it lacks) sets the pod's mark bit
  on them, otherwise unused in this mode, and the engine map's CLOCK gives a marked block
  a second chance. A system prompt stored once and then only hit (a hit stores nothing)
  stays while it is hit; blocks the engine holds out of our sight are relearnt
  (`relearn_engine_block`, from `epp.prefix.precise`).

Memory (the field's routers have run out of it; docs/benchmarks/index.md measures this):

- pods are small integer ids, and a block maps to one int of bits: per pod, a "holds it"
  bit and (approximate mode) its CLOCK mark beside it, rather than a set of names. A
  block held by one pod costs one dict entry whose value is a shared int object;
- the approximate queue is an array of 8-byte hashes per pod (no per-block object, no
  linked list); whether a block is held and marked is read from its bits;
- a precise pod's engine hash -> key map packs each pair into a 16-byte record
  (`epp.prefix.engine_map`, about 19 bytes a block) rather than a dict entry and the
  engine hash's own int object (about 78 bytes);
- a pod's predicted entries, a dict that churns, are copied into a right-sized table once
  as many entries were removed as they hold: CPython never shrinks a dict, and one that
  has churned keeps a table up to 3x its size.
"""

from __future__ import annotations

import heapq
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from epp.prefix.engine_map import EngineKeys, EngineMap
from epp.prefix.hashing import BlockHash

if TYPE_CHECKING:
    from epp.config import PrefixConfig


DEFAULT_MAX_RECORD_FRACTION = 0.5
DEFAULT_PREDICTED_TTL_S = 2.0
DEFAULT_PREDICTED_MAX_S = 120.0


_COMPACT_AFTER = 4096  # removals from a churning dict before its size is checked
# A predicted entry's value: the sequence number of the prediction that created it (high
# bits) and how many live predictions hold it (low bits).
_COUNT_BITS = 32
_COUNT = (1 << _COUNT_BITS) - 1


def _new_log() -> array | list[BlockHash]:
    return array("Q")


def _compact(table: dict) -> dict:
    """`table`, or a right-sized copy of it when its table is more than about twice what
    its entries need (a fresh dict of ints costs 30-60 bytes an entry)."""
    if sys.getsizeof(table) > 64 * len(table) + 4096:
        return dict(table)
    return table


class _Pod:
    """One pod's blocks. Only the fields of its mode are in use; switching mode clears them."""

    __slots__ = (
        "both",
        "capacity",
        "count",
        "engine",
        "extra_copies",
        "hold",
        "log",
        "log_pos",
        "mark",
        "name",
        "pod_id",
        "precise",
        "predicted",
        "predicted_churn",
        "shared",
    )

    def __init__(self, name: str, pod_id: int, capacity: int) -> None:
        self.name = name
        self.pod_id = pod_id
        self.hold = 1 << (2 * pod_id)  # the pod holds the block
        self.mark = self.hold << 1  # approximate: recorded again since its last turn
        self.both = self.hold | self.mark
        self.capacity = capacity
        self.precise = False
        # Approximate: the CLOCK queue, `log[log_pos:]`, each held block once, and its size.
        self.log: array | list[BlockHash] = _new_log()
        self.log_pos = 0
        self.count = 0
        # Precise: engine hash -> our key(s) (created when the pod turns precise); engine
        # hashes stored more than once (an engine may cache one hash twice) -> the number
        # of extra copies.
        self.engine: EngineMap | None = None
        self.extra_copies: dict[int, int] | None = None
        self.shared: dict[BlockHash, int] | None = None
        # Precise: our key -> (creator's sequence number, live predictions holding it) of a
        # predicted entry not yet confirmed by an event (_COUNT_BITS).
        self.predicted: dict[BlockHash, int] = {}
        self.predicted_churn = 0

    def size(self) -> int:
        if self.precise:
            return len(self.engine or ()) + len(self.predicted)
        return self.count


class _Prediction:
    """One `record` on a precise pod: the blocks it predicted (None once released)."""

    __slots__ = ("deadline", "keys", "seq", "slot", "token")

    def __init__(
        self, slot: _Pod, keys: list[BlockHash], seq: int, deadline: float, token: str | None
    ) -> None:
        self.slot = slot
        self.keys: list[BlockHash] | None = keys
        self.seq = seq
        self.deadline = deadline  # released then at the latest (predicted_max_s)
        self.token = token  # the request's route token while it is in flight


class PrefixIndex:
    # A precise pod's engine hash -> key map (the benchmark measures a dict beside it).
    engine_map: Callable[[int], EngineMap] = EngineMap

    def __init__(
        self,
        capacity_per_pod: int,
        max_record_fraction: float = DEFAULT_MAX_RECORD_FRACTION,
        *,
        predicted_ttl_s: float = DEFAULT_PREDICTED_TTL_S,
        predicted_max_s: float = DEFAULT_PREDICTED_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_per_pod < 1:
            raise ValueError("capacity_per_pod must be at least 1")
        if not 0.0 < max_record_fraction <= 1.0:
            raise ValueError("max_record_fraction must be in (0, 1]")
        if not predicted_ttl_s > 0.0:
            raise ValueError("predicted_ttl_s must be > 0")
        if not predicted_max_s >= predicted_ttl_s:
            raise ValueError("predicted_max_s must be >= predicted_ttl_s")
        self.default_capacity = capacity_per_pod
        self.max_record_fraction = max_record_fraction
        self.predicted_ttl_s = predicted_ttl_s
        self.predicted_max_s = predicted_max_s
        self._clock = clock
        # block -> bits: pod id i holds it (bit 2i) and, approximate, is marked (bit 2i+1);
        # never 0 (the key goes).
        self._holders: dict[BlockHash, int] = {}
        self._hold_all = 0  # every pod's "holds" bit
        self._pods: dict[str, _Pod] = {}
        self._names: list[str | None] = []  # pod id -> name
        self._free_ids: list[int] = []  # a heap: the lowest id is reused first
        self._capacity: dict[str, int] = {}  # set_capacity, kept while a pod has no blocks
        self._match_units: dict[str, int] = {}  # set_match_unit: precise pods, unit > 1
        # Predictions (records on precise pods). Each is released once, from whichever
        # queue reaches it first; both are FIFO in time order (one TTL, one maximum):
        # (release time, prediction) of those whose request ended (or that have none);
        self._expiring: deque[tuple[float, _Prediction]] = deque()
        # those with a request, in deadline order (released ones stay until popped or
        # until `_in_flight` is rebuilt without them);
        self._in_flight: deque[_Prediction] = deque()
        # route token -> prediction, until its request ends or its deadline.
        self._by_token: dict[str, _Prediction] = {}
        self._seq = 0
        # Predictions released at their deadline while their request was still open (its
        # completion was lost, or the request outlived predicted_max_s).
        self.predictions_capped = 0
        # Engine blocks dropped by the capacity bound of a precise pod (their removal
        # events were lost, or the bound is below the pod's real KV size).
        self.precise_capacity_evictions = 0

    @classmethod
    def from_config(
        cls,
        config: PrefixConfig,
        *,
        predicted_ttl_s: float = DEFAULT_PREDICTED_TTL_S,
        predicted_max_s: float = DEFAULT_PREDICTED_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> PrefixIndex:
        return cls(
            config.capacity_per_pod,
            config.max_record_fraction,
            predicted_ttl_s=predicted_ttl_s,
            predicted_max_s=predicted_max_s,
            clock=clock,
        )

    # -- lookup ------------------------------------------------------------------------

    def record_limit(self, pod: str) -> int:
        """The most blocks one `record` call keeps for the pod (its prompt's head)."""
        return max(1, int(self.capacity(pod) * self.max_record_fraction))

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per pod, how many blocks from the start of `hashes` it holds without a gap; a
        precise pod's, in whole engine blocks (`set_match_unit`)."""
        matched = self._match(hashes)
        if self._match_units and matched:
            for pod, unit in self._match_units.items():
                blocks = matched.get(pod)
                if blocks:
                    matched[pod] = blocks - blocks % unit
        return matched

    def set_match_unit(self, pod: str, unit: int) -> None:
        """A precise pod's engine reuses whole engine blocks only, `unit` of ours each
        (vLLM's block size over ours): half an engine block held (the same first tokens
        in another prompt's block) is no hit. Matches are rounded down to whole units."""
        if unit > 1:
            self._match_units[pod] = unit
        else:
            self._match_units.pop(pod, None)

    def _match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        if self._expiring or self._in_flight:
            self._expire_due()
        if not hashes:
            return {}
        holders_of = self._holders.get
        active = holders_of(hashes[0], 0) & self._hold_all
        if not active:
            return {}
        names = self._names
        matched: dict[str, int] = {}
        depth = 0
        for depth, block in enumerate(hashes):
            both = active & holders_of(block, 0)
            if both != active:
                dropped = active ^ both
                while dropped:
                    low = dropped & -dropped
                    matched[names[low.bit_length() >> 1]] = depth  # type: ignore[index]
                    dropped ^= low
                active = both
                if not active:
                    return matched
        else:
            depth = len(hashes)
        while active:
            low = active & -active
            matched[names[low.bit_length() >> 1]] = depth  # type: ignore[index]
            active ^= low
        return matched

    # -- the router's view: record ------------------------------------------------------

    def record(
        self,
        pod: str,
        hashes: Sequence[BlockHash],
        now: float | None = None,
        token: str | None = None,
    ) -> None:
        """The router sent the pod this prefix (or a peer replica did).

        Approximate pod: it now holds these blocks. Precise pod: predicted entries, unless
        an event confirms them, live until `predicted_ttl_s` after the request named by
        `token` ended (`completed(token)`), and at most `predicted_max_s` from `now`
        (default: the index's clock); without a token, `predicted_ttl_s` from `now`. Only
        the first `record_limit(pod)` blocks are kept: one prompt never pushes out more
        than that share of what the index remembers for the pod."""
        slot = self._slot(pod)
        limit = self.record_limit(pod)
        if len(hashes) > limit:
            hashes = hashes[:limit]
        if slot.precise:
            self._predict(slot, hashes, self._clock() if now is None else now, token)
            return
        holders = self._holders
        holders_of = holders.get
        hold, mark, both = slot.hold, slot.mark, slot.both
        log = slot.log
        append = log.append
        added = 0
        # The tail first: of a prompt's new blocks, the tail is the first to go, as an
        # engine evicts a sequence's tail before its head.
        for block in reversed(hashes):
            mask = holders_of(block)
            if mask is None:
                holders[block] = hold
            elif mask == both:  # held by this pod alone, marked: the common re-record
                continue
            elif mask == hold:
                holders[block] = both
                continue
            elif mask & hold:
                if not mask & mark:
                    holders[block] = mask | mark
                continue
            else:
                holders[block] = mask | hold
            try:
                append(block)
            except OverflowError:  # not a 64-bit unsigned hash (see _append_slow)
                append = self._append_slow(slot, block)
            added += 1
        slot.count += added
        self._evict_lru(slot)

    @staticmethod
    def _append_slow(slot: _Pod, block: BlockHash) -> Callable[[BlockHash], None]:
        # The router's hashes are xxh64 digests (0..2**64-1: an array of 8-byte values);
        # anything else (tests use Python's signed hash()) moves the queue to a list.
        if isinstance(slot.log, array):
            slot.log = list(slot.log)
        slot.log.append(block)
        return slot.log.append

    def predict(self, pod: str, hashes: Sequence[BlockHash], now: float) -> None:
        """`record` at time `now` (the same for an approximate pod)."""
        self.record(pod, hashes, now)

    def completed(self, token: str, now: float) -> None:
        """The request recorded with `token` ended (answered, failed or cancelled): its
        predicted entries live `predicted_ttl_s` more, for the engine's events to arrive
        (never past their deadline). O(1); unknown tokens are ignored."""
        prediction = self._by_token.pop(token, None)
        if prediction is None or prediction.keys is None:
            return
        expires = now + self.predicted_ttl_s
        if expires < prediction.deadline:  # else the in-flight queue releases it
            self._expiring.append((expires, prediction))
        in_flight = self._in_flight
        # Released predictions stay in the in-flight queue until their deadline: rebuild
        # it once they are most of it (amortised O(1) a request, memory bounded by the
        # requests in flight rather than by the request rate x predicted_max_s).
        if len(in_flight) > 1024 and len(in_flight) > 4 * (
            len(self._by_token) + len(self._expiring)
        ):
            self._in_flight = deque(p for p in in_flight if p.keys is not None)

    def expire(self, now: float) -> int:
        """Release predictions whose time is up: the entries that no event confirmed and
        that no other live prediction holds are dropped; how many."""
        dropped = 0
        expiring = self._expiring
        while expiring and expiring[0][0] <= now:
            prediction = expiring.popleft()[1]
            if prediction.keys is not None:
                dropped += self._release(prediction)
        in_flight = self._in_flight
        while in_flight and in_flight[0].deadline <= now:
            prediction = in_flight.popleft()
            if prediction.keys is not None:
                token = prediction.token
                if token is not None and self._by_token.get(token) is prediction:
                    del self._by_token[token]
                    self.predictions_capped += 1
                dropped += self._release(prediction)
        return dropped

    def _expire_due(self) -> None:
        now = self._clock()
        expiring, in_flight = self._expiring, self._in_flight
        if (expiring and expiring[0][0] <= now) or (in_flight and in_flight[0].deadline <= now):
            self.expire(now)

    def _release(self, prediction: _Prediction) -> int:
        keys = prediction.keys
        prediction.keys = None
        if not keys:
            return 0
        slot = prediction.slot
        predicted = slot.predicted
        seq = prediction.seq
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
                self._clear_bit(key, slot)
                dropped += 1
        slot.predicted_churn += len(keys)
        if slot.predicted_churn > _COMPACT_AFTER and slot.predicted_churn > len(predicted):
            slot.predicted = _compact(predicted)
            slot.predicted_churn = 0
        return dropped

    @property
    def predictions(self) -> int:
        """Predictions not yet released (requests in flight and their TTL after)."""
        return len(self._by_token) + sum(1 for _, p in self._expiring if p.keys is not None)

    # -- pods ---------------------------------------------------------------------------

    def set_capacity(self, pod: str, capacity: int) -> None:
        capacity = max(1, min(capacity, self.default_capacity))
        if self._capacity.get(pod) != capacity:
            self._capacity[pod] = capacity
            slot = self._pods.get(pod)
            if slot is not None:
                slot.capacity = capacity
                if slot.precise:
                    if slot.engine is not None:
                        slot.engine.resize(capacity)
                    self._bound_engine(slot)
                    self._bound_predicted(slot)
                else:
                    self._evict_lru(slot)

    def set_precise(self, pod: str, precise: bool) -> None:
        """Switch the pod's mode. Its blocks are forgotten when the mode changes: the
        router's guesses are not the engine's word, and without events the engine's word
        goes stale."""
        slot = self._pods.get(pod)
        if slot is None:
            if not precise:
                return
            slot = self._slot(pod)
        if slot.precise != precise:
            self._clear(slot)
            slot.precise = precise
            slot.engine = self.engine_map(slot.capacity) if precise else None

    def is_precise(self, pod: str) -> bool:
        slot = self._pods.get(pod)
        return slot is not None and slot.precise

    def remove_pod(self, pod: str) -> None:
        slot = self._pods.pop(pod, None)
        if slot is not None:
            self._clear(slot)
            self._names[slot.pod_id] = None
            heapq.heappush(self._free_ids, slot.pod_id)
        self._capacity.pop(pod, None)

    def clear_pod(self, pod: str) -> None:
        """The pod's cache was reset (engine restart): forget its blocks, keep its capacity
        and its mode."""
        slot = self._pods.get(pod)
        if slot is not None:
            self._clear(slot)

    def blocks(self, pod: str) -> int:
        """Blocks held for the pod: approximate, our blocks; precise, the engine blocks its
        events stored plus the predicted entries."""
        slot = self._pods.get(pod)
        return 0 if slot is None else slot.size()

    def capacity(self, pod: str) -> int:
        return self._capacity.get(pod, self.default_capacity)

    def pods(self) -> list[str]:
        return list(self._pods)

    @property
    def nodes(self) -> int:
        """Distinct prefixes (tree nodes) held by at least one pod."""
        return len(self._holders)

    @property
    def entries(self) -> int:
        """(block, pod) entries across all pods (as `blocks` counts them)."""
        return sum(slot.size() for slot in self._pods.values())

    # -- precise mode: the engine's blocks -----------------------------------------------

    def engine_block(self, pod: str, engine_hash: int) -> EngineKeys | None:
        """Our key(s) for one of the pod's engine blocks; None if the pod does not hold it."""
        slot = self._pods.get(pod)
        if slot is None or slot.engine is None:
            return None
        return slot.engine.get(engine_hash)

    def reported(self, pod: str, block: BlockHash) -> bool:
        """The precise pod's engine reported holding the block (not just a prediction)."""
        slot = self._pods.get(pod)
        if slot is None or not slot.precise or block in slot.predicted:
            return False
        mask = self._holders.get(block)
        return mask is not None and bool(mask & slot.hold)

    def engine_blocks(self, pod: str) -> list[int]:
        """The engine hashes the precise pod's events say it holds (each copy once)."""
        slot = self._pods.get(pod)
        if slot is None or slot.engine is None:
            return []
        return slot.engine.hashes()

    def engine_block_slices(self, pod: str) -> tuple[int, Iterator[list[int]]]:
        """How many engine blocks the precise pod holds, and their hashes in slices (see
        EngineMap.hash_slices): for readers that must not hold the loop for the whole map."""
        slot = self._pods.get(pod)
        if slot is None or slot.engine is None:
            return 0, iter(())
        return len(slot.engine), slot.engine.hash_slices()

    def store_engine_blocks(
        self, pod: str, engine_hashes: Sequence[int], keys: Sequence[BlockHash], per_block: int
    ) -> bool:
        """The precise pod stored these engine blocks; block i has our keys
        `keys[i*per_block:(i+1)*per_block]` (`keys` empty: unknown keys, stored as ()).
        Their predicted entries are confirmed. False (nothing done) unless the pod is
        precise."""
        slot = self._pods.get(pod)
        if slot is None or not slot.precise or slot.engine is None:
            return False
        add = slot.engine.add
        holders = self._holders
        holders_of = holders.get
        pop_predicted = slot.predicted.pop
        bit = slot.hold
        if keys and per_block == 1:  # the common case: one key per engine block
            # A block whose key the pod does not hold is new to it: no copy to look for.
            reported: list[int] = []  # positions of blocks whose key was reported already
            for i, key in enumerate(keys):
                mask = holders_of(key)
                if mask is None:
                    holders[key] = bit
                elif not mask & bit:
                    holders[key] = mask | bit
                elif pop_predicted(key, None) is None:
                    reported.append(i)
                # else: a prediction this confirms, no record of it yet
            if not reported:
                slot.engine.add_new(engine_hashes, keys)
            else:
                skip = set(reported)
                new = [i for i in range(len(keys)) if i not in skip]
                slot.engine.add_new([engine_hashes[i] for i in new], [keys[i] for i in new])
                for i in reported:
                    if not add(engine_hashes[i], keys[i]):
                        self._extra_copy(slot, engine_hashes[i])  # the same block again
                    else:
                        self._share(slot, keys[i])
        else:
            for i, engine_hash in enumerate(engine_hashes):
                group = tuple(keys[i * per_block : (i + 1) * per_block])
                if not add(engine_hash, group):
                    self._extra_copy(slot, engine_hash)
                    continue
                for key in group:
                    mask = holders_of(key)
                    if mask is None:
                        holders[key] = bit
                    elif not mask & bit:
                        holders[key] = mask | bit
                    elif pop_predicted(key, None) is None:
                        self._share(slot, key)
        if len(slot.engine) > slot.capacity:
            self._bound_engine(slot)
        return True

    def open_predictions(self, pod: str) -> Iterator[list[BlockHash]]:
        """The blocks (prompt order) of each of the pod's predictions not yet released:
        requests in flight, newest first, then those in their TTL, newest first. Each
        list holds what its `record` predicted: the prompt's blocks the engine had not
        reported then (a subsequence of the prompt's blocks, its head first)."""
        slot = self._pods.get(pod)
        if slot is None or not slot.precise:
            return
        for prediction in reversed(self._by_token.values()):
            if prediction.slot is slot and prediction.keys:
                yield prediction.keys
        for _, prediction in reversed(self._expiring):
            if prediction.slot is slot and prediction.keys:
                yield prediction.keys

    def relearn_engine_block(self, pod: str, engine_hash: int, keys: Sequence[BlockHash]) -> bool:
        """The precise pod's engine holds the prefix `keys` (prompt order), `engine_hash`
        being its last block's, though no event of ours stored it (it predates a restart or
        a resync, or the capacity bound dropped it): `epp.prefix.precise` learnt it from a
        child's `BlockStored`. Kept as one engine block holding the keys the pod's events
        had not reported (its own keys, last, always): its removal drops them together,
        and a routed hit keeps it (CLOCK). False (nothing done) unless the pod is precise
        and the engine block is unknown or held with unknown keys."""
        slot = self._pods.get(pod)
        if slot is None or not slot.precise or slot.engine is None or not keys:
            return False
        held = slot.engine.get(engine_hash)
        if held:
            return False
        if held is not None:  # (): stored as the child of a parent we did not know
            slot.engine.pop(engine_hash)
        holders_of = self._holders.get
        hold = slot.hold
        predicted = slot.predicted
        group = [
            key
            for key in keys[:-1]
            if key in predicted or not (holders_of(key, 0) & hold)  # not reported
        ]
        group.append(keys[-1])
        return self.store_engine_blocks(pod, [engine_hash], group, len(group))

    def remove_engine_blocks(self, pod: str, engine_hashes: Iterable[int]) -> int:
        """The precise pod evicted these engine blocks; how many it was known to hold."""
        slot = self._pods.get(pod)
        if slot is None or not slot.precise or slot.engine is None:
            return 0
        holders = self._holders
        holders_of = holders.get
        hold, keep = slot.hold, ~slot.both
        copies = slot.extra_copies
        if not copies and not slot.shared:  # the common case: one loop in the map, one here
            popped = slot.engine.pop_many(engine_hashes)
        else:
            popped = []
            for engine_hash in engine_hashes:
                extra = copies.get(engine_hash) if copies else None
                if extra is None:
                    keys = slot.engine.pop(engine_hash)
                    if keys is not None:
                        popped.append(keys)
                    continue
                if extra > 1:
                    copies[engine_hash] = extra - 1  # type: ignore[index]
                else:
                    del copies[engine_hash]  # type: ignore[attr-defined]
                popped.append(())  # a copy went: the block stays
        shared = slot.shared
        for keys in popped:
            if isinstance(keys, int) and not shared:  # inline: the hot loop's common case
                mask = holders_of(keys)
                if mask is not None and mask & hold:
                    mask &= keep
                    if mask:
                        holders[keys] = mask
                    else:
                        del holders[keys]
            elif keys:
                self._clear_keys(keys, slot)
        return len(popped)

    @staticmethod
    def _extra_copy(slot: _Pod, engine_hash: int) -> None:
        copies = slot.extra_copies
        if copies is None:
            copies = slot.extra_copies = {}
        copies[engine_hash] = copies.get(engine_hash, 0) + 1

    # -- internals ----------------------------------------------------------------------

    def _slot(self, pod: str) -> _Pod:
        slot = self._pods.get(pod)
        if slot is None:
            if self._free_ids:
                pod_id = heapq.heappop(self._free_ids)
                self._names[pod_id] = pod
            else:
                pod_id = len(self._names)
                self._names.append(pod)
            slot = self._pods[pod] = _Pod(pod, pod_id, self.capacity(pod))
            self._hold_all |= slot.hold
        return slot

    def _clear_bit(self, block: BlockHash, slot: _Pod) -> None:
        """The pod no longer holds the block (its mark goes too)."""
        mask = self._holders.get(block)
        if mask is not None and mask & slot.hold:
            mask &= ~slot.both
            if mask:
                self._holders[block] = mask
            else:
                del self._holders[block]

    def _clear_keys(self, keys: EngineKeys, slot: _Pod) -> None:
        """The pod no longer holds an engine block with these keys."""
        for key in (keys,) if isinstance(keys, int) else keys:
            shared = slot.shared
            extra = shared.get(key) if shared else None
            if extra is None:
                self._clear_bit(key, slot)
            elif extra > 1:
                shared[key] = extra - 1  # type: ignore[index]
            else:
                del shared[key]  # type: ignore[attr-defined]

    @staticmethod
    def _share(slot: _Pod, key: BlockHash) -> None:
        shared = slot.shared
        if shared is None:
            shared = slot.shared = {}
        shared[key] = shared.get(key, 0) + 1

    def _clear(self, slot: _Pod) -> None:
        clear_bit = self._clear_bit
        for block in islice(slot.log, slot.log_pos, None):
            clear_bit(block, slot)
        slot.shared = None
        if slot.engine is not None:
            for keys in slot.engine.values():
                self._clear_keys(keys, slot)
            slot.engine = self.engine_map(slot.capacity)
        for block in slot.predicted:
            clear_bit(block, slot)
        slot.log = _new_log()
        slot.log_pos = slot.count = 0
        slot.extra_copies = None
        slot.predicted = {}
        slot.predicted_churn = 0

    def _evict_lru(self, slot: _Pod) -> None:
        """CLOCK: from the front of the queue, a marked block loses its mark and goes to
        the back; an unmarked one is evicted; until the pod is within its capacity."""
        excess = slot.count - slot.capacity
        if excess <= 0:
            return
        holders = self._holders
        holders_of = holders.get
        hold, mark = slot.hold, slot.mark
        log = slot.log
        pos = slot.log_pos
        while excess > 0:
            block = log[pos]
            pos += 1
            mask = holders_of(block)
            if mask is None or not mask & hold:
                continue  # not held (cannot happen: each held block is queued once)
            if mask & mark:
                mask ^= mark
                holders[block] = hold if mask == hold else mask
                log.append(block)  # a second chance: to the back
                continue
            mask ^= hold
            if mask:
                holders[block] = mask
            else:
                del holders[block]
            excess -= 1
        slot.count = slot.capacity
        if pos > 1024 and pos * 2 > len(log):
            del log[:pos]  # the consumed front: memmove of the rest, once per half turn
            pos = 0
        slot.log_pos = pos

    def _predict(
        self, slot: _Pod, hashes: Sequence[BlockHash], now: float, token: str | None
    ) -> None:
        seq = self._seq = self._seq + 1
        created = (seq << _COUNT_BITS) | 1
        predicted = slot.predicted
        predicted_of = predicted.get
        holders = self._holders
        holders_of = holders.get
        bit, mark, both = slot.hold, slot.mark, slot.both
        fresh: list[BlockHash] = []
        hit = True  # still within the prefix the pod holds (what this decision reuses)
        for block in hashes:
            value = predicted_of(block)
            if value is None:
                mask = holders_of(block)
                if mask is None:
                    holders[block] = bit
                elif mask & bit:
                    # The engine said it holds it: nothing to predict. A hit uses it: the
                    # mark keeps it through the capacity bound's next turn (CLOCK).
                    if hit and not mask & mark:
                        # The pod's own int when it alone holds it: no int object per key.
                        holders[block] = both if mask == bit else mask | mark
                    continue
                else:
                    holders[block] = mask | bit
                predicted[block] = created
                hit = False
            else:
                predicted[block] = value + 1  # one more prediction holds it
            fresh.append(block)
        if not fresh:
            return
        if token is None:
            prediction = _Prediction(slot, fresh, seq, now + self.predicted_ttl_s, None)
            self._expiring.append((prediction.deadline, prediction))
        else:
            if token in self._by_token:  # one token recorded twice: the first one ends
                self.completed(token, now)
            prediction = _Prediction(slot, fresh, seq, now + self.predicted_max_s, token)
            self._in_flight.append(prediction)
            self._by_token[token] = prediction
        if len(predicted) > slot.capacity:
            self._bound_predicted(slot)

    def _bound_predicted(self, slot: _Pod) -> None:
        excess = len(slot.predicted) - slot.capacity
        if excess > 0:
            predicted = slot.predicted
            for block in list(islice(predicted, excess)):  # the oldest predictions
                del predicted[block]
                self._clear_bit(block, slot)

    def _bound_engine(self, slot: _Pod) -> None:
        # Removals come from the engine, so this bound is a safety net. It drops a slack of
        # 1/32 more than needed at once, so that it does not run for every block stored.
        engine = slot.engine
        if engine is None:
            return
        excess = len(engine) - slot.capacity
        if excess > 0:
            excess += slot.capacity >> 5
            for keys in engine.pop_oldest(excess, self._used_since(slot)):
                self._clear_keys(keys, slot)
            self.precise_capacity_evictions += excess

    def _used_since(self, slot: _Pod) -> Callable[[EngineKeys], bool]:
        """For the capacity bound of a precise pod: whether a routed hit used the engine
        block since its last turn (the pod's mark bit on any of its keys, set by
        `_predict`), clearing the mark."""
        holders = self._holders
        hold, mark, both = slot.hold, slot.mark, slot.both

        def used(keys: EngineKeys) -> bool:
            if isinstance(keys, int):
                mask = holders.get(keys)
                if mask is not None and mask & mark:
                    holders[keys] = hold if mask == both else mask ^ mark
                    return True
                return False
            marked = False
            for key in keys:
                mask = holders.get(key)
                if mask is not None and mask & mark:
                    holders[key] = hold if mask == both else mask ^ mark
                    marked = True
            return marked

        return used
