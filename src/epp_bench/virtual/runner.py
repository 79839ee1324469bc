"""Replay a workload over N simulated pods in virtual time: seconds of CPU, no sockets.

One `SimEngine` per pod (the model behind `epp sim`), a heap of timed events, and a
router (ours, or a baseline from `epp_bench.virtual.baselines`). Deterministic for a seed: the
same workload, pods, router and seed give the same outcomes, bit for bit.

Events, in virtual seconds:

- arrival: the router picks a pod, the engine queues the request (or refuses it: a 429
  outcome, as the pod's HTTP server answers), then starts whatever can start;
- first token: `prefill_seconds` after a request starts, as the engine computed it: the
  wait for the pod's prefill compute (first come, first served) and the request's own
  prefill (queueing + prefill wait + prefill = TTFT);
- finish: the request's last token; the engine frees its slot and blocks and starts the
  next waiting requests. A follow-up turn (`after`) is then sent `think_s` later;
- re-plan: a prefill that waited begins (the decode step time may change).

Decoding is integrated per pod rather than token by token: every running request on a
pod advances one token per `decode_step_seconds(now)`, which changes only when the
pod's batch changes or a prefill begins or ends (a step taken during a prefill carries a
chunk of it, see `vllm_sim.engine`), so the pod keeps one decode clock (tokens produced
since the start) and one pending "next finish" event, re-planned at each of those
events. This is the server's per-token schedule (`vllm_sim.server`) up to at most one
step per change, for three events per request instead of one per token. (Within the
last chunk of a prefill backlog, the step is taken as it was when the backlog last
changed: the engine's chunk shrinks continuously there, the runner's does not.)

TTFT and latency are measured from the moment the request is sent (routing costs no
virtual time; the EPP's CPU per decision is measured separately), as a client measures.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epp.config import EppConfig
from epp_bench.virtual.baselines import (
    ConsistentHash,
    LeastOutstanding,
    Oracle,
    RandomChoice,
    RoundRobin,
)
from epp_bench.virtual.epp import EppVirtualRouter
from epp_bench.virtual.precise import (
    ApproxEngineTokEppRouter,
    PreciseEppRouter,
    engine_stale,
)
from epp_bench.virtual.prepare import prepare
from epp_bench.virtual.types import (
    WAITING,
    PreparedRequest,
    RouteChoice,
    VirtualPods,
    VirtualRouter,
)
from epp_bench.virtual.whatif import (
    WHATIF_ROUTERS,
    PrefillAwareEppRouter,
    spec_config,
)
from epp_bench.workloads.types import RequestOutcome, RunResult, Workload
from vllm_sim.engine import Admission, EngineConfig, SimEngine

# Routers whose pods publish KV events (the engines queue them; the runner drains them).
# epp_precise with predicted entries living a fixed time from dispatch (predicted_max_s =
# predicted_ttl_s), whatever their request does: the design before, and a longer what-if.
FIXED_TTL_ROUTERS = {"epp_precise_fixed2": 2.0, "epp_precise_fixed30": 30.0}
KV_EVENT_ROUTERS = frozenset({"epp_precise", *FIXED_TTL_ROUTERS})
ROUTERS = ("epp", "round_robin", "random", "least_outstanding", "consistent_hash", "oracle")

_ARRIVAL = 0
_FIRST_TOKEN = 1
_FINISH = 2
_REPLAN = 3
# Decode progress is a float sum of step fractions; a target this close counts as reached.
_TOKEN_EPSILON = 1e-6


def make_router(
    name: str,
    pods: VirtualPods,
    *,
    seed: int = 0,
    epp_config: EppConfig | None = None,
    adapters: dict[str, str] | None = None,
) -> VirtualRouter:
    if name == "epp":
        return EppVirtualRouter(pods, epp_config, seed=seed, adapters=adapters)
    if name == "epp_prefill":
        return PrefillAwareEppRouter(pods, epp_config, seed=seed, adapters=adapters)
    if name == "epp_precise":
        return PreciseEppRouter(pods, epp_config, seed=seed, adapters=adapters)
    if name in FIXED_TTL_ROUTERS:
        # Before predicted entries followed their request: a fixed life from dispatch.
        ttl = FIXED_TTL_ROUTERS[name]
        fixed = PreciseEppRouter(
            pods, epp_config, seed=seed, adapters=adapters, predicted_ttl_s=ttl, predicted_max_s=ttl
        )
        fixed.name = name
        return fixed
    if name == "epp_approx_engine_tok":
        return ApproxEngineTokEppRouter(pods, epp_config, seed=seed, adapters=adapters)
    if name == "epp_spec":
        spec = EppVirtualRouter(pods, spec_config(epp_config), seed=seed, adapters=adapters)
        spec.name = "epp_spec"
        return spec
    if name == "round_robin":
        return RoundRobin(len(pods))
    if name == "random":
        return RandomChoice(len(pods), seed)
    if name == "least_outstanding":
        return LeastOutstanding(len(pods), seed)
    if name == "consistent_hash":
        return ConsistentHash(pods.names)
    if name == "oracle":
        return Oracle(pods)
    known = ", ".join((*ROUTERS, *WHATIF_ROUTERS))
    raise ValueError(f"unknown router {name!r}; choose from {known}")


@dataclass(slots=True)
class _Pod:
    engine: SimEngine
    # Tokens each decoding request has produced since t=0 (all advance together).
    progress: float = 0.0
    updated_at: float = 0.0
    step_s: float = 0.0
    # (progress at which the request's last token is out, request index)
    targets: list[tuple[float, int]] = field(default_factory=list)
    version: int = 0  # invalidates the pending finish event when the batch changes


@dataclass(slots=True)
class _Flight:
    choice: RouteChoice
    sent_s: float
    first_token_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


class _Simulation:
    def __init__(
        self,
        prepared: Sequence[PreparedRequest],
        workload: Workload,
        pods: VirtualPods,
        router: VirtualRouter,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.prepared = prepared
        self.requests = workload.requests
        self.pods = pods
        self.router = router
        self.progress = progress
        self.state = [_Pod(engine) for engine in pods.engines]
        self.zero_decode = [e.config.decode_per_token_s == 0 for e in pods.engines]
        # Routers in precise mode take the engines' KV events (drained after each call).
        self.on_kv_events: Callable[[int, list, float], None] | None = getattr(
            router, "on_kv_events", None
        )
        self.flights: dict[int, _Flight] = {}
        self.arrived: dict[int, float] = {}  # held by the router: index -> arrival time
        self.outcomes: list[RequestOutcome | None] = [None] * len(prepared)
        self.followers: dict[int, list[int]] = {}
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        for request in workload.requests:
            if request.after is None:
                self._push(request.arrival_s, _ARRIVAL, request.index, 0)
            else:
                self.followers.setdefault(request.after, []).append(request.index)

    def _push(self, at: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, a, b))

    def run(self) -> list[RequestOutcome]:
        heap = self.heap
        tick = self.router.tick
        now = 0.0
        while True:
            if not heap:
                # Nothing left in flight: whatever the router still holds is answered now.
                if not self._release(now, final=True):
                    break
                continue
            now, _, kind, a, b = heapq.heappop(heap)
            tick(now)
            if kind == _ARRIVAL:
                self._arrive(a, now)
            elif kind == _FIRST_TOKEN:
                self._first_token(a, b, now)
            elif kind == _FINISH:
                self._finish_due(a, b, now)
            else:
                self._advance(a, now)
                self._schedule_finish(a, now)
            self._release(now)
        missing = [i for i, outcome in enumerate(self.outcomes) if outcome is None]
        if missing:
            raise RuntimeError(f"{len(missing)} requests never ended (first: {missing[0]})")
        return [o for o in self.outcomes if o is not None]

    # -- events ----------------------------------------------------------------------------

    def _release(self, now: float, final: bool = False) -> bool:
        """Requests the router held (admission) that now have a pod or an answer."""
        released = self.router.release(now, final)
        for index, choice in released:
            self._send(index, choice, self.arrived.pop(index, now), now)
        return bool(released)

    def _arrive(self, index: int, now: float) -> None:
        request = self.prepared[index]
        choice = self.router.route(request, now)
        if choice.status == WAITING and choice.pod is None:
            self.arrived[index] = now  # held by the router's admission queue
            return
        self._send(index, choice, now, now)

    def _send(self, index: int, choice: RouteChoice, arrived: float, now: float) -> None:
        request = self.prepared[index]
        if choice.pod is None:
            self._record(index, None, choice.status, arrived, now, error=choice.reason)
            return
        engine = self.pods.engines[choice.pod]
        admission = engine.submit(
            f"r{index}",
            request.hashes,
            request.prompt_tokens,
            request.max_tokens,
            request.adapter,
            prompt_token_ids=request.token_ids if engine.kv_events_enabled else None,
        )
        if admission is not Admission.QUEUED:
            status = 429 if admission is Admission.QUEUE_FULL else 400
            self.router.complete(choice, status)
            self._record(index, choice.pod, status, now, now, error=str(admission))
            return
        self.flights[index] = _Flight(choice, arrived, prompt_tokens=request.prompt_tokens)
        self._start_ready(choice.pod, now)

    def _first_token(self, pod_index: int, index: int, now: float) -> None:
        flight = self.flights[index]
        flight.first_token_s = now
        remaining = self.prepared[index].max_tokens - 1
        if remaining == 0 or self.zero_decode[pod_index]:
            self._advance(pod_index, now)
            self._end(pod_index, index, now)
            self._start_ready(pod_index, now)
            return
        pod = self.state[pod_index]
        self._advance(pod_index, now)
        target = pod.progress + remaining
        heapq.heappush(pod.targets, (target, index))
        # A prefill just ended: the step may have changed even if the next finish did not.
        self._schedule_finish(pod_index, now)

    def _finish_due(self, pod_index: int, version: int, now: float) -> None:
        pod = self.state[pod_index]
        if version != pod.version:
            return  # the batch changed since this was scheduled
        self._advance(pod_index, now)
        reached = pod.progress + _TOKEN_EPSILON
        while pod.targets and pod.targets[0][0] <= reached:
            _, index = heapq.heappop(pod.targets)
            self._end(pod_index, index, now)
        self._start_ready(pod_index, now)

    # -- pod bookkeeping -------------------------------------------------------------------

    def _advance(self, pod_index: int, now: float) -> None:
        """Bring the pod's decode clock to `now` at the step of its current batch."""
        pod = self.state[pod_index]
        if pod.step_s > 0:
            pod.progress += (now - pod.updated_at) / pod.step_s
        pod.updated_at = now

    def _schedule_finish(self, pod_index: int, now: float) -> None:
        """The batch (or the earliest target) changed: re-plan the next finish."""
        pod = self.state[pod_index]
        pod.step_s = pod.engine.decode_step_seconds(now)
        pod.version += 1
        if pod.targets:
            left = max(0.0, pod.targets[0][0] - pod.progress)
            self._push(now + left * pod.step_s, _FINISH, pod_index, pod.version)

    def _start_ready(self, pod_index: int, now: float) -> None:
        """Start what can start; the batch may have changed (finish or start), so re-plan."""
        self._advance(pod_index, now)
        engine = self.pods.engines[pod_index]
        for started in engine.start_ready(now):
            index = int(started.req_id[1:])
            self.flights[index].cached_tokens = started.cached_tokens
            self._push(now + started.prefill_seconds, _FIRST_TOKEN, pod_index, index)
            if started.prefill_wait_seconds > 0:
                self._push(now + started.prefill_wait_seconds, _REPLAN, pod_index, 0)
        self._publish(pod_index, now)
        self._schedule_finish(pod_index, now)

    def _publish(self, pod_index: int, now: float) -> None:
        """The engine's KV events since its last call, to a precise router."""
        if self.on_kv_events is not None:
            events = self.pods.engines[pod_index].drain_kv_events()
            if events:
                self.on_kv_events(pod_index, events, now)

    def _end(self, pod_index: int, index: int, now: float) -> None:
        flight = self.flights.pop(index)
        output_tokens = self.prepared[index].max_tokens
        self.pods.engines[pod_index].finish(f"r{index}", output_tokens)
        self._publish(pod_index, now)
        self.router.complete(flight.choice, 200)
        assert flight.first_token_s is not None
        self._record(
            index,
            pod_index,
            200,
            flight.sent_s,
            now,
            ttft=flight.first_token_s - flight.sent_s,
            prompt_tokens=flight.prompt_tokens,
            cached_tokens=flight.cached_tokens,
            output_tokens=output_tokens,
        )

    def _record(
        self,
        index: int,
        pod_index: int | None,
        status: int,
        sent: float,
        now: float,
        *,
        ttft: float | None = None,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        output_tokens: int = 0,
        error: str | None = None,
    ) -> None:
        self.outcomes[index] = RequestOutcome(
            index=index,
            pod=None if pod_index is None else self.pods.names[pod_index],
            status=status,
            start_s=sent,
            ttft_s=ttft,
            latency_s=now - sent,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            output_tokens=output_tokens,
            error=error,
        )
        for follower in self.followers.get(index, ()):
            request = self.requests[follower]
            self._push(max(request.arrival_s, now + request.think_s), _ARRIVAL, follower, 0)
        if self.progress is not None:
            self.progress(1)


