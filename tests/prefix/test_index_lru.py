"""The restructured prefix index (pod bitmasks, two-generation LRU) answers exactly as the
straightforward one it replaced (a set of pods per block, an OrderedDict LRU per pod)."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from epp.prefix.hashing import BlockHash
from epp.prefix.index import PrefixIndex


class ReferenceIndex:
    """The previous implementation (dict of sets + OrderedDict per pod), as the oracle."""

    def __init__(self, capacity: int, fraction: float) -> None:
        self.default = capacity
        self.fraction = fraction
        self.holders: dict[int, set[str]] = {}
        self.lru: dict[str, OrderedDict[int, None]] = {}
        self.cap: dict[str, int] = {}

    def capacity(self, pod: str) -> int:
        return self.cap.get(pod, self.default)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        matched: dict[str, int] = {}
        active: set[str] | None = None
        depth = 0
        for depth, block in enumerate(hashes):
            holders = self.holders.get(block)
            if not holders:
                break
            if active is None:
                active = set(holders)
            elif not active <= holders:
                survivors = active & holders
                for pod in active - survivors:
                    matched[pod] = depth
                active = survivors
                if not active:
                    break
        else:
            depth = len(hashes)
        for pod in active or ():
            matched[pod] = depth
        return matched

    def record(self, pod: str, hashes: Sequence[int]) -> None:
        limit = max(1, int(self.capacity(pod) * self.fraction))
        lru = self.lru.setdefault(pod, OrderedDict())
        for block in reversed(hashes[:limit]):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                self.holders.setdefault(block, set()).add(pod)
        self._evict(pod)

    def set_capacity(self, pod: str, capacity: int) -> None:
        self.cap[pod] = max(1, min(capacity, self.default))
        self._evict(pod)

    def clear_pod(self, pod: str) -> None:
        for block in self.lru.pop(pod, ()):
            self._drop(block, pod)

    def remove_pod(self, pod: str) -> None:
        self.clear_pod(pod)
        self.cap.pop(pod, None)

    def _evict(self, pod: str) -> None:
        lru = self.lru.get(pod)
        while lru is not None and len(lru) > self.capacity(pod):
            block, _ = lru.popitem(last=False)
            self._drop(block, pod)

    def _drop(self, block: int, pod: str) -> None:
        pods = self.holders[block]
        pods.discard(pod)
        if not pods:
            del self.holders[block]


def test_random_operations_answer_as_the_reference():
    rng = random.Random(42)
    pods = [f"pod-{i}" for i in range(70)]  # more than 64: masks beyond one machine word
    prefixes = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    for capacity, fraction in ((50, 0.5), (200, 1.0), (7, 0.3)):
        ours = PrefixIndex(capacity, fraction)
        ref = ReferenceIndex(capacity, fraction)
        for step in range(6000):
            op = rng.random()
            pod = rng.choice(pods)
            prefix = rng.choice(prefixes)
            cut = prefix[: rng.randrange(1, len(prefix) + 1)]
            if op < 0.75:
                ours.record(pod, cut)  # type: ignore[arg-type]
                ref.record(pod, cut)
            elif op < 0.80:
                size = rng.randrange(1, capacity * 2)
                ours.set_capacity(pod, size)
                ref.set_capacity(pod, size)
            elif op < 0.82:
                ours.clear_pod(pod)
                ref.clear_pod(pod)
            elif op < 0.84:
                ours.remove_pod(pod)
                ref.remove_pod(pod)
            else:
                assert ours.match(cut) == ref.match(cut), step  # type: ignore[arg-type]
        for prefix in prefixes:
            assert ours.match(prefix) == ref.match(prefix)  # type: ignore[arg-type]
        for pod in pods:
            assert ours.blocks(pod) == len(ref.lru.get(pod, ()))
        assert ours.nodes == len(ref.holders)


def test_a_removed_pods_id_is_reused_without_its_blocks():
    index = PrefixIndex(100)
    index.record("a", [BlockHash(1), BlockHash(2)])
    index.record("b", [BlockHash(1)])
    index.remove_pod("a")
    index.record("c", [BlockHash(3)])  # takes a's id
    assert index.match([BlockHash(1), BlockHash(2)]) == {"b": 1}
    assert index.match([BlockHash(3)]) == {"c": 1}


def test_hashes_outside_64_bits_still_work():
    index = PrefixIndex(4, max_record_fraction=1.0)
    blocks = [BlockHash(-5), BlockHash(2**70), BlockHash(3), BlockHash(4)]
    index.record("a", blocks)
    index.record("a", [BlockHash(9)])  # the old generation holds the first four: a list
    assert index.match(blocks) == {"a": 3}
    index.clear_pod("a")
    assert index.nodes == 0


def test_the_lru_stays_exact_over_many_generations():
    index = PrefixIndex(10, max_record_fraction=1.0)
    ref = ReferenceIndex(10, 1.0)
    rng = random.Random(3)
    for _ in range(2000):
        block = [rng.randrange(30)]
        index.record("a", block)  # type: ignore[arg-type]
        ref.record("a", block)
    assert sorted(k for k in range(30) if index.match([BlockHash(k)])) == sorted(ref.lru["a"])
