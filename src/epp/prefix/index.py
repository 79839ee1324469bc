"""What each pod holds in its KV cache, as far as the router knows.

`PrefixIndex` is the one way in (docs/architecture.md). It answers `match` from the prefix
tree of `epp.prefix.holders` and keeps each pod's blocks in one of two modes
(`set_precise`):

- **Approximate** (the default, `epp.prefix.approximate`): `record` says the router sent
  the pod this prefix, so the pod is assumed to hold it, bounded by the pod's capacity with
  CLOCK eviction. No single request takes over a pod's memory: `record` keeps at most
  `max_record_fraction` of the pod's capacity (at least one block) from the prompt's head.
- **Precise**: the pod's engine says what it stored and evicted (vLLM KV events, applied by
  `epp.prefix.precise`): reported entries, `epp.prefix.engine_blocks`. `record` then adds
  predicted entries for what the engine has not reported yet, released after the request
  ends (`epp.prefix.predictions`). A routed hit on reported blocks marks them, so the
  capacity bound on engine blocks keeps what is used.

Memory is what bounds a router's prefix index (docs/benchmarks/index.md): pods are small
integer ids and a block maps to one int of bits; the approximate queue is an array of
8-byte hashes per pod; a precise pod's engine map packs each engine block into a 16-byte
record (`epp.prefix.engine_map`); churning dicts are right-sized.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from epp.prefix import approximate
from epp.prefix.engine_blocks import EngineBlocks
from epp.prefix.engine_map import EngineKeys, EngineMap
from epp.prefix.hashing import BlockHash
from epp.prefix.holders import Holders
from epp.prefix.pod_blocks import PodBlocks, new_log
from epp.prefix.predictions import Predictions

if TYPE_CHECKING:
    from epp.config import PrefixConfig


DEFAULT_MAX_RECORD_FRACTION = 0.5
DEFAULT_PREDICTED_TTL_S = 2.0
DEFAULT_PREDICTED_MAX_S = 120.0


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
        self._clock = clock
        self._holders = Holders()
        self._predictions = Predictions(self._holders, predicted_ttl_s, predicted_max_s)
        self._engine_blocks = EngineBlocks(self._holders)
        self._pods: dict[str, PodBlocks] = {}
        self._capacity: dict[str, int] = {}  # set_capacity, kept while a pod has no blocks
        self._match_units: dict[str, int] = {}  # set_match_unit: precise pods, unit > 1

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

    @property
    def predicted_ttl_s(self) -> float:
        return self._predictions.ttl_s

    @predicted_ttl_s.setter
    def predicted_ttl_s(self, value: float) -> None:
        self._predictions.ttl_s = value

    @property
    def predicted_max_s(self) -> float:
        return self._predictions.max_s

    @predicted_max_s.setter
    def predicted_max_s(self, value: float) -> None:
        self._predictions.max_s = value

    @property
    def predictions_capped(self) -> int:
        """Predictions released at their deadline while their request was still open (its
        completion was lost, or the request outlived predicted_max_s)."""
        return self._predictions.capped

    @property
    def precise_capacity_evictions(self) -> int:
        """Engine blocks dropped by the capacity bound of a precise pod (their removal
        events were lost, or the bound is below the pod's real KV size)."""
        return self._engine_blocks.capacity_evictions

    # -- lookup ------------------------------------------------------------------------

    def record_limit(self, pod: str) -> int:
        """The most blocks one `record` call keeps for the pod (its prompt's head)."""
        return max(1, int(self.capacity(pod) * self.max_record_fraction))

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per pod, how many blocks from the start of `hashes` it holds without a gap; a
        precise pod's, in whole engine blocks (`set_match_unit`). Predictions whose time
        is up are released first."""
        self._predictions.expire_due(self._clock)
        matched = self._holders.match(hashes)
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

    # -- the router's view: record ------------------------------------------------------

    def record(
        self,
        pod: str,
        hashes: Sequence[BlockHash],
        now: float | None = None,
        token: str | None = None,
    ) -> None:
        """The router sent the pod this prefix (or a peer replica did).

        Approximate pod: it holds these blocks. Precise pod: predicted entries, unless an
        event confirms them, live until `predicted_ttl_s` after the request named by
        `token` ended (`completed(token)`), and at most `predicted_max_s` from `now`
        (default: the index's clock); without a token, `predicted_ttl_s` from `now`. Only
        the first `record_limit(pod)` blocks are kept: one prompt never pushes out more
        than that share of what the index remembers for the pod."""
        slot = self._slot(pod)
        limit = self.record_limit(pod)
        if len(hashes) > limit:
            hashes = hashes[:limit]
        if slot.precise:
            self._predictions.predict(slot, hashes, self._clock() if now is None else now, token)
        else:
            approximate.record(self._holders.bits, slot, hashes)

    def predict(self, pod: str, hashes: Sequence[BlockHash], now: float) -> None:
        """`record` at time `now` (the same for an approximate pod)."""
        self.record(pod, hashes, now)

    def completed(self, token: str, now: float) -> None:
        """The request recorded with `token` ended (answered, failed or cancelled): its
        predicted entries live `predicted_ttl_s` more, for the engine's events to arrive
        (never past their deadline). O(1); unknown tokens are ignored."""
        self._predictions.completed(token, now)

    def expire(self, now: float) -> int:
        """Release predictions whose time is up: the entries that no event confirmed and
        that no other live prediction holds are dropped; how many."""
        return self._predictions.expire(now)

    @property
    def predictions(self) -> int:
        """Predictions not yet released (requests in flight and their TTL after)."""
        return self._predictions.count()

    # -- pods ---------------------------------------------------------------------------

    def set_capacity(self, pod: str, capacity: int) -> None:
        capacity = max(1, min(capacity, self.default_capacity))
        if self._capacity.get(pod) == capacity:
            return
        self._capacity[pod] = capacity
        slot = self._pods.get(pod)
        if slot is None:
            return
        slot.capacity = capacity
        if not slot.precise:
            approximate.evict(self._holders.bits, slot)
            return
        if slot.engine is not None:
            slot.engine.resize(capacity)
        self._engine_blocks.bound(slot)
        self._predictions.bound(slot)

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
            self._holders.remove_pod(slot.pod_id)
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
        return len(self._holders.bits)

    @property
    def entries(self) -> int:
        """(block, pod) entries across all pods (as `blocks` counts them)."""
        return sum(slot.size() for slot in self._pods.values())

    def _slot(self, pod: str) -> PodBlocks:
        slot = self._pods.get(pod)
        if slot is None:
            pod_id = self._holders.add_pod(pod)
            slot = self._pods[pod] = PodBlocks(pod_id, self.capacity(pod))
        return slot

    def _clear(self, slot: PodBlocks) -> None:
        """Forget every block of the pod, in either mode (its bits are cleared)."""
        drop = self._holders.drop
        for block in islice(slot.log, slot.log_pos, None):
            drop(block, slot.hold, slot.both)
        slot.log = new_log()
        slot.log_pos = slot.count = 0
        if slot.engine is not None:
            self._engine_blocks.forget(slot)
            slot.engine = self.engine_map(slot.capacity)
        self._predictions.forget(slot)

    # -- precise mode: the engine's blocks -----------------------------------------------

    def _precise(self, pod: str) -> PodBlocks | None:
        slot = self._pods.get(pod)
        if slot is None or not slot.precise or slot.engine is None:
            return None
        return slot

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
        mask = self._holders.bits.get(block)
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
        slot = self._precise(pod)
        if slot is None:
            return False
        self._engine_blocks.store(slot, engine_hashes, keys, per_block)
        return True

    def open_predictions(self, pod: str) -> Iterator[list[BlockHash]]:
        """The blocks (prompt order) of each of the pod's predictions not yet released:
        requests in flight, newest first, then those in their TTL, newest first. Each
        list holds what its `record` predicted: the prompt's blocks the engine had not
        reported then (a subsequence of the prompt's blocks, its head first)."""
        slot = self._pods.get(pod)
        if slot is None or not slot.precise:
            return iter(())
        return self._predictions.open(slot)

    def relearn_engine_block(self, pod: str, engine_hash: int, keys: Sequence[BlockHash]) -> bool:
        """The precise pod's engine holds the prefix `keys` (prompt order), `engine_hash`
        being its last block's, though no event of ours stored it (it predates a restart or
        a resync, or the capacity bound dropped it): `epp.prefix.precise` learnt it from a
        child's `BlockStored`. Kept as one engine block holding the keys the pod's events
        had not reported (its own keys, last, always): its removal drops them together,
        and a routed hit keeps it (CLOCK). False (nothing done) unless the pod is precise
        and the engine block is unknown or held with unknown keys."""
        slot = self._precise(pod)
        return slot is not None and self._engine_blocks.relearn(slot, engine_hash, keys)

    def remove_engine_blocks(self, pod: str, engine_hashes: Iterable[int]) -> int:
        """The precise pod evicted these engine blocks; how many it was known to hold."""
        slot = self._precise(pod)
        return 0 if slot is None else self._engine_blocks.remove(slot, engine_hashes)
