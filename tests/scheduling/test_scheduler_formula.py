"""The Scheduler's decisions over random fleets and requests equal those of the documented
formula, computed here independently and straightforwardly, one pod at a time: the
filters (scheduler.py, filters.py), each factor as the README's "Score" table and the
scorers' docstrings give it, the weighted sum, and the picker's order (picker.py).

This holds the scheduler's fast paths (one pass per scorer, one weighted-sum pass, the
tie-break read on demand) to what they compute. Endpoints are built as tests/helpers.py
builds them, and their derived fields (load, queue depth, concurrency: what `refresh`
produces) are then set at random directly: the scheduler only reads them."""

from __future__ import annotations

import random

import pytest
from helpers import endpoint

from epp.config import SchedulingConfig
from epp.datalayer import ledger
from epp.datalayer.endpoint import Endpoint
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import Completed, Dispatched, SchedulingError, SchedulingRequest

OVERHEAD, PER_TOKEN, PER_CACHED = 0.010, 0.000217, 0.00002


def fleet(rng: random.Random, size: int) -> list[Endpoint]:
    pods = []
    for i in range(size):
        adapters = frozenset(a for a in ("a1", "a2", "a3") if rng.random() < 0.2)
        e = endpoint(
            f"pod-{i}",
            port=9000 + i,
            model=rng.choice(["m", "m", "m", "other", None]),
            health=rng.choice([1.0, 1.0, rng.random()]),
            adapters=adapters,
        )
        e.panic = e.excluded and rng.random() < 0.3
        e.load = rng.choice([0.0, rng.random()])
        e.queue_depth = rng.choice([0.0, 0.0, rng.uniform(0, 25), 20.0])
        e.concurrency = rng.uniform(0, 12)
        e.configured_slots = rng.choice([None, None, 4, 8])
        e.max_loras = rng.choice([None, 2, 4])
        e.in_flight = rng.choice([0, 0, 1, 2, 3, 9])
        e.dispatched_tokens = rng.choice([0, 4096, rng.randrange(100_000)])
        if rng.random() < 0.2:
            ledger.reserve(e, 100, now=rng.uniform(0, 5))  # an open request of known age
        pods.append(e)
    return pods


class Reference:
    """The documented formula, pod by pod, with its own copy of the prefill state."""

    def __init__(self, config: SchedulingConfig) -> None:
        self.config = config
        self.lane_end: dict[str, float] = {}
        self.service: dict[str, float] = {}

    def own_prefill(self, req: SchedulingRequest, pod: Endpoint) -> float:
        cached = min(max(req.prompt_tokens - 1, 0), req.prefix_match.get(pod.name, 0) * 16)
        return OVERHEAD + (req.prompt_tokens - cached) * PER_TOKEN + cached * PER_CACHED

    def dispatched(self, req: SchedulingRequest, pod: Endpoint) -> None:
        start = max(req.now, self.lane_end.get(pod.name, 0.0))
        self.lane_end[pod.name] = start + self.own_prefill(req, pod)

    def completed(self, pod: Endpoint, seconds: float) -> None:
        old = self.service.get(pod.name)
        self.service[pod.name] = seconds if old is None else old + 0.1 * (seconds - old)

    def candidates(self, req: SchedulingRequest, pods: list[Endpoint]) -> list[Endpoint]:
        kept = [
            p
            for p in pods
            if (p.model is None or p.model == req.base_model)
            and (p.panic or not p.excluded)
            and p.queue_depth < self.config.max_queue
        ]
        if self.config.balance.enabled and len(kept) > 1:
            least = min(p.in_flight for p in kept)
            limit = max(least + self.config.balance.abs_requests, least * self.config.balance.ratio)
            kept = [p for p in kept if p.in_flight <= limit]
        return kept

    def factors(self, req: SchedulingRequest, pods: list[Endpoint]) -> dict[str, list[float]]:
        blocks = len(req.block_hashes)
        known = [self.service[p.name] for p in pods if p.name in self.service]
        pool = sum(known) / len(known) if known else None

        def adapter(p: Endpoint) -> float:
            if req.adapter is None or req.adapter in p.adapters:
                return 1.0
            if p.max_loras is not None and len(p.adapters) < p.max_loras:
                return 0.5
            return 0.0

        def ttft(p: Endpoint) -> float:
            wait = max(self.lane_end.get(p.name, 0.0) - req.now, 0.0)
            slots = p.configured_slots
            if slots and p.concurrency - slots + 1 > 0:
                service = self.service.get(p.name, pool)
                if service is None and p.open:
                    service = max(0.0, req.now - min(d.at for d in p.open.values()))
                if service:
                    wait = max(wait, (p.concurrency - slots + 1) * service / slots)
            return wait + self.own_prefill(req, p)

        times = [ttft(p) for p in pods]
        best = min(times)
        return {
            "cache": [req.prefix_match.get(p.name, 0) / blocks if blocks else 0.0 for p in pods],
            "load": [1.0 - p.load for p in pods],
            "queue": [1.0 - min(p.queue_depth / self.config.max_queue, 1.0) for p in pods],
            "health": [p.health for p in pods],
            "adapter": [adapter(p) for p in pods],
            "prefill": [best / t if t > 0 else 1.0 for t in times],
        }


