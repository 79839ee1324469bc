"""The prefix tree: which pods hold each block, one int of bits per block.

A block's hash chains every block before it, so one hash names one whole prefix: a map from
hash to holders is a prefix tree flattened into its nodes, and walking a request's hashes
in order walks the tree from the root. Lookup stops at the first block nobody holds, so its
cost is bounded by the length of the longest cached prefix, not by the size of the index.

Pods are small integer ids, the lowest free one reused first. Pod i owns two bits of each
block's value: bit 2i, it holds the block, and bit 2i+1, its mark (approximate mode: the
block was recorded again since its CLOCK turn; precise mode: a routed hit used it since the
engine bound's turn). A value is never 0: a block nobody holds has no entry. A block held
by one pod costs one dict entry whose value is that pod's shared int object.

Writers of a pod's bits: the component of its mode only. An approximate pod's are written
by `epp.prefix.approximate`; a precise pod's by `epp.prefix.engine_blocks` (keys its engine
reported) and `epp.prefix.predictions` (keys predicted and not yet reported), two disjoint
sets of keys. `PrefixIndex` clears them all when the pod's blocks are forgotten.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from epp.kernels import PREFIX as COMPILED
from epp.prefix.hashing import BlockHash


class Holders:
    """Block -> pod bits, and the pod ids behind the bits."""

    __slots__ = ("_free_ids", "bits", "hold_all", "names")

    def __init__(self) -> None:
        self.bits: dict[BlockHash, int] = {}
        # The hold bit of every id handed out: masks the marks out of a block's value. A
        # removed pod's bits are cleared from every block before its id is freed, so its
        # bit left here matches nothing.
        self.hold_all = 0
        self.names: list[str | None] = []  # pod id -> name
        self._free_ids: list[int] = []  # a heap: the lowest id is reused first

    def add_pod(self, name: str) -> int:
        """A new pod's id (its bits are clear on every block)."""
        if self._free_ids:
            pod_id = heapq.heappop(self._free_ids)
            self.names[pod_id] = name
        else:
            pod_id = len(self.names)
            self.names.append(name)
        self.hold_all |= 1 << (2 * pod_id)
        return pod_id

    def remove_pod(self, pod_id: int) -> None:
        """Free the id of a pod whose bits were cleared from every block."""
        self.names[pod_id] = None
        heapq.heappush(self._free_ids, pod_id)

    def drop(self, block: BlockHash, hold: int, both: int) -> None:
        """The pod whose hold bit is `hold` (and `both`: with its mark) no longer holds the
        block; its mark goes too."""
        bits = self.bits
        mask = bits.get(block)
        if mask is not None and mask & hold:
            mask &= ~both
            if mask:
                bits[block] = mask
            else:
                del bits[block]

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per pod holding the first block, how many blocks from the start of `hashes` it
        holds without a gap: the walk keeps the pods still on the path as one int of hold
        bits, and a pod that drops out keeps the depth it reached."""
        if not hashes:
            return {}
        active = self.bits.get(hashes[0], 0) & self.hold_all
        if not active:
            return {}
        if COMPILED is None:
            return self.python_match(hashes, active)
        return COMPILED.match(self.bits, hashes, active, self.names)

    def python_match(self, hashes: Sequence[BlockHash], active: int) -> dict[str, int]:
        """`match` in pure Python (the twin of the compiled `walk`, epp.kernels),
        from the hold bits `active` of the pods holding the first block."""
        holders_of = self.bits.get
        names = self.names
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
