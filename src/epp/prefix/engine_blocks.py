"""Precise mode's reported entries: the blocks a pod's engine says it stored and evicted.

vLLM's KV events (applied by `epp.prefix.precise`) name engine blocks by the engine's own
hash. Each is kept in the pod's `EngineMap` under that hash with the router's key(s) for
it, so that an eviction names what to forget. A stored block confirms the pod's predicted
entries of its keys (`epp.prefix.predictions`): they become reported ones.

Invariants, per pod:
- a key is held as reported while at least one of the pod's engine blocks carries it: the
  carriers beyond the first are counted in `PodBlocks.shared`, and removing a carrier
  clears the pod's bit only when none is left;
- an engine hash stored again while held is a copy (`PodBlocks.extra_copies`): its removal
  takes a copy, the block stays;
- reported and predicted keys are disjoint (a stored key's prediction is popped; a
  reported key is never predicted).

The capacity bounds the engine blocks kept (counted in the engine's blocks): a safety net
for removals that never came. The bound follows use, not insertion: a routed hit sets the
pod's mark bit on the reported keys it used (`Predictions`), and the engine map's CLOCK
gives a marked block a second chance. A system prompt stored once and then only hit (a hit
stores nothing) stays while it is hit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from epp.prefix.engine_map import EngineKeys
from epp.prefix.hashing import BlockHash
from epp.prefix.holders import Holders
from epp.prefix.pod_blocks import PodBlocks


class EngineBlocks:
    """Every precise pod's engine blocks (`PodBlocks.engine`, created by `PrefixIndex`)."""

    def __init__(self, holders: Holders) -> None:
        self._holders = holders
        # Engine blocks dropped by the capacity bound (their removal events were lost, or
        # the bound is below the pod's real KV size).
        self.capacity_evictions = 0

    def store(
        self,
        slot: PodBlocks,
        engine_hashes: Sequence[int],
        keys: Sequence[BlockHash],
        per_block: int,
    ) -> None:
        """The pod stored these engine blocks; block i has our keys
        `keys[i*per_block:(i+1)*per_block]` (`keys` empty: unknown keys, stored as ())."""
        if keys and per_block == 1:
            self._store_one_key_each(slot, engine_hashes, keys)
        else:
            self._store_groups(slot, engine_hashes, keys, per_block)
        if len(slot.engine or ()) > slot.capacity:
            self.bound(slot)

    def _store_one_key_each(
        self, slot: PodBlocks, engine_hashes: Sequence[int], keys: Sequence[BlockHash]
    ) -> None:
        """The common case. A block whose key the pod does not hold as reported is new to
        it (no copy to look for): one `add_new` for all of them."""
        engine = slot.engine
        assert engine is not None
        bits = self._holders.bits
        holders_of = bits.get
        pop_predicted = slot.predicted.pop
        hold = slot.hold
        reported: list[int] = []  # positions of blocks whose key was reported already
        for i, key in enumerate(keys):
            mask = holders_of(key)
            if mask is None:
                bits[key] = hold
            elif not mask & hold:
                bits[key] = mask | hold
            elif pop_predicted(key, None) is None:
                reported.append(i)
            # else: a prediction this confirms
        if not reported:
            engine.add_new(engine_hashes, keys)
            return
        skip = set(reported)
        new = [i for i in range(len(keys)) if i not in skip]
        engine.add_new([engine_hashes[i] for i in new], [keys[i] for i in new])
        for i in reported:
            if engine.add(engine_hashes[i], keys[i]):
                _add_carrier(slot, keys[i])  # another carrier of a reported key
            else:
                _add_copy(slot, engine_hashes[i])  # the same block again

    def _store_groups(
        self,
        slot: PodBlocks,
        engine_hashes: Sequence[int],
        keys: Sequence[BlockHash],
        per_block: int,
    ) -> None:
        """Engine blocks of several of our keys each (or of unknown keys: ())."""
        engine = slot.engine
        assert engine is not None
        bits = self._holders.bits
        holders_of = bits.get
        pop_predicted = slot.predicted.pop
        hold = slot.hold
        for i, engine_hash in enumerate(engine_hashes):
            group = tuple(keys[i * per_block : (i + 1) * per_block])
            if not engine.add(engine_hash, group):
                _add_copy(slot, engine_hash)
                continue
            for key in group:
                mask = holders_of(key)
                if mask is None:
                    bits[key] = hold
                elif not mask & hold:
                    bits[key] = mask | hold
                elif pop_predicted(key, None) is None:
                    _add_carrier(slot, key)

    def remove(self, slot: PodBlocks, engine_hashes: Iterable[int]) -> int:
        """The pod evicted these engine blocks; how many it was known to hold."""
        engine = slot.engine
        assert engine is not None
        if slot.extra_copies or slot.shared:
            popped = self._pop_copies_first(slot, engine_hashes)
            for keys in popped:
                if keys:
                    self.forget_keys(keys, slot)
            return len(popped)
        # The common case, one loop in the map and one here: no copy, no shared key.
        popped = engine.pop_many(engine_hashes)
        bits = self._holders.bits
        holders_of = bits.get
        hold, keep = slot.hold, ~slot.both
        for keys in popped:
            if isinstance(keys, int):
                mask = holders_of(keys)
                if mask is not None and mask & hold:
                    mask &= keep
                    if mask:
                        bits[keys] = mask
                    else:
                        del bits[keys]
            elif keys:
                self.forget_keys(keys, slot)
        return len(popped)

    @staticmethod
    def _pop_copies_first(slot: PodBlocks, engine_hashes: Iterable[int]) -> list[EngineKeys]:
        """Pop each engine block, or one copy of it while it has extra copies (then ():
        the block stays). The keys of what was popped."""
        engine = slot.engine
        assert engine is not None
        copies = slot.extra_copies
        popped: list[EngineKeys] = []
        for engine_hash in engine_hashes:
            extra = copies.get(engine_hash) if copies else None
            if extra is None:
                keys = engine.pop(engine_hash)
                if keys is not None:
                    popped.append(keys)
                continue
            if extra > 1:
                copies[engine_hash] = extra - 1  # type: ignore[index]
            else:
                del copies[engine_hash]  # type: ignore[union-attr]
            popped.append(())
        return popped

    def relearn(self, slot: PodBlocks, engine_hash: int, keys: Sequence[BlockHash]) -> bool:
        """See `PrefixIndex.relearn_engine_block`."""
        engine = slot.engine
        if engine is None or not keys:
            return False
        held = engine.get(engine_hash)
        if held:
            return False
        if held is not None:  # (): stored as the child of a parent we did not know
            engine.pop(engine_hash)
        holders_of = self._holders.bits.get
        hold = slot.hold
        predicted = slot.predicted
        group = [
            key
            for key in keys[:-1]
            if key in predicted or not (holders_of(key, 0) & hold)  # not reported
        ]
        group.append(keys[-1])
        self.store(slot, [engine_hash], group, len(group))
        return True

    def forget_keys(self, keys: EngineKeys, slot: PodBlocks) -> None:
        """One of the pod's engine blocks, carrying these keys, is gone: each key the pod
        holds no more (no other engine block carries it) loses the pod's bits."""
        shared = slot.shared
        drop = self._holders.drop
        for key in (keys,) if isinstance(keys, int) else keys:
            extra = shared.get(key) if shared else None
            if extra is None:
                drop(key, slot.hold, slot.both)
            elif extra > 1:
                shared[key] = extra - 1  # type: ignore[index]
            else:
                del shared[key]  # type: ignore[union-attr]

    def forget(self, slot: PodBlocks) -> None:
        """All the pod's engine blocks go (its bits on their keys too)."""
        slot.shared = None  # every carrier goes: no count to keep
        slot.extra_copies = None
        if slot.engine is not None:
            for keys in slot.engine.values():
                self.forget_keys(keys, slot)

    def bound(self, slot: PodBlocks) -> None:
        """Bring the pod's engine blocks back within its capacity, the least recently used
        first, with a slack of a 32nd more so that the bound does not run for every block
        stored."""
        engine = slot.engine
        if engine is None:
            return
        excess = len(engine) - slot.capacity
        if excess > 0:
            excess += slot.capacity >> 5
            for keys in engine.pop_oldest(excess, self._used_since(slot)):
                self.forget_keys(keys, slot)
            self.capacity_evictions += excess

    def _used_since(self, slot: PodBlocks) -> Callable[[EngineKeys], bool]:
        """For the capacity bound: whether a routed hit used the engine block since its
        last turn (the pod's mark bit on any of its keys), clearing that mark."""
        bits = self._holders.bits
        hold, mark, both = slot.hold, slot.mark, slot.both

        def unmark(key: BlockHash) -> bool:
            mask = bits.get(key)
            if mask is not None and mask & mark:
                bits[key] = hold if mask == both else mask ^ mark
                return True
            return False

        def used(keys: EngineKeys) -> bool:
            if isinstance(keys, int):
                return unmark(keys)
            return sum(map(unmark, keys)) > 0  # every key's mark is cleared

        return used


def _add_copy(slot: PodBlocks, engine_hash: int) -> None:
    copies = slot.extra_copies
    if copies is None:
        copies = slot.extra_copies = {}
    copies[engine_hash] = copies.get(engine_hash, 0) + 1


def _add_carrier(slot: PodBlocks, key: BlockHash) -> None:
    shared = slot.shared
    if shared is None:
        shared = slot.shared = {}
    shared[key] = shared.get(key, 0) + 1
