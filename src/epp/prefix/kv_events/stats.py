"""The KV-event problem counters and their rate-limited warning, shared by the decoder, the
precise index and the subscribers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("epp.kv_events")

# Every reason counted; a metrics module exports them as one counter with a `reason`
# label (a fixed set: never a value taken from the input).
REASONS = (
    "batches",  # batches decoded (some of their events may have been dropped)
    "events",  # events kept
    "malformed_payload",  # not msgpack, or not [ts, events, rank]
    "oversized_payload",  # payload over max_payload_bytes: refused whole
    "oversized_batch",  # more events than max_events: refused whole
    "invalid_event",  # an event breaking the rules: dropped
    "unknown_event_type",  # a type we do not know: dropped
    "bytes_hashes",  # hashes sent as bytes (accepted; counted per event)
    "positional_layout",  # batches in the pre-0.26 positional layout (accepted)
    "malformed_frames",  # a ZMQ message that is not [topic, seq(8 bytes), payload]
    "unknown_pod",  # events for a pod the index does not follow: dropped
    "blocks_stored",  # engine blocks stored
    "blocks_removed",  # engine blocks removed that the index held
    "unknown_removals",  # engine blocks removed that the index did not hold
    "all_blocks_cleared",
    "unknown_parent",  # BlockStored whose parent is unknown: kept, unmatchable
    "relearned_blocks",  # blocks held out of our sight, learnt from a child's parent
    "relearn_ambiguous",  # an unknown parent two open predictions placed differently
    "ignored_medium",  # blocks on CPU / disk tiers: not in the GPU cache the router scores
    "ignored_group",  # blocks of a KV cache group that is not full attention
    "unsupported_block_size",  # engine block size not a multiple of prefix.block_size
    "opaque_extra_keys",  # blocks with extra keys we cannot reproduce (multimodal)
    # the subscriber (epp.datalayer.kv_subscriber)
    "gaps",  # sequence gaps (lost batches)
    "publisher_restarts",  # sequence back, a new start time, or the pod's counters reset
    "restart_drops_skipped",  # a new start time after the entries were rebuilt from it: kept
    "resyncs",  # full resyncs: entries dropped, rebuilt from the replay buffer
    "resync_failures",  # a replay that did not answer or did not cover: entries dropped
    "resync_partial",  # the replay buffer no longer reached back far enough
    "probe_failed",  # the idle probe of the replay socket did not answer
    "disconnects",  # the publisher's connection went away: entries dropped
    "subscriber_error",  # an unexpected error in a subscriber cycle (logged)
)


@dataclass(slots=True)
class KvEventStats:
    """Counters (reason -> count) and a rate-limited warning log, shared by the decoder,
    the precise index and the subscribers. No Prometheus here: a metrics module reads
    `counts` (and `KvEventSubscriber` states) when it renders."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    log_burst: float = 10.0
    log_per_second: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, list[float]] = field(default_factory=dict)  # reason -> [tokens, at]
    suppressed: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def problem(self, reason: str, n: int = 1, **fields: Any) -> None:
        """Count `n` of `reason` and log a warning, unless that reason is over its budget
        (`log_burst` lines, refilled at `log_per_second`)."""
        self.counts[reason] = self.counts.get(reason, 0) + n
        now = self.clock()
        bucket = self._buckets.get(reason)
        if bucket is None:
            bucket = self._buckets[reason] = [self.log_burst, now]
        else:
            bucket[0] = min(self.log_burst, bucket[0] + (now - bucket[1]) * self.log_per_second)
            bucket[1] = now
        if bucket[0] < 1.0:
            self.suppressed[reason] = self.suppressed.get(reason, 0) + 1
            return
        bucket[0] -= 1.0
        dropped = self.suppressed.pop(reason, 0)
        if dropped:
            fields["suppressed"] = dropped
        log.warning("kv_event_problem", reason=reason, count=n, **fields)
