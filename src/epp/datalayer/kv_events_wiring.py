"""Precise mode in `epp serve`: one KV-event subscriber per pod that publishes events.

`PreciseMode` owns what the app needs for it: the shared `KvEventStats`, the
`PreciseIndex` that applies events to the prefix index, one ZMQ context for every
subscriber (made on first use, its socket limit raised: three sockets a pod when the
live sockets are read on the loop), the `ReceiverHub` whose one thread reads every pod's
live socket (made on first use, with `receive_in_thread`; replaced if a failure ended
it) and a pod name -> `KvEventSubscriber` map. `epp.wiring` hands it the endpoint
store's events after the index listener, as every other reader of the store's events:

- `added` / `updated`: the pod's mode and endpoints are resolved from `kv_events:` and
  its labels (`resolve_pod`). A pod that is not `approximate`, whose publisher endpoint is
  known and whose model is known gets a subscriber (the model may only be learned from
  the first metrics page: it starts on the first update that has it). A change of model,
  endpoints, topic or mode closes the old subscriber and starts a new one; a pod that
  became `approximate` loses its subscriber (and its precise entries).
- `reset` (the store saw the pod's server restart: its counters went back, or its
  `process_start_time_seconds` is later than any seen): `restarted`, so its entries go
  now and are rebuilt from a full resync, even when the publisher's sequence numbers
  never went back and its connection never dropped (a forwarder in between). With a new
  start time the subscriber decides (`observe_start_time`): entries it already rebuilt
  from the new process stay (kv_subscriber's module docstring has the rule).
- every page's start time also goes to the subscriber (`observe_start_time`), which
  remembers it: a subscriber made after a page compares the next one with it.
- For a pod followed precisely, that decision is the only one: the app's index listener
  (`epp.wiring.index_listener`, called before this) asks `owns_entries` and leaves such a
  pod's `reset` here, so that the two do not drop what one of them knows to be current.
- `removed`: the subscriber is closed and the pod forgotten (`PreciseIndex.remove_pod`):
  no entry stays.

A retired subscriber is cut off from the index at once (its sink is a gate that closes
before its sockets do), so that a late batch of an old publisher never reaches the pod's
new entries. Subscribers start when the service starts (`start`), or at once when
created later; `close` stops them all, then closes the hub (its thread ends) and
terminates the context.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

import structlog
import zmq.asyncio

from epp.datalayer.kv_subscriber import (
    LABEL_ENDPOINT,
    KvEventSubscriber,
    PodKvEvents,
    SubscriberSettings,
    resolve_pod,
)
from epp.datalayer.kv_subscriber.hub import HubClosed, ReceiverHub
from epp.datalayer.kv_subscriber.sockets import raise_socket_limit
from epp.prefix.kv_events import KvEvent, KvEventStats
from epp.prefix.precise import PreciseIndex

if TYPE_CHECKING:
    from epp.config import KvEventsConfig
    from epp.datalayer.endpoint import Endpoint
    from epp.prefix.index import PrefixIndex

log = structlog.get_logger("epp.kv_events")


class _Gate:
    """A subscriber's sink: forwards to the PreciseIndex until the subscriber is retired."""

    __slots__ = ("open", "sink", "stats")

    def __init__(self, sink: PreciseIndex) -> None:
        self.sink = sink
        self.stats = sink.stats
        self.open = True

    def attach(self, pod: str, model: str | None) -> None:
        if self.open:
            self.sink.attach(pod, model)

    def detach(self, pod: str) -> None:
        if self.open:
            self.sink.detach(pod)

    def reset_pod(self, pod: str) -> None:
        if self.open:
            self.sink.reset_pod(pod)

    def apply_events(self, pod: str, events: Sequence[KvEvent]) -> int:
        return self.sink.apply_events(pod, events) if self.open else 0


class _Follow:
    __slots__ = ("gate", "sub", "wiring")

    def __init__(self, sub: KvEventSubscriber, gate: _Gate, wiring: tuple) -> None:
        self.sub = sub
        self.gate = gate
        self.wiring = wiring  # what it was made from: a change makes a new subscriber


