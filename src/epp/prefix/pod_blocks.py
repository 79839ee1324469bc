"""One pod's blocks in the prefix index: its bits in `epp.prefix.holders.Holders` and the
state of its mode. Only the fields of the pod's mode are in use; `PrefixIndex` clears them
all when the mode changes or the pod's cache is reset."""

from __future__ import annotations

from array import array

from epp.prefix.engine_map import EngineMap
from epp.prefix.hashing import BlockHash


def new_log() -> array | list[BlockHash]:
    """An empty CLOCK queue: 8-byte unsigned hashes (a list once a hash does not fit)."""
    return array("Q")


class PodBlocks:
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
        "pod_id",
        "precise",
        "predicted",
        "predicted_churn",
        "shared",
    )

    def __init__(self, pod_id: int, capacity: int) -> None:
        self.pod_id = pod_id
        self.hold = 1 << (2 * pod_id)  # the pod holds the block
        self.mark = self.hold << 1  # approximate: recorded again; precise: used by a hit
        self.both = self.hold | self.mark
        self.capacity = capacity
        self.precise = False
        # Approximate (epp.prefix.approximate): the CLOCK queue, `log[log_pos:]`, each held
        # block once, and its size.
        self.log: array | list[BlockHash] = new_log()
        self.log_pos = 0
        self.count = 0
        # Precise, reported (epp.prefix.engine_blocks): engine hash -> our key(s) (created
        # when the pod turns precise); engine hashes stored more than once (an engine may
        # cache one hash twice) -> the number of extra copies; keys that more than one of
        # the pod's engine blocks carry -> the number of extra carriers (the key stays held
        # until its last carrier goes).
        self.engine: EngineMap | None = None
        self.extra_copies: dict[int, int] | None = None
        self.shared: dict[BlockHash, int] | None = None
        # Precise, predicted (epp.prefix.predictions): our key -> (creator's sequence
        # number, live predictions holding it) of an entry no event confirmed yet. Disjoint
        # from the keys the engine blocks carry.
        self.predicted: dict[BlockHash, int] = {}
        self.predicted_churn = 0

    def size(self) -> int:
        """Blocks held: approximate, ours; precise, engine blocks plus predicted entries."""
        if self.precise:
            return len(self.engine or ()) + len(self.predicted)
        return self.count
