"""What each pod holds in its KV cache, as far as the router knows.

A map from chained block hash to the pods holding that block. Because a block's hash
chains every block before it, one hash names one whole prefix: the map is a prefix tree
flattened into its nodes, and walking a request's hashes in order is walking the tree
from the root. Lookup stops at the first block nobody holds, so its cost is bounded by
the length of the longest cached prefix, not by the size of the index.

Each pod's blocks sit in an LRU bounded by a capacity (the pod's real KV size when known),
so the index cannot grow without bound and forgets what the pod must have evicted too.

No single request takes over a pod's memory: `record` keeps at most
`max_record_fraction` of the pod's capacity (at least one block) from the prompt's head
and drops the tail. A huge prompt therefore evicts at most that fraction of what the index
held for the pod, and its head (the part other requests can share) is what is kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from epp.prefix.hashing import BlockHash

if TYPE_CHECKING:
    from epp.config import PrefixConfig


DEFAULT_MAX_RECORD_FRACTION = 0.5


class PrefixIndex:
    def __init__(
        self, capacity_per_pod: int, max_record_fraction: float = DEFAULT_MAX_RECORD_FRACTION
    ) -> None:
        if capacity_per_pod < 1:
            raise ValueError("capacity_per_pod must be at least 1")
        if not 0.0 < max_record_fraction <= 1.0:
            raise ValueError("max_record_fraction must be in (0, 1]")
        self.default_capacity = capacity_per_pod
        self.max_record_fraction = max_record_fraction
        self._holders: dict[BlockHash, set[str]] = {}
        self._lru: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: PrefixConfig) -> PrefixIndex:
        return cls(config.capacity_per_pod, config.max_record_fraction)

    def record_limit(self, pod: str) -> int:
        """The most blocks one `record` call keeps for the pod (its prompt's head)."""
        return max(1, int(self.capacity(pod) * self.max_record_fraction))

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per pod, how many blocks from the start of `hashes` it holds without a gap."""
        holders_of = self._holders.get
        matched: dict[str, int] = {}
        active: set[str] | None = None
        depth = 0
        for depth, block in enumerate(hashes):
            holders = holders_of(block)
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

    def record(self, pod: str, hashes: Sequence[BlockHash]) -> None:
        """The pod now holds these blocks (it served, or reported, this prefix).

        Only the first `record_limit(pod)` blocks are kept: one prompt never pushes out
        more than that share of what the index remembers for the pod."""
        limit = self.record_limit(pod)
        if len(hashes) > limit:
            hashes = hashes[:limit]
        lru = self._lru.get(pod)
        if lru is None:
            lru = self._lru[pod] = OrderedDict()
        holders = self._holders
        # Touch the last block first, so the prefix's head is the most recently used: an
        # engine evicts a sequence's tail before its head, and so must the index.
        for block in reversed(hashes):
            if block in lru:
                lru.move_to_end(block)
            else:
                lru[block] = None
                pods = holders.get(block)
                if pods is None:
                    holders[block] = {pod}
                else:
                    pods.add(pod)
        self._evict(pod, lru)

    def set_capacity(self, pod: str, capacity: int) -> None:
        capacity = max(1, min(capacity, self.default_capacity))
        if self._capacity.get(pod) != capacity:
            self._capacity[pod] = capacity
            lru = self._lru.get(pod)
            if lru is not None:
                self._evict(pod, lru)

    def remove_pod(self, pod: str) -> None:
        for block in self._lru.pop(pod, ()):
            self._drop_holder(block, pod)
        self._capacity.pop(pod, None)

    def clear_pod(self, pod: str) -> None:
        """The pod's cache was reset (engine restart): forget its blocks, keep its capacity."""
        for block in self._lru.pop(pod, ()):
            self._drop_holder(block, pod)

    def blocks(self, pod: str) -> int:
        return len(self._lru.get(pod, ()))

    def capacity(self, pod: str) -> int:
        return self._capacity.get(pod, self.default_capacity)

    @property
    def nodes(self) -> int:
        """Distinct prefixes (tree nodes) held by at least one pod."""
        return len(self._holders)

    def _evict(self, pod: str, lru: OrderedDict[BlockHash, None]) -> None:
        excess = len(lru) - self._capacity.get(pod, self.default_capacity)
        for _ in range(excess):
            block, _ = lru.popitem(last=False)
            self._drop_holder(block, pod)

    def _drop_holder(self, block: BlockHash, pod: str) -> None:
        pods = self._holders.get(block)
        if pods is not None:
            pods.discard(pod)
            if not pods:
                del self._holders[block]