def run_virtual(
    workload: Workload,
    router: str,
    *,
    pods: int = 8,
    engine: EngineConfig | None = None,
    seed: int = 0,
    prepared: Sequence[PreparedRequest] | None = None,
    epp_config: EppConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """One router on one workload; `prepared` (from `prepare(workload)`) may be reused
    across routers and rates of the same prompts."""
    if not 1 <= pods <= 4096:
        raise ValueError(f"pods must be in [1, 4096], got {pods}")
    engine_config = engine or EngineConfig()
    if prepared is None:
        prepared = prepare(workload, engine_config.block_size)
    if len(prepared) != len(workload.requests):
        raise ValueError("prepared requests do not match the workload")
    adapters: dict[str, str] = dict(workload.params.get("adapters", {}))
    served = str(
        workload.params.get("base_model")
        or workload.params.get("model")
        or (workload.requests[0].model if workload.requests else "")
    )
    kv_events = router in KV_EVENT_ROUTERS
    fleet = VirtualPods(
        names=tuple(f"pod-{i}" for i in range(pods)),
        engines=tuple(SimEngine(engine_config, kv_events=kv_events) for _ in range(pods)),
        served_model=served,
    )
    chosen = make_router(router, fleet, seed=seed, epp_config=epp_config, adapters=adapters)
    wall_started = time.perf_counter()
    outcomes = _Simulation(prepared, workload, fleet, chosen, progress).run()
    wall_s = time.perf_counter() - wall_started
    first_sent = min((o.start_s for o in outcomes), default=0.0)
    last_end = max((o.start_s + o.latency_s for o in outcomes), default=0.0)
    hits = sum(e.counters.prefix_cache_hits for e in fleet.engines)
    queries = sum(e.counters.prefix_cache_queries for e in fleet.engines)
    stats = chosen.stats()
    cpu_us: float | None = None
    if isinstance(chosen, EppVirtualRouter):
        stats.update(engine_stale(chosen.predictions, outcomes, prepared, engine_config.block_size))
        if chosen.decisions:
            cpu_us = chosen.cpu_seconds / chosen.decisions * 1e6
    return RunResult(
        router=router,
        workload=workload.name,
        rate=workload.params.get("rate"),
        pods=pods,
        duration_s=last_end - first_sent,
        outcomes=outcomes,
        pod_hit_rate=hits / queries if queries else None,
        epp_cpu_us_per_decision=cpu_us,
        mode="virtual",
        extra={
            "seed": seed,
            "wall_s": wall_s,
            "pod_names": list(fleet.names),
            "engine": _engine_dict(engine_config),
            "prefix_cache_hits": hits,
            "prefix_cache_queries": queries,
            "router_stats": stats,
            "workload_description": workload.description,
        },
    )


def _engine_dict(config: EngineConfig) -> dict[str, float | int]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}
