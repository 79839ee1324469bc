"""The restructured prefix index (pod bits, a CLOCK queue of 8-byte hashes per pod) answers
exactly as a straightforward model of the same policy (a set of pods per block, a deque, a
set of held and of marked blocks per pod)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from epp.prefix.hashing import BlockHash
from epp.prefix.index import PrefixIndex


class ReferenceIndex:
    """CLOCK written the obvious way, as the oracle: blocks queue in the order first
    recorded (a prompt's tail first); recording a held block marks it; eviction takes the
    front: a marked block is unmarked and requeued, an unmarked one goes."""

    def __init__(self, capacity: int, fraction: float) -> None:
        self.default = capacity
        self.fraction = fraction
        self.holders: dict[int, set[str]] = {}
        self.queue: dict[str, deque[int]] = {}
        self.held: dict[str, set[int]] = {}
        self.marked: dict[str, set[int]] = {}
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
        queue = self.queue.setdefault(pod, deque())
        held = self.held.setdefault(pod, set())
        marked = self.marked.setdefault(pod, set())
        for block in reversed(hashes[:limit]):
            if block in held:
                marked.add(block)
            else:
                held.add(block)
                queue.append(block)
                self.holders.setdefault(block, set()).add(pod)
        self._evict(pod)

    def blocks(self, pod: str) -> int:
        return len(self.held.get(pod, ()))

    def set_capacity(self, pod: str, capacity: int) -> None:
        self.cap[pod] = max(1, min(capacity, self.default))
        self._evict(pod)

    def clear_pod(self, pod: str) -> None:
        for block in self.held.pop(pod, ()):
            self._drop(block, pod)
        self.queue.pop(pod, None)
        self.marked.pop(pod, None)

    def remove_pod(self, pod: str) -> None:
        self.clear_pod(pod)
        self.cap.pop(pod, None)

    def _evict(self, pod: str) -> None:
        held = self.held.get(pod)
        if held is None:
            return
        queue, marked = self.queue[pod], self.marked[pod]
        while len(held) > self.capacity(pod):
            block = queue.popleft()
            if block in marked:
                marked.discard(block)
                queue.append(block)
                continue
            held.discard(block)
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
            assert ours.blocks(pod) == ref.blocks(pod)
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
    index.record("a", [BlockHash(9)])  # evicts the unmarked oldest: the tail, 4
    assert index.match(blocks) == {"a": 3}
    index.clear_pod("a")
    assert index.nodes == 0


def test_the_queue_stays_exact_over_many_turns():
    index = PrefixIndex(10, max_record_fraction=1.0)
    ref = ReferenceIndex(10, 1.0)
    rng = random.Random(3)
    for _ in range(2000):
        block = [rng.randrange(30)]
        index.record("a", block)  # type: ignore[arg-type]
        ref.record("a", block)
    assert sorted(k for k in range(30) if index.match([BlockHash(k)])) == sorted(ref.held["a"])


def test_a_precise_pods_churned_engine_map_shrinks_and_stays_right():
    index = PrefixIndex(100_000)
    index.set_precise("a", True)
    engine = list(range(1, 20_001))
    index.store_engine_blocks("a", engine, [BlockHash(h * 7) for h in engine], 1)
    engine_map = index._pods["a"].engine
    assert engine_map is not None
    assert index.remove_engine_blocks("a", engine[:19_000]) == 19_000
    # The removed records' memory is given back: as small as a map that only ever held
    # what is left.
    fresh = PrefixIndex(100_000)
    fresh.set_precise("a", True)
    fresh.store_engine_blocks("a", engine[19_000:], [BlockHash(h * 7) for h in engine[19_000:]], 1)
    assert fresh._pods["a"].engine is not None
    assert engine_map.nbytes() <= fresh._pods["a"].engine.nbytes() * 1.25
    assert sorted(index.engine_blocks("a")) == engine[19_000:]
    assert index.match([BlockHash(19_001 * 7)]) == {"a": 1}
    assert index.match([BlockHash(7)]) == {}