class PreciseMode:
    """The KV-event subscribers of every followed pod, and the index they keep."""

    def __init__(
        self,
        config: KvEventsConfig,
        index: PrefixIndex,
        block_size: int,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.stats = KvEventStats()
        self.precise = PreciseIndex(index, block_size, self.stats)
        self.settings = SubscriberSettings.from_config(config)
        self._context = context
        self._own_context = context is None
        self._hub: ReceiverHub | None = None
        self._follows: dict[str, _Follow] = {}
        self._running = False
        self._closed = False
        self._pending: set[asyncio.Task[None]] = set()
        # Auto mode with the endpoint template: which pods each templated endpoint would
        # stand for. Pods sharing a host (several on one machine, data-parallel ranks)
        # resolve to one publisher that cannot be told apart: none of them follows it.
        self._templated: dict[str, set[str]] = {}

    # -- what others read -------------------------------------------------------------

    @property
    def subscribers(self) -> dict[str, KvEventSubscriber]:
        """Pod name -> its subscriber (a copy)."""
        return {name: follow.sub for name, follow in self._follows.items()}

    def subscriber(self, pod: str) -> KvEventSubscriber | None:
        follow = self._follows.get(pod)
        return None if follow is None else follow.sub

    def owns_entries(self, pod: str) -> bool:
        """Whether the pod's entries are its subscriber's to drop when its server restarts
        (it is followed and precise): then `on_change` decides on the store's `reset`, and
        the index listener leaves the pod alone."""
        follow = None if self._closed else self._follows.get(pod)
        return follow is not None and follow.sub.state.attached and self.index.is_precise(pod)

    def mode_of(self, pod: str) -> str:
        """`precise` while the pod's events keep its entries, else `approximate`."""
        return "precise" if self.index.is_precise(pod) else "approximate"

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the subscribers made so far; later ones start as they are made."""
        self._running = True
        for follow in list(self._follows.values()):
            await follow.sub.start()

    async def close(self) -> None:
        """Stop every subscriber (their pods go back to approximate, with no entries),
        then end the hub's thread and terminate the shared context."""
        self._running = False
        self._closed = True
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        follows, self._follows = self._follows, {}

        async def close(follow: _Follow) -> None:
            with contextlib.suppress(Exception):
                await follow.sub.close(detach=True)
            follow.gate.open = False

        # All at once: each waits for the hub thread (or its own task) to close its sockets.
        await asyncio.gather(*(close(follow) for follow in follows.values()))
        hub, self._hub = self._hub, None
        if hub is not None:
            await hub.close()
        if self._context is not None and self._own_context:
            self._context.term()
            self._context = None

    # -- the endpoint store's events ----------------------------------------------------

    def on_change(self, event: str, endpoint: Endpoint) -> None:
        if self._closed:
            return
        name = endpoint.name
        if event == "removed":
            self._retire(name)
            self.precise.remove_pod(name)
            for names in self._templated.values():
                names.discard(name)
        elif event == "reset":
            follow = self._follows.get(name)
            if follow is not None and not self._observe_start(follow, endpoint):
                follow.sub.restarted("counters_reset")
        elif event in ("added", "updated"):
            self._follow(endpoint)
            follow = self._follows.get(name)
            if follow is not None:
                self._observe_start(follow, endpoint)

    @staticmethod
    def _observe_start(follow: _Follow, endpoint: Endpoint) -> bool:
        """Give the subscriber the page's start time; whether it saw a restart in it (the
        store's `reset` and the `updated` after it carry the same page: one restart)."""
        metrics = endpoint.metrics
        if metrics is None or metrics.start_time is None:
            return False
        return follow.sub.observe_start_time(metrics.start_time)

    def _follow(self, endpoint: Endpoint) -> None:
        name, model = endpoint.name, endpoint.model
        pod = resolve_pod(self.config, name, endpoint.address, model, endpoint.labels)
        wanted = pod.mode != "approximate" and pod.endpoint is not None and model is not None
        if wanted and pod.mode == "auto" and LABEL_ENDPOINT not in endpoint.labels:
            assert pod.endpoint is not None
            for url, names in self._templated.items():
                if url != pod.endpoint:
                    names.discard(name)
            sharing = self._templated.setdefault(pod.endpoint, set())
            sharing.add(name)
            if len(sharing) > 1:
                for other in sharing - {name}:
                    if other in self._follows:
                        self._retire(other)
                        self._retire_now(other)
                wanted = False
        wiring = (pod, model)
        current = self._follows.get(name)
        if current is not None:
            if wanted and current.wiring == wiring:
                return
            self._retire(name)
            self.precise.detach(name)  # approximate, with no entries, until a new handshake
            log.info("kv_events_unfollowed", pod=name, reason="changed" if wanted else "mode")
        if wanted:
            self._new(name, pod, model)

    def _new(self, name: str, pod: PodKvEvents, model: str | None) -> None:
        assert pod.endpoint is not None and pod.mode != "approximate"
        if self._context is None:
            self._context = zmq.asyncio.Context()
            raise_socket_limit(self._context)
        gate = _Gate(self.precise)
        sub = KvEventSubscriber(
            name,
            pod.endpoint,
            gate,
            model=model,
            replay_endpoint=pod.replay_endpoint,
            topic=pod.topic,
            mode=pod.mode,
            settings=self.settings,
            stats=self.stats,
            context=self._context,
            hub=self._live_hub if self.settings.receive_in_thread else None,
        )
        self._follows[name] = _Follow(sub, gate, (pod, model))
        log.info(
            "kv_events_following",
            pod=name,
            mode=pod.mode,
            endpoint=pod.endpoint,
            replay=pod.replay_endpoint,
            model=model,
        )
        if self._running:
            self._schedule(sub.start())

    def _live_hub(self) -> ReceiverHub:
        """The receiver thread every subscriber hands its live socket to: a new one when
        a bug ended the last (that one closed itself and its sockets; each of its pods
        moves to the new one, `KvEventSubscriber._rehome`)."""
        if self._closed:
            raise HubClosed("precise mode is closed")
        if self._hub is None or not self._hub.running:
            self._hub = ReceiverHub()
        return self._hub

    def _retire_now(self, name: str) -> None:
        """`name` was followed on an endpoint another pod turned out to share."""
        self.precise.detach(name)
        log.warning(
            "kv_events_endpoint_shared",
            pod=name,
            detail="several pods resolve to one KV-event endpoint (same host): they stay "
            "approximate; give each its own with the kv_events_endpoint label",
        )

    def _retire(self, name: str) -> None:
        follow = self._follows.pop(name, None)
        if follow is None:
            return
        follow.gate.open = False  # nothing it still receives reaches the index
        # Its pod's entries are the caller's to drop (remove_pod or detach), now.
        self._schedule(follow.sub.close(detach=False))

    def _schedule(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            work.close()  # no loop (a service built, never started): nothing runs yet
            return
        task = loop.create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("kv_events_task_failed", error=repr(task.exception())[:200])
