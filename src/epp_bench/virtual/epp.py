"""Our EPP in virtual time: the server's own library, driven as the ext_proc server drives it.

An EndpointStore on a virtual clock, one Endpoint per simulated pod, a PrefixIndex, the
Scheduler and the Router of `epp.routing`, wired as `epp.app.EppService` wires them
(`epp.wiring.connect`). Each request is prepared with `Router.prepare(IncomingRequest(...))`
on the JSON body Envoy would forward, dispatched through the
Router's flow control (`FlowControl.dispatch`, as `Router.route` does), and ended with
`Router.complete(...)`.

A saturated pool's requests wait in the Router's own flow control
(`epp.routing.flow_control`), as they do live: the store's events (a completion, a scrape)
make a release pass due, and it runs when the event has been handled (`release`, which
the runner calls after every event; live, the event loop's next turn); a waiting
request's TTL is checked on the virtual clock.

Every 50 ms of virtual time (the configured scrape interval) each engine's gauges are
turned into the PodMetrics a scrape of its /metrics page would give, so the scheduler
sees the same lag it sees live; between scrapes only the EPP's own accounting moves.
The fetch is instantaneous here, so a scrape sees every request dispatched before it.

CPU per decision is `time.process_time()` around `route()`: parsing, tokenizing,
hashing, index lookup and record, scheduling and the per-request metrics, at the log
level configured by the caller (the CLI uses warning, so no log line is rendered).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, cast

from epp.config import EndpointConfig, EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest, RequestRejected
from epp.routing import PreparedRequest as RoutingRequest
from epp.routing import RoutedRequest, Router, Saturated
from epp.routing.flow_control import Shed, Ticket
from epp.scheduling.registry import ScorerRegistry
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Dispatched
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.protocol import Tokenizer
from epp.wiring import connect
from epp_bench.virtual.types import WAITING, PreparedRequest, RouteChoice, VirtualPods
from vllm_sim.engine import SimEngine

# The virtual pods' requests carry their workload priority in this header, which the
# EPP here is configured to trust (live, the gateway must strip it from clients).
PRIORITY_HEADER = "x-bench-priority"


def pod_address(index: int) -> str:
    """A distinct ip:port per pod (the EPP keys endpoints by address too)."""
    host = index + 1
    return f"10.{host // 65536}.{host // 256 % 256}.{host % 256}:8000"


def scrape(
    engine: SimEngine, served_model: str, with_lora: bool, now: float | None = None
) -> PodMetrics:
    """What parsing the simulated pod's /metrics page would give, read off the engine.

    With `now`, requests queued behind the pod's prefills count as waiting, as on the
    page (`vllm_sim.metrics_page`).
    """
    config = engine.config
    counters = engine.counters
    queued = 0 if now is None else engine.num_prefill_queued(now)
    return PodMetrics(
        waiting=float(engine.num_waiting + queued),
        running=float(engine.num_running - queued),
        kv_usage=engine.kv_cache_usage,
        prefix_queries=float(counters.prefix_cache_queries),
        prefix_hits=float(counters.prefix_cache_hits),
        preemptions=float(counters.preemptions),
        generation_tokens=float(counters.generation_tokens),
        model=served_model,
        running_adapters=frozenset(engine.running_adapters),
        waiting_adapters=frozenset(engine.waiting_adapters),
        max_loras=config.max_loras if with_lora else None,
        block_size=config.block_size,
        num_gpu_blocks=config.num_gpu_blocks,
    )


class EppVirtualRouter:
    """The EPP behind the VirtualRouter contract (see `epp_bench.virtual.types`)."""

    name = "epp"

    def __init__(
        self,
        pods: VirtualPods,
        config: EppConfig | None = None,
        *,
        seed: int = 0,
        adapters: dict[str, str] | None = None,
        registry: ScorerRegistry | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        base = config or EppConfig()
        endpoints = [
            EndpointConfig(name=name, address=pod_address(i)) for i, name in enumerate(pods.names)
        ]
        self.config = EppConfig.model_validate(
            {
                **base.model_dump(),
                "endpoints": endpoints,
                "adapters": {**base.adapters, **(adapters or {})},
                "flow_control": {
                    **base.flow_control.model_dump(),
                    "priority_header": PRIORITY_HEADER,
                },
            }
        )
        self._pods = pods
        self._with_lora = bool(adapters)
        self._now = 0.0
        self.store = EndpointStore.for_config(self.config, clock=self._clock)
        self.store.sync(self.config.endpoints)
        # On the virtual clock: a precise pod's predicted entries expire in virtual time.
        self.index = PrefixIndex.from_config(self.config.prefix, clock=self._clock)
        self.scheduler = Scheduler(
            self.config.scheduling, registry=registry, rng=random.Random(seed)
        )
        self.router = Router(
            self.config,
            self.store,
            self.index,
            self.scheduler,
            tokenizer or ByteEstimateTokenizer(),
            EppMetrics(),
        )
        connect(self.store, self.index, self.router, self.config)
        self._endpoints = [self.store.get(name) for name in pods.names]
        self._pod_of = {name: i for i, name in enumerate(pods.names)}
        self._interval = self.config.datalayer.scrape_interval_s
        self._next_scrape = 0.0
        self.cpu_seconds = 0.0
        self.decisions = 0
        self.rejected = 0
        # Did the chosen pod hold the best prefix any candidate held? (the EPP's
        # epp_cache_match_ratio vs epp_best_cache_match_ratio, summed here)
        self._chosen_match = 0.0
        self._best_match = 0.0
        self._lost_reuse = 0
        self._saturation_filtered = 0
        self.flow = self.router.flow_control
        self._answered: list[_BenchTicket] = []  # placed or failed since the last release
        self.queued = 0
        self.wait_seconds = 0.0
        self.refused_by_class: dict[str, int] = {}
        # Request index -> (blocks the index matched on the chosen pod, the router's prompt
        # tokens) of every dispatched request: the stale-routing check (runner) compares
        # them with what the engine reused. Heard from the router's decisions, released
        # ones included.
        self.predictions: dict[int, tuple[int, int]] = {}
        self.router.hooks.shared.append(self._predicted)

    def _clock(self) -> float:
        return self._now

    def tick(self, now: float) -> None:
        if now >= self._next_scrape:
            # The most recent scrape instant at or before `now`; the engines have not
            # changed since it (events are processed in time order).
            ticks = int(now / self._interval)
            self._now = ticks * self._interval
            self._scrape_all()
            self._next_scrape = (ticks + 1) * self._interval
        self._now = now

    def _scrape_all(self) -> None:
        served = self._pods.served_model
        for endpoint, engine in zip(self._endpoints, self._pods.engines, strict=True):
            assert endpoint is not None
            self.store.scraped(endpoint, scrape(engine, served, self._with_lora, self._now))

    def route(self, request: PreparedRequest, now: float) -> RouteChoice:
        started = time.process_time()
        self.decisions += 1
        try:
            prepared = self.router.prepare(
                IncomingRequest(
                    path=request.path,
                    body=request.body,
                    request_id=f"r{request.index}",
                    headers={PRIORITY_HEADER: str(request.priority)},
                ),
            )
            routed = self.flow.dispatch(prepared)  # waiting requests of its rank first
        except Saturated:
            choice = self._admit(request, prepared, now)
            self.cpu_seconds += time.process_time() - started
            return choice
        except RequestRejected as exc:
            self.cpu_seconds += time.process_time() - started
            return self._refused(request, exc.status, exc.reason)
        self.cpu_seconds += time.process_time() - started
        self._observe(routed)
        return RouteChoice(self._pod_of[routed.endpoint.name], ticket=routed)

    def _predicted(self, event: Dispatched, uncached: int) -> None:
        """The blocks the index matched on the chosen pod, before recording the prompt."""
        sched = event.request
        matched = sched.prefix_match.get(event.endpoint.name, 0)
        self.predictions[int(sched.request_id[1:])] = (matched, sched.prompt_tokens)

    # -- admission: the Router's flow control on virtual time ------------------------
    def _refused(self, request: PreparedRequest, status: int, reason: str) -> RouteChoice:
        self.rejected += 1
        key = "sheddable" if request.priority < 0 else "normal"
        self.refused_by_class[key] = self.refused_by_class.get(key, 0) + 1
        return RouteChoice(None, status, reason)

    def _admit(self, request: PreparedRequest, prepared: RoutingRequest, now: float) -> RouteChoice:
        ticket = _BenchTicket(prepared, request, now, self._answered)
        try:
            self.flow.offer(ticket, now)
        except Shed as exc:
            return self._refused(request, exc.status, exc.reason)
        self.queued += 1
        return RouteChoice(None, WAITING, "waiting")

    def release(self, now: float, final: bool = False) -> list[tuple[int, RouteChoice]]:
        """What the router's flow control answered since the last call: requests whose
        TTL passed by `now`, then those the due release pass placed (or refused)."""
        out = [self._expired(w.item) for w in self.flow.expire(now)]
        self.flow.run_due()
        out += [self._answer(ticket, now) for ticket in self._answered]
        self._answered.clear()
        if final:  # the run is over: nothing returns room to what still waits
            for waiting in self.flow.waiting():
                self.flow.leave(waiting)
                out.append(self._expired(waiting.item))
        return out

    def _expired(self, ticket: Ticket) -> tuple[int, RouteChoice]:
        refusal = self.flow.expiry_refusal()
        request = cast(_BenchTicket, ticket).request
        return request.index, self._refused(request, refusal.status, refusal.reason)

    def _answer(self, ticket: _BenchTicket, now: float) -> tuple[int, RouteChoice]:
        request = ticket.request
        if ticket.error is not None:
            if not isinstance(ticket.error, RequestRejected):
                raise ticket.error
            return request.index, self._refused(request, ticket.error.status, ticket.error.reason)
        routed = ticket.routed
        assert routed is not None
        self.wait_seconds += now - ticket.enqueued_at
        self._observe(routed)
        return request.index, RouteChoice(self._pod_of[routed.endpoint.name], ticket=routed)

    def _observe(self, routed: RoutedRequest) -> None:
        decision = routed.decision
        cache = decision.factors.get("cache")
        if cache:
            chosen = cache[decision.chosen_index]
            best = max(cache)
            self._chosen_match += chosen
            self._best_match += best
            if chosen < best - 1e-9:
                self._lost_reuse += 1
        if "saturation" in decision.filtered_out:
            self._saturation_filtered += 1

    def complete(self, choice: RouteChoice, status: int) -> None:
        assert isinstance(choice.ticket, RoutedRequest)
        self.router.complete(choice.ticket, status)

    def stats(self) -> dict[str, Any]:
        routed = self.decisions - self.rejected
        return {
            "decisions": self.decisions,
            "rejected_by_epp": self.rejected,
            "mean_chosen_cache_match": self._chosen_match / routed if routed else None,
            "mean_best_cache_match": self._best_match / routed if routed else None,
            "decisions_below_best_match": self._lost_reuse,
            "decisions_with_saturated_pods": self._saturation_filtered,
            "waited_in_epp": self.queued,
            "mean_wait_s": self.wait_seconds / self.queued if self.queued else 0.0,
            "refused_by_class": dict(self.refused_by_class),
            "index_capacity_blocks": self.index.capacity(self._pods.names[0]),
            "weights": dict(self.scheduler.weights),
            "max_queue": self.config.scheduling.max_queue,
        }


@dataclass(slots=True)
class _BenchTicket:
    """A request waiting in the router's flow control on the virtual clock: its answer is
    kept until the runner asks (`EppVirtualRouter.release`)."""

    prepared: RoutingRequest
    request: PreparedRequest
    enqueued_at: float
    answered: list[_BenchTicket] = field(repr=False)
    routed: RoutedRequest | None = None
    error: Exception | None = None

    def gone(self) -> bool:
        return self.routed is not None or self.error is not None

    def placed(self, routed: RoutedRequest) -> None:
        self.routed = routed
        self.answered.append(self)

    def failed(self, exc: Exception) -> None:
        self.error = exc
        self.answered.append(self)
