"""`KvEventSubscriber`: one pod's live events, gaps filled from its replay socket, and the
decision when its entries are dropped and rebuilt (the rules: the package docstring).

One cycle of `_run_received`: what the receiver thread took from the live socket since
the last cycle, in order: monitor events (connect, disconnect), a due full resync, live
messages already decoded (`_on_live`, applied in slices of `slice_ms`); then the timers
(auto-mode fallback, idle probe). `_run` is the same cycle with the socket read and
decoded on the loop (`SubscriberSettings.receive_in_thread` False). Any unexpected error
in a cycle drops the pod's entries and schedules a resync; it never ends the loop.

It stays one class (~560 lines): the sequence bookkeeping (`next_seq`, `_skip_through`,
the recent batches) and the resync standing (`resynced_at`) are read and written by the
live path, the replay and the restart signals alike; split apart, each piece would need
the others' internals. `__init__` (~50 lines) is the declaration of that shared state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.datalayer.kv_subscriber.hub import ReceiverHub
from epp.datalayer.kv_subscriber.receiver import (
    Connected,
    Disconnected,
    Failed,
    Item,
    LiveReceiver,
    Message,
    Retried,
)
from epp.datalayer.kv_subscriber.sockets import (
    ReplayFailed,
    ReplayRequest,
    ReplayTimedOut,
    open_sub_socket,
)
from epp.datalayer.kv_subscriber.state import (
    KvEventSink,
    Mode,
    RecentBatches,
    SubscriberSettings,
    SubscriberState,
)
from epp.prefix.kv_events import KvEvent, KvEventDecoder, KvEventStats, decode_seq, split_events

log = structlog.get_logger("epp.kv_subscriber")


class KvEventSubscriber:
    """Follows one pod's publisher and keeps its entries in the sink true (the rules: the
    package docstring)."""

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
        hub: Callable[[], ReceiverHub] | None = None,
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
        # settings.receive_in_thread: the live socket is read and decoded by the thread
        # of `hub()`, the caller's running hub (shared by the pods it follows; a new one
        # once a bug ended the last); given none, the subscriber makes its own on start
        # and closes it on close.
        self._hub = hub
        self._own_hub: ReceiverHub | None = None
        self._receiver: LiveReceiver | None = None
        self._resync_reason: str | None = None  # a full resync is due
        self._skip_through = -1  # live seqs up to this were applied by a replay
        self._recent = RecentBatches()
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
        try:
            if self.settings.receive_in_thread:
                self._receiver = self._new_receiver()
                run = self._run_received()
            else:
                self._open()
                run = self._run()
        except BaseException:
            # No events will come: precise entries nothing keeps true must not route.
            if self.state.attached:
                self._sink.detach(self.pod)
                self.state.attached = False
            raise
        self._task = asyncio.create_task(run, name=f"kv-events-{self.pod}")

    def _new_receiver(self) -> LiveReceiver:
        """This pod's live socket, handed to the running hub."""
        if self._hub is not None:
            hub = self._hub()
        else:
            if self._own_hub is not None and self._own_hub.failed:
                self._own_hub = None  # its thread ended with its sockets closed
            hub = self._own_hub = self._own_hub or ReceiverHub()
        receiver = LiveReceiver(self.pod, hub, self.endpoint, self.topic, self.settings)
        try:
            receiver.start()
        except BaseException:
            if self._own_hub is not None:
                self._own_hub.stop()  # its thread ends by itself: nothing was handed
                self._own_hub = None
            raise
        return receiver

    async def _rehome(self, dead: LiveReceiver) -> LiveReceiver:
        """A bug ended the thread reading this pod (its error was told: entries dropped,
        a resync due): the live socket is opened again on a running hub, and connects
        afresh (its handshake starts the resync)."""
        await dead.stop()  # the ended thread closed its sockets: returns at once
        if self.state.connected:
            self._on_disconnected()
        receiver = self._receiver = self._new_receiver()
        log.warning("kv_events_receiver_restarted", pod=self.pod)
        return receiver

    async def close(self, detach: bool = True) -> None:
        """Stop and close the sockets; with `detach`, the pod goes back to approximate
        mode with no entries (nothing keeps them true once its events stop)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            await receiver.stop()  # its sockets closed: the context may end
        own_hub, self._own_hub = self._own_hub, None
        if own_hub is not None:
            await own_hub.close()
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
        self._drop_entries()
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

    def _drop_entries(self) -> None:
        """The pod's entries go (if it is precise) and are in doubt until a full resync;
        the next message starts a new sequence."""
        self._doubt()
        if self.state.attached:
            self._sink.reset_pod(self.pod)
        self.state.next_seq = None

    # -- the loop ---------------------------------------------------------------------------

    def _open(self) -> None:
        self._sub, self._monitor = open_sub_socket(
            self._context, self.endpoint, self.topic, self.settings
        )

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
                self._failed(repr(exc)[:200])
                await asyncio.sleep(self.settings.reconnect_ivl_s)

    async def _run_received(self) -> None:
        """`_run` with the live socket read and decoded by the receiver thread: the same
        cycle, over the items it received in order (monitor events, then a due resync,
        then messages, as `_run` takes them from one poll)."""
        receiver = self._receiver
        assert receiver is not None
        while True:
            try:
                if receiver.hub_failed:
                    try:
                        receiver = await self._rehome(receiver)
                    except Exception:
                        # No thread takes the pod: its events stopped all the same, and
                        # an auto pod still goes back to approximate in time.
                        await self._timers()
                        raise
                items = await receiver.items(self._poll_timeout_ms() / 1000)
                self._slice_started = time.perf_counter()
                for item in items:
                    await self._on_item(item)
                if self._resync_reason is not None and self.state.connected:
                    await self._full_resync(self._resync_reason)
                await self._timers()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(repr(exc)[:200])
                await asyncio.sleep(self.settings.reconnect_ivl_s)

    async def _on_item(self, item: Item) -> None:
        if isinstance(item, Message):
            if self._resync_reason is not None and self.state.connected:
                await self._full_resync(self._resync_reason)
            if item.seq is None:
                self.stats.problem("malformed_frames", pod=self.pod, frames=item.frames)
            else:
                await self._on_live(item.seq, item.payload, item)
            if self._resync_reason is not None:
                await self._full_resync(self._resync_reason)
        elif isinstance(item, Connected):
            self._on_connected()
        elif isinstance(item, Disconnected):
            if self.state.connected:
                self._on_disconnected()
        elif isinstance(item, Retried):
            self.state.connect_retries += 1
        elif isinstance(item, Failed):
            self._failed(item.error)

    def _failed(self, error: str) -> None:
        """An unexpected error in a cycle: the entries go and a resync is due."""
        self.state.errors += 1
        self.stats.problem("subscriber_error", pod=self.pod, error=error)
        self._drop_entries()
        self._resync_reason = "error"

    def _poll_timeout_ms(self) -> int:
        return 1000 if self._resync_reason is None else 100

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._on_connected()
            elif event == zmq.EVENT_DISCONNECTED and self.state.connected:
                self._on_disconnected()
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.state.connect_retries += 1

    def _on_connected(self) -> None:
        state = self.state
        state.connected = True
        state.connected_at = self._clock()
        if not state.attached:
            self._attach()
        self._replay_down_until = 0.0  # a new publisher: its replay may answer
        log.info("kv_events_connected", pod=self.pod, endpoint=self.endpoint)
        self._resync_reason = "connected"

    def _on_disconnected(self) -> None:
        state = self.state
        state.connected = False
        state.disconnected_at = self._clock()
        state.disconnects += 1
        self.stats.add("disconnects")
        # The publisher may be gone with its cache, and what is still queued from this
        # connection may be read ahead of the next resync: in doubt until that resync.
        self._drop_entries()
        self._skip_through = -1
        log.info("kv_events_disconnected", pod=self.pod, endpoint=self.endpoint)

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
            except ReplayFailed as exc:
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
        if len(frames) != 3 or (seq := decode_seq(frames[1])) is None:
            self.stats.problem("malformed_frames", pod=self.pod, frames=len(frames))
            return
        await self._on_live(seq, frames[2])

    async def _on_live(self, seq: int, payload: bytes, decoded: Message | None = None) -> None:
        """One live message (`decoded`: already decoded by the receiver thread): a copy
        is ignored, a sequence going back is a new publisher (full resync), a sequence
        jumping ahead is a gap (filled from the replay first)."""
        state = self.state
        state.last_message_at = self._clock()
        if not state.attached:
            return  # auto mode, no handshake seen yet: nothing to keep
        if seq <= self._skip_through:
            state.duplicates += 1  # a replay already applied it
            return
        self._skip_through = -1
        expected = state.next_seq
        if expected is not None and seq < expected:
            if self._recent.is_copy(seq, payload):
                state.duplicates += 1
                return
            state.restarts += 1
            self.stats.problem("publisher_restarts", pod=self.pod, seq=seq, expected=expected)
            await self._full_resync("sequence_back")
            if seq <= self._skip_through:
                return  # the resync's replay held it
        elif expected is not None and seq > expected:
            state.gaps += 1
            self.stats.problem("gaps", pod=self.pod, missed=seq - expected)
            await self._fill_gap(expected, seq)
        await self._apply_payload(payload, seq, decoded)
        state.messages += 1

    async def _apply_payload(
        self, payload: bytes, seq: int, decoded: Message | None = None
    ) -> None:
        if decoded is None:
            batch = self.decoder.decode(payload, self.pod)
        else:
            batch = decoded.batch
            for reason, n in decoded.counts.items():
                self.stats.add(reason, n)
        self.state.next_seq = seq + 1
        self._recent.remember(seq, payload)
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
        """Apply the missed batches [start, live_seq) from the replay; if it cannot, the
        pod's entries go (what was missed is unknown) and the live message goes on."""
        try:
            if not self._replay_usable():
                raise ReplayFailed("no replay socket (or it did not answer lately)")
            last = await self._replay(start, gap=True, until=live_seq)
            if last != live_seq - 1:
                raise ReplayFailed(f"the replay ended at {last}, short of {live_seq - 1}")
        except ReplayFailed as exc:
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
            except ReplayFailed as exc:
                state.replay_failures += 1
                self.stats.problem("resync_failures", pod=self.pod, cause=reason, error=str(exc))
                self._sink.reset_pod(self.pod)
                state.next_seq = None
                self._skip_through = -1
                self._rebuilding = None  # not rebuilt: a restart seen next still drops
        # else: no replay to ask, live events from now on (rebuilt as far as it can be)
        if self._rebuilding is not None:
            state.resynced_at, self._rebuilding = self._rebuilding, None
        log.info("kv_events_resynced", pod=self.pod, reason=reason, next_seq=state.next_seq)

    async def _replay(self, start: int, *, gap: bool, until: int | None = None) -> int | None:
        """Apply the buffered batches from `start` (up to `until`, exclusive), set
        `next_seq` after the last and return its seq (None: the buffer had none). For a
        gap, a buffer that does not reach back to `start` drops the pod's entries first
        (what was missed is unknown). Raises ReplayFailed when the socket does not answer
        in time or sends garbage."""
        assert self.replay_endpoint is not None
        last: int | None = None
        request = ReplayRequest(self._context, self.replay_endpoint, self.settings, self._clock)
        with request:
            try:
                await request.send(start)
                while (batch := await request.receive()) is not None:
                    seq, payload = batch
                    if seq < start or (until is not None and seq >= until):
                        continue
                    if last is not None and seq != last + 1:
                        raise ReplayFailed(f"replay jumped from {last} to {seq}")
                    if last is None and gap and seq != start:
                        # The buffer lost what we missed: start over from what it holds.
                        self.stats.problem("resync_partial", pod=self.pod, wanted=start, got=seq)
                        self._sink.reset_pod(self.pod)
                    self._slice_started = time.perf_counter()
                    await self._apply_payload(payload, seq)
                    self.state.replayed += 1
                    last = seq
            except ReplayTimedOut:
                self._replay_down_until = self._clock() + self.settings.replay_retry_s
                raise
        if last is not None:
            self.state.next_seq = last + 1
            self._skip_through = last
        elif not gap:
            # An empty buffer: the publisher has sent nothing yet, so the first batch it
            # sends is seq 0 (a later one means batch 0 was lost on the way).
            self.state.next_seq = start
        return last
