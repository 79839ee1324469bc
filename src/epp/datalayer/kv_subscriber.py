"""One pod's vLLM KV events over ZMQ, kept in step with the pod (the I/O of precise mode).

A `KvEventSubscriber` per followed pod:

- **Live**: a SUB socket connected to the pod's publisher, subscribed to its topic (a ZMQ
  prefix filter). A message is `[topic, seq (8 bytes, big-endian), payload]`; the payload
  is decoded (`epp.prefix.kv_events`) and applied to the index (`epp.prefix.precise`)
  in slices of bounded work, yielding to the event loop between slices, so that a burst
  of events never holds the loop for long (`slice_ms`).
- **Sequence gaps** (a batch lost: the publisher's queue overflowed, the network dropped
  it): the missed batches are asked from the pod's replay socket (DEALER to its ROUTER:
  `[b"", start seq]` -> `[b"", (topic,) seq, payload]` ... then seq ff..ff) and applied
  before the message that revealed the gap. If the replay does not cover the gap, or
  does not answer within `resync_timeout_s`, the pod's entries are dropped rather than
  trusted, and the subscriber goes on from the live message.
- **(Re)connection**: every time the ZMQ handshake with the publisher succeeds (first
  connect, and every reconnect: ZMQ reconnects by itself, with backoff up to
  `reconnect_max_s`), the pod's entries are dropped and rebuilt from a full replay (from
  seq 0: whatever the pod's buffer holds). A disconnect drops the entries at once: the
  publisher's process may be gone with its cache.
- **Duplicates**: a live batch whose sequence number was applied lately with the same
  payload (length and CRC-32 of the last `_RECENT` batches) is a copy (a batch sent
  twice, or a late one a replay already applied): ignored, not taken for a restart.
- **Publisher restart**: the sequence going back (with another payload), a restart seen
  elsewhere (`restarted()`: the store saw the pod's counters go back) or a new start time
  (`observe_start_time`: the pod's `process_start_time_seconds`, fed from every page by
  the wiring) drops the pod's entries and resyncs, even without a replay socket; except
  as follows.
- **A restart the subscriber already caught up with**: the new process's first page is
  often read after the subscriber has reconnected to it and rebuilt the entries from its
  replay (vLLM serves its page only once the engine is up, 20-70 s after the process
  started, while the subscriber reconnects within `reconnect_max_s` of the publisher
  binding). Dropping them again would leave the pod empty for routing until one more
  replay, for nothing. So a new start time S does not drop the entries when the last
  full resync (the entries dropped, then the pod's whole replay buffer applied, or no
  replay to ask: live events from then on) began at least `restart_margin_s` after S by
  the EPP's wall clock, finished without failure, and nothing since has put the entries
  in doubt (a disconnect, an error, a restart drop, a resync under way). Why that is
  enough: the old process was gone before the new one started (same ports), so a resync
  that began after S was answered by the new process, and what came live after it is
  the new process's too. Why the margin (3 s): S is the pod's clock, the resync's time
  ours; they may differ by about a second in a cluster, and `process_start_time_seconds`
  itself reads up to a second early (boot time truncated to whole seconds), both of
  which make the resync look later after S than it was; one more second to spare (a
  real engine's publisher binds 20-70 s after S, far beyond it). Any doubt drops: no
  completed resync since the restart, a resync that began earlier or within the margin,
  a restart the subscriber never saw itself (a forwarder in between keeps its connection
  and the sequence may go on: no resync at all since S), a restart seen from the
  counters only (no start time to compare: `restarted()` without `started_at`). A drop
  for a gap or an unreadable batch keeps the resync's standing: it only removes entries,
  and what follows is live. A skipped drop is counted (`restart_drops_skipped`) and
  logged. For a precise pod this is the only decision: the app's index listener leaves
  the store's `reset` of a followed precise pod to the wiring (`PreciseMode.owns_entries`).
- **Idle probe**: with a replay socket, after `probe_interval_s` without messages the
  subscriber asks for the batches after the last one it applied; a lost last batch is
  found this way instead of at the next message.
- **Mode** `auto`: the pod becomes precise (`sink.attach`) when its publisher completes a
  handshake, and goes back to approximate (`sink.detach`) after `fallback_after_s`
  without a connection. Mode `precise`: precise from the start, never approximate.

Bad input never ends the subscriber: every message is decoded defensively, and an
unexpected error in one cycle is logged, counted, and followed by a resync.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.addresses import split_host_port, url_host
from epp.prefix.kv_events import (
    REPLAY_END_SEQ,
    DecodeLimits,
    KvEvent,
    KvEventDecoder,
    KvEventStats,
    decode_seq,
    encode_seq,
    split_events,
)

if TYPE_CHECKING:
    from epp.config import KvEventsConfig

log = structlog.get_logger("epp.kv_subscriber")

Mode = Literal["auto", "precise"]

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


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
    slice_ms: float = 2.0  # apply at most about this long before yielding to the loop
    slice_blocks: int = 512  # and cut events into pieces of at most this many blocks
    rcvhwm: int = 10_000  # live messages ZMQ queues while a replay runs (then: a gap)
    replay_retry_s: float = 60.0  # a replay socket that did not answer is left alone this long
    # A resync that began this long after a new start time was answered by the new process
    # (pod and EPP clocks ~1 s apart, the start time ~1 s early, 1 s to spare: see above).
    restart_margin_s: float = 3.0
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


class _ReplayFailed(Exception):
    pass


class KvEventSubscriber:
    def __init__(
        self,
        pod: str,
        endpoint: str,
        sink: KvEventSink,
        *,
        model: str | None,
        replay_endpoint: str | None = None,
        topic: str = "",
        mode: Mode = "auto",
        settings: SubscriberSettings | None = None,
        stats: KvEventStats | None = None,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.pod = pod
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.model = model
        self.mode: Mode = mode
        self.settings = settings or SubscriberSettings()
        # Share the sink's counters by default: one set of counts per EPP.
        self.stats = stats or getattr(sink, "stats", None) or KvEventStats()
        self.decoder = KvEventDecoder(self.settings.limits, self.stats)
        self.state = SubscriberState()
        self._sink = sink
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._clock = clock
        # Start times on pages are unix times: the resync's time is compared in the same.
        self._wall = wall_clock
        self._rebuilding: float | None = None  # the running full resync's start (wall)
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._resync_reason: str | None = None  # a full resync is due
        self._skip_through = -1  # live seqs up to this were applied by a replay
        # seq -> (length, CRC-32) of the batches applied lately: a copy is not a restart.
        self._recent: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._start_time: float | None = None
        self._slice_started = 0.0
        # A replay socket that did not answer is not asked again (each ask waits up to
        # resync_timeout_s with live messages queued) until this time or a reconnect.
        self._replay_down_until = 0.0

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        if self.mode == "precise":
            self._attach()
        self._open()
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.pod}")

    async def close(self, detach: bool = True) -> None:
        """Stop and close the sockets; with `detach`, the pod goes back to approximate
        mode with no entries (its events no longer keep them true)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_sockets()
        if self._own_context:
            self._context.term()
        if detach and self.state.attached:
            self._sink.detach(self.pod)
            self.state.attached = False
        self.state.connected = False

    # -- signals from elsewhere ------------------------------------------------------------

    def restarted(self, reason: str = "engine_restart", *, started_at: float | None = None) -> bool:
        """The pod's engine restarted (seen in its metrics; `started_at`: the new process's
        start time, when known): its entries go now, and are rebuilt from a full resync on
        the next cycle (within about a second), unless they were already rebuilt from the
        new process (`rebuilt_after`, the module docstring). Returns whether they went."""
        state = self.state
        state.restarts += 1
        self.stats.add("publisher_restarts")
        if started_at is not None and self.rebuilt_after(started_at):
            state.restart_drops_skipped += 1
            self.stats.add("restart_drops_skipped")
            log.info(
                "kv_events_restart_already_resynced",
                pod=self.pod,
                reason=reason,
                started_at=started_at,
                resynced_at=state.resynced_at,
                margin_s=self.settings.restart_margin_s,
            )
            return False
        self._doubt()
        if state.attached:
            self._sink.reset_pod(self.pod)
        state.next_seq = None
        self._resync_reason = reason
        log.info("kv_events_restart_dropped", pod=self.pod, reason=reason, started_at=started_at)
        return True

    def observe_start_time(self, start_time: float) -> bool:
        """The pod's server start time, from its metrics page
        (`process_start_time_seconds`): a change is a restart, even if the sequence
        numbers never went back. Returns whether it was one (its entries dropped or not)."""
        changed = self._start_time is not None and start_time != self._start_time
        self._start_time = start_time
        if changed:
            self.restarted("start_time_changed", started_at=start_time)
        return changed

    def rebuilt_after(self, started_at: float) -> bool:
        """Whether the entries hold only what a process started at `started_at` (pod's
        wall clock) or later sent: the last full resync began at least `restart_margin_s`
        after it, finished, and nothing has put them in doubt since."""
        resynced_at = self.state.resynced_at
        return (
            resynced_at is not None and resynced_at - started_at >= self.settings.restart_margin_s
        )

    def _doubt(self) -> None:
        """The entries may hold what an earlier process sent, or a resync is cut short:
        until the next full resync finishes, a restart seen in the metrics drops them."""
        self.state.resynced_at = None
        self._rebuilding = None

    # -- the loop ---------------------------------------------------------------------------

    def _open(self) -> None:
        settings = self.settings
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # Without it ZMQ refuses an IPv6 address ("tcp://[fd00::1]:5557": EINVAL, or a
        # connect that never completes); with it, IPv4 addresses still work.
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.RCVHWM, settings.rcvhwm)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(settings.reconnect_ivl_s * 1000)))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(settings.reconnect_max_s * 1000)))
        # ZMQ's own hard cap (it drops the connection): above the decoder's limit, which
        # counts and refuses what is between the two.
        sub.setsockopt(zmq.MAXMSGSIZE, settings.limits.max_payload_bytes * 2 + 65_536)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
        sub.connect(self.endpoint)
        self._sub = sub

    def _close_sockets(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    async def _run(self) -> None:
        sub, monitor = self._sub, self._monitor
        assert sub is not None and monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            try:
                ready = dict(await poller.poll(self._poll_timeout_ms()))
                if monitor in ready:
                    await self._on_monitor(monitor)
                if self._resync_reason is not None and self.state.connected:
                    await self._full_resync(self._resync_reason)
                if sub in ready:
                    await self._drain(sub)
                await self._timers()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.state.errors += 1
                self.stats.problem("subscriber_error", pod=self.pod, error=repr(exc)[:200])
                self._doubt()
                if self.state.attached:
                    self._sink.reset_pod(self.pod)
                self.state.next_seq = None
                self._resync_reason = "error"
                await asyncio.sleep(self.settings.reconnect_ivl_s)

    def _poll_timeout_ms(self) -> int:
        return 1000 if self._resync_reason is None else 100

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            now = self._clock()
            state = self.state
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                state.connected = True
                state.connected_at = now
                if not state.attached:
                    self._attach()
                self._replay_down_until = 0.0  # a new publisher: its replay may answer
                log.info("kv_events_connected", pod=self.pod, endpoint=self.endpoint)
                self._resync_reason = "connected"
            elif event == zmq.EVENT_DISCONNECTED and state.connected:
                state.connected = False
                state.disconnected_at = now
                state.disconnects += 1
                self.stats.add("disconnects")
                # What is still queued from this connection may be read before the next
                # resync: the entries are in doubt until that resync.
                self._doubt()
                if state.attached:
                    self._sink.reset_pod(self.pod)  # the publisher may be gone with its cache
                state.next_seq = None
                self._skip_through = -1
                log.info("kv_events_disconnected", pod=self.pod, endpoint=self.endpoint)
            elif event == zmq.EVENT_CONNECT_RETRIED:
                state.connect_retries += 1

    async def _timers(self) -> None:
        state = self.state
        now = self._clock()
        if (
            self.mode == "auto"
            and state.attached
            and not state.connected
            and state.disconnected_at is not None
            and now - state.disconnected_at >= self.settings.fallback_after_s
        ):
            self._sink.detach(self.pod)
            state.attached = False
            log.info("kv_events_fallback_approximate", pod=self.pod)
        if (
            self._replay_usable()
            and state.connected
            and state.next_seq is not None
            and now - (state.last_message_at or state.connected_at or now)
            >= self.settings.probe_interval_s
        ):
            state.last_message_at = now  # one probe per interval
            try:
                await self._replay(state.next_seq, gap=True)
            except _ReplayFailed as exc:
                state.replay_failures += 1
                self.stats.problem("probe_failed", pod=self.pod, error=str(exc))

    def _replay_usable(self) -> bool:
        return self.replay_endpoint is not None and self._clock() >= self._replay_down_until

    def _attach(self) -> None:
        self._sink.attach(self.pod, self.model)
        self.state.attached = True
        log.info("kv_events_precise", pod=self.pod)

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        """Every message queued now, yielding to the loop between slices."""
        self._slice_started = time.perf_counter()
        while True:
            try:
                frames = await sub.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            await self._on_message(frames)
            if self._resync_reason is not None:
                await self._full_resync(self._resync_reason)

    async def _on_message(self, frames: list[bytes]) -> None:
        state = self.state
        if len(frames) != 3 or (seq := decode_seq(frames[1])) is None:
            self.stats.problem("malformed_frames", pod=self.pod, frames=len(frames))
            return
        state.last_message_at = self._clock()
        if not state.attached:
            return  # auto mode before a handshake was seen: nothing to keep yet
        expected = state.next_seq
        if seq <= self._skip_through:
            state.duplicates += 1
            return
        self._skip_through = -1
        if expected is not None and seq != expected:
            if seq < expected and self._recent.get(seq) == _fingerprint(frames[2]):
                state.duplicates += 1
                return
            if seq < expected:
                # The sequence went back: a new publisher (its process restarted).
                state.restarts += 1
                self.stats.problem("publisher_restarts", pod=self.pod, seq=seq, expected=expected)
                await self._full_resync("sequence_back")
                if seq <= self._skip_through:
                    return
            else:
                state.gaps += 1
                self.stats.problem("gaps", pod=self.pod, missed=seq - expected)
                await self._fill_gap(expected, seq)
        await self._apply_payload(frames[2], seq)
        state.messages += 1

    async def _apply_payload(self, payload: bytes, seq: int) -> None:
        batch = self.decoder.decode(payload, self.pod)
        self.state.next_seq = seq + 1
        recent = self._recent
        recent[seq] = _fingerprint(payload)
        recent.move_to_end(seq)
        if len(recent) > _RECENT:
            recent.popitem(last=False)
        if batch is None:
            # A batch we cannot read is a batch lost: what it changed is unknown.
            self._sink.reset_pod(self.pod)
            return
        await self._apply_events(batch.events)

    async def _apply_events(self, events: Sequence[KvEvent]) -> None:
        budget = self.settings.slice_ms / 1000.0
        for piece in split_events(events, self.settings.slice_blocks):
            self._sink.apply_events(self.pod, piece)
            if time.perf_counter() - self._slice_started >= budget:
                await asyncio.sleep(0)
                self._slice_started = time.perf_counter()

    async def _fill_gap(self, start: int, live_seq: int) -> None:
        try:
            if not self._replay_usable():
                raise _ReplayFailed("no replay socket (or it did not answer lately)")
            last = await self._replay(start, gap=True, until=live_seq)
            if last != live_seq - 1:
                raise _ReplayFailed(f"the replay ended at {last}, before {live_seq - 1}")
        except _ReplayFailed as exc:
            self.state.replay_failures += 1
            self.stats.problem("resync_failures", pod=self.pod, error=str(exc))
            self._sink.reset_pod(self.pod)
        self._skip_through = -1
        self.state.next_seq = live_seq

    async def _full_resync(self, reason: str) -> None:
        """Drop the pod's entries and rebuild them from whatever the replay buffer holds."""
        self._resync_reason = None
        state = self.state
        state.resyncs += 1
        self.stats.add("resyncs")
        # The entries are emptied now: from here they hold only this replay's batches and
        # what comes live after it. A restart seen meanwhile (restarted) clears this.
        self._doubt()
        self._rebuilding = self._wall()
        self._sink.reset_pod(self.pod)
        state.next_seq = None
        self._skip_through = -1
        if self._replay_usable():
            try:
                await self._replay(0, gap=False)
            except _ReplayFailed as exc:
                state.replay_failures += 1
                self.stats.problem("resync_failures", pod=self.pod, cause=reason, error=str(exc))
                self._sink.reset_pod(self.pod)
                state.next_seq = None
                self._skip_through = -1
                self._rebuilding = None  # not rebuilt: a restart seen next still drops
        # else: no replay to ask, live events from now on (rebuilt as far as it can be)
        if self._rebuilding is not None:
            state.resynced_at, self._rebuilding = self._rebuilding, None
        log.info(
            "kv_events_resynced",
            pod=self.pod,
            reason=reason,
            next_seq=state.next_seq,
        )

    async def _replay(self, start: int, *, gap: bool, until: int | None = None) -> int | None:
        """Apply the buffered batches from `start` (up to `until`, exclusive), set
        `next_seq` after the last and return its seq (None: the buffer had none). For a
        gap, a buffer that no longer reaches back to `start` drops the pod's entries
        first (what was missed is unknown). Raises _ReplayFailed when the socket does not
        answer in time or sends garbage."""
        assert self.replay_endpoint is not None
        settings = self.settings
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.setsockopt(zmq.MAXMSGSIZE, settings.limits.max_payload_bytes * 2 + 65_536)
        dealer.connect(self.replay_endpoint)
        state = self.state
        first = True
        last: int | None = None
        try:
            await dealer.send_multipart((b"", encode_seq(start)))
            deadline = self._clock() + settings.replay_max_s
            while True:
                wait = min(settings.resync_timeout_s, deadline - self._clock())
                if wait <= 0 or not await dealer.poll(int(wait * 1000)):
                    self._replay_down_until = self._clock() + settings.replay_retry_s
                    raise _ReplayFailed("the replay socket did not answer in time")
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) < 2 or (seq := decode_seq(frames[-2])) is None:
                    raise _ReplayFailed(f"a replay message of {len(frames)} frames")
                if seq == REPLAY_END_SEQ:
                    break
                if seq < start or (until is not None and seq >= until):
                    continue
                if last is not None and seq != last + 1:
                    raise _ReplayFailed(f"replay jumped from {last} to {seq}")
                if first:
                    first = False
                    if gap and seq != start:
                        # The buffer lost what we missed: start over from what it holds.
                        self.stats.problem("resync_partial", pod=self.pod, wanted=start, got=seq)
                        self._sink.reset_pod(self.pod)
                self._slice_started = time.perf_counter()
                await self._apply_payload(frames[-1], seq)
                state.replayed += 1
                last = seq
        finally:
            dealer.close(linger=0)
        if last is not None:
            state.next_seq = last + 1
            self._skip_through = last
        elif not gap:
            # An empty buffer: the publisher has sent nothing yet, so the first batch it
            # sends is seq 0 (a later one means batch 0 was lost on the way).
            state.next_seq = start
        return last


