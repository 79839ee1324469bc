"""The subscriber's contracts and bookkeeping: where events go (`KvEventSink`), its
settings, the per-pod state a metrics module or /debug page shows, and the fingerprints
of the batches applied lately (a copy of one is not a restart)."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from epp.prefix.kv_events import DecodeLimits, KvEvent

if TYPE_CHECKING:
    from epp.config import KvEventsConfig

Mode = Literal["auto", "precise"]


class KvEventSink(Protocol):
    """Where a subscriber sends a pod's events: `epp.prefix.precise.PreciseIndex`."""

    def attach(self, pod: str, model: str | None) -> None: ...

    def detach(self, pod: str) -> None: ...

    def reset_pod(self, pod: str) -> None: ...

    def apply_events(self, pod: str, events: Sequence[KvEvent]) -> int: ...


@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    resync_timeout_s: float = 2.0  # a replay that sends nothing for this long failed
    replay_max_s: float = 30.0  # a whole replay longer than this failed
    probe_interval_s: float = 5.0  # idle: ask the replay socket what came after the last
    fallback_after_s: float = 10.0  # auto: disconnected this long -> approximate
    reconnect_ivl_s: float = 0.1
    reconnect_max_s: float = 2.0
    slice_ms: float = 2.0  # apply at most about this long, then yield to the loop
    slice_blocks: int = 512  # and cut events into pieces of at most this many blocks
    rcvhwm: int = 10_000  # live messages ZMQ queues while a replay runs (then: a gap)
    replay_retry_s: float = 60.0  # a replay socket that did not answer is left alone this long
    # A resync that began this long after a new start time was answered by the new process
    # (pod and EPP clocks ~1 s apart, the start time ~1 s early, 1 s to spare: see the
    # package docstring).
    restart_margin_s: float = 3.0
    # Read and decode the live socket in the receiver thread shared by every followed
    # pod (hub.py); False: on the loop (`epp bench loop` compares the two).
    receive_in_thread: bool = True
    limits: DecodeLimits = field(default_factory=DecodeLimits)

    @classmethod
    def from_config(cls, config: KvEventsConfig) -> SubscriberSettings:
        return cls(
            resync_timeout_s=config.resync_timeout_s,
            restart_margin_s=config.restart_margin_s,
            probe_interval_s=config.probe_interval_s,
            fallback_after_s=config.fallback_after_s,
            reconnect_max_s=config.reconnect_max_s,
            slice_ms=config.slice_ms,
            limits=DecodeLimits(max_payload_bytes=config.max_payload_bytes),
        )

    @property
    def max_message_bytes(self) -> int:
        """ZMQ's own hard cap (it drops the connection): above the decoder's limit, which
        counts and refuses what is between the two."""
        return self.limits.max_payload_bytes * 2 + 65_536


@dataclass(slots=True)
class SubscriberState:
    """What a metrics module or /debug page may show per pod."""

    connected: bool = False
    attached: bool = False  # precise
    next_seq: int | None = None  # the next sequence number expected
    messages: int = 0  # live messages applied
    replayed: int = 0  # batches applied from replays
    duplicates: int = 0  # live messages a replay had already applied
    gaps: int = 0  # sequence gaps seen
    restarts: int = 0  # publisher restarts detected (sequence back, start time, reset)
    restart_drops_skipped: int = 0  # new start times the entries were already rebuilt after
    resyncs: int = 0  # full resyncs (drop + replay from 0)
    replay_failures: int = 0  # replays that timed out, broke, or did not cover the gap
    disconnects: int = 0
    # Connection attempts ZMQ retried (nothing listening): read-only, the positive signal
    # that the subscriber is trying while no publisher answers.
    connect_retries: int = 0
    errors: int = 0  # unexpected errors in a cycle (logged)
    last_message_at: float | None = None
    connected_at: float | None = None
    disconnected_at: float | None = None
    # Wall clock (time.time) at which the last full resync began, once it finished without
    # failure; None while anything since may have put the entries in doubt.
    resynced_at: float | None = None


RECENT_BATCHES = 64  # batches whose fingerprints are kept to recognise copies


class RecentBatches:
    """seq -> (length, CRC-32) of the last `RECENT_BATCHES` batches applied. A restarted
    publisher's batch of the same sequence number differs (its timestamp, at least), so a
    live batch whose fingerprint matches is a copy, not a restart."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: OrderedDict[int, tuple[int, int]] = OrderedDict()

    def remember(self, seq: int, payload: bytes) -> None:
        seen = self._seen
        seen[seq] = _fingerprint(payload)
        seen.move_to_end(seq)
        if len(seen) > RECENT_BATCHES:
            seen.popitem(last=False)

    def is_copy(self, seq: int, payload: bytes) -> bool:
        return self._seen.get(seq) == _fingerprint(payload)


def _fingerprint(payload: bytes) -> tuple[int, int]:
    return len(payload), zlib.crc32(payload)