def random_request(rng: random.Random, pods: list[Endpoint], n: int, now: float):
    tokens = rng.choice([0, 10, 512, 4096])
    blocks = tokens // 16
    match = {p.name: rng.randint(0, blocks) for p in pods if blocks and rng.random() < 0.3}
    return SchedulingRequest(
        request_id=f"r{n}",
        model="m",
        base_model="m",
        adapter=rng.choice([None, None, "a1", "a2"]),
        block_hashes=list(range(blocks)),
        prefix_match=match,
        prompt_tokens=tokens,
        block_size=16,
        now=now,
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weights", ["default", "spec", "uneven"])
def test_decisions_equal_the_documented_formula_on_random_fleets(seed, weights, kernels_used):
    rng = random.Random(seed)
    chosen_weights = {
        "default": None,
        "spec": {"cache": 0.60, "load": 0.20, "queue": 0.10, "health": 0.05, "adapter": 0.05},
        "uneven": {"prefill": 0.3, "adapter": 0.1, "cache": 0.35, "queue": 0.25, "load": 0.0},
    }[weights]
    kw = {"fallbacks": 2, "prefill_estimate": {"per_token_s": PER_TOKEN}}
    kw["prefill_estimate"] |= {"overhead_s": OVERHEAD, "per_cached_token_s": PER_CACHED}
    if chosen_weights is not None:
        kw["weights"] = chosen_weights
    config = SchedulingConfig.model_validate(kw)
    weight = {name: w for name, w in config.weights.items() if w > 0}
    scheduler = Scheduler(config, rng=random.Random(seed))
    reference = Reference(config)
    pods = fleet(rng, rng.choice([3, 40, 300]))
    now = 10.0
    for n in range(40):
        now += rng.uniform(0.0, 0.3)
        req = random_request(rng, pods, n, now)
        candidates = reference.candidates(req, pods)
        if not candidates:
            with pytest.raises(SchedulingError):
                scheduler.schedule(req, pods)
            continue
        decision = scheduler.schedule(req, pods)
        assert decision.candidates == candidates
        factors = reference.factors(req, candidates)
        for name, scores in decision.factors.items():
            assert scores == pytest.approx(factors[name], rel=1e-12, abs=1e-15), name
        assert set(decision.factors) == set(weight)
        totals = [
            sum(weight[name] * factors[name][i] for name in weight) for i in range(len(candidates))
        ]
        assert decision.totals == pytest.approx(totals, rel=1e-12, abs=1e-15)

        # The picker: best within tie_epsilon, then fewest in flight, then least work.
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if best - t <= config.tie_epsilon]
        key = {i: (candidates[i].in_flight, candidates[i].dispatched_tokens) for i in tied}
        allowed = {candidates[i].name for i in tied if key[i] == min(key.values())}
        assert decision.primary.name in allowed
        rest = sorted(
            (i for i in range(len(totals)) if i != decision.chosen_index), key=lambda i: -totals[i]
        )
        assert [e.name for e in decision.endpoints[1:]] == [candidates[i].name for i in rest[:2]]

        # The DEBUG breakdown: best first, equal totals in candidate order.
        shown = [row["pod"] for row in decision.breakdown(3)]
        assert shown == [
            candidates[i].name for i in sorted(range(len(totals)), key=lambda i: -totals[i])[:3]
        ]

        # What the router does next: the chosen pod's lane grows; some requests end.
        scheduler.observe(Dispatched(req, decision.primary))
        reference.dispatched(req, decision.primary)
        if rng.random() < 0.5:
            pod, seconds = rng.choice(pods), rng.uniform(0.1, 3.0)
            scheduler.observe(Completed(pod, 200, seconds))
            reference.completed(pod, seconds)