_RECENT = 64  # batches whose fingerprints are kept to recognise copies


def _fingerprint(payload: bytes) -> tuple[int, int]:
    """A batch's identity for duplicate detection: a restarted publisher's batch of the
    same sequence number differs (its timestamp, at least)."""
    return len(payload), zlib.crc32(payload)


def format_endpoint(template: str, address: str, model: str | None, name: str) -> str | None:
    """A configured template (`tcp://{host}:5557`, `kv@{host}:{port}@{model}`) for one pod
    whose `address` is ip:port; None if it names the model and the model is unknown."""
    if model is None and "{model}" in template:
        return None
    host, port = split_address(address)
    if "[{host}]" not in template:
        host = url_host(host)  # an IPv6 address in a URL: tcp://[fd00::1]:5557
    return template.format(host=host, port=port, model=model or "", name=name)


def split_address(address: str) -> tuple[str, str]:
    """(host, port) of the pod's `ip:port` for a template: an IPv6 host without its
    brackets, and "" for the port of an address that has none (epp.addresses)."""
    host, port = split_host_port(address)
    return host, "" if port is None else str(port)


def topic_prefix(template: str, address: str, model: str | None, name: str) -> str:
    """The topic filter for a pod: the template formatted, cut before `{model}` when the
    model is not known yet (ZMQ filters by prefix, so this still selects the pod)."""
    if model is None and "{model}" in template:
        template = template.split("{model}", 1)[0]
    host, port = split_address(address)
    return template.format(host=host, port=port, model=model or "", name=name)


# Endpoint labels that override the templates for one pod (static endpoint files: several
# pods on one host need their own ports; Kubernetes pods each have their own IP and use
# the templates).
LABEL_MODE = "kv_events_mode"
LABEL_ENDPOINT = "kv_events_endpoint"
LABEL_REPLAY = "kv_events_replay"
LABEL_TOPIC = "kv_events_topic"


@dataclass(frozen=True, slots=True)
class PodKvEvents:
    """Where one pod's events come from, resolved from the config and its labels."""

    mode: Literal["auto", "approximate", "precise"]
    endpoint: str | None  # None: approximate (or the template needs the unknown model)
    replay_endpoint: str | None
    topic: str


def resolve_pod(
    config: KvEventsConfig,
    name: str,
    address: str,
    model: str | None,
    labels: dict[str, str] | None = None,
) -> PodKvEvents:
    """The pod's mode (label `kv_events_mode`, else `pod_modes[name]`, else `mode`) and
    endpoints (labels `kv_events_endpoint` / `kv_events_replay` ("" for none) /
    `kv_events_topic`, else the templates)."""
    labels = labels or {}
    mode = labels.get(LABEL_MODE) or config.mode_of(name)
    if mode not in ("auto", "approximate", "precise"):
        mode = config.mode_of(name)
    if mode == "approximate":
        return PodKvEvents("approximate", None, None, "")
    endpoint = labels.get(LABEL_ENDPOINT) or format_endpoint(config.endpoint, address, model, name)
    if LABEL_REPLAY in labels:
        replay = labels[LABEL_REPLAY] or None
    elif config.replay_endpoint is None:
        replay = None
    else:
        replay = format_endpoint(config.replay_endpoint, address, model, name)
    topic = labels.get(LABEL_TOPIC)
    if topic is None:
        topic = topic_prefix(config.topic, address, model, name)
    return PodKvEvents(mode, endpoint, replay, topic)  # type: ignore[arg-type]
