"""The virtual-time runner: deterministic, faithful to the engine, fair to every router."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import replace

import pytest
import structlog

from epp.config import EppConfig
from epp.prefix.hashing import block_hashes as epp_block_hashes
from epp.prefix.hashing import chain_seed
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp_bench.virtual.baselines import ConsistentHash
from epp_bench.virtual.prepare import distinct_prefix_blocks, prepare, size_kv_for_fraction
from epp_bench.virtual.runner import ROUTERS, make_router, run_virtual
from epp_bench.virtual.types import VirtualPods
from epp_bench.workloads import catalog as workloads
from epp_bench.workloads.types import RunResult
from vllm_sim.engine import Admission, EngineConfig, SimEngine
from vllm_sim.hashing import block_hashes as sim_block_hashes
from vllm_sim.tokenizer import ChatMessage, SimTokenizer

FAST = EngineConfig(
    num_gpu_blocks=2048,
    max_num_seqs=4,
    max_waiting=64,
    prefill_overhead_s=0.002,
    prefill_per_token_s=0.0001,
    decode_per_token_s=0.001,
)
SMALL = workloads.SharedPrefixShape(
    groups=8, prompts_per_group=4, system_tokens=256, question_tokens=32, output_tokens=16
)


@pytest.fixture(autouse=True)
def quiet_routing_logs() -> Iterator[None]:
    """The router logs one line per request at info; keep test output (and time) small."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="module")
def small() -> workloads.Workload:
    return workloads.shared_prefix(SMALL, rate=20.0, seed=1)


def _run(workload: workloads.Workload, router: str, **kwargs: object) -> RunResult:
    options: dict[str, object] = {"pods": 4, "engine": FAST, "seed": 0} | kwargs
    return run_virtual(workload, router, **options)  # type: ignore[arg-type]


def _key(result: RunResult) -> list[tuple[object, ...]]:
    return [
        (o.index, o.pod, o.status, o.start_s, o.ttft_s, o.latency_s, o.cached_tokens)
        for o in result.outcomes
    ]


@pytest.mark.parametrize("router", ROUTERS)
def test_every_router_serves_every_request_deterministically(
    small: workloads.Workload, router: str
) -> None:
    first = _run(small, router)
    second = _run(small, router)
    assert _key(first) == _key(second)
    assert first.pod_hit_rate == second.pod_hit_rate
    assert len(first.outcomes) == len(small.requests)
    assert all(o.ok for o in first.outcomes)
    assert all(o.ttft_s is not None and 0 < o.ttft_s < o.latency_s for o in first.outcomes)
    # The run's span: from the first request sent to the last one ended.
    ends = [o.start_s + o.latency_s for o in first.outcomes]
    starts = [o.start_s for o in first.outcomes]
    assert first.duration_s == pytest.approx(max(ends) - min(starts))
    assert first.mode == "virtual" and first.rate == 20.0 and first.pods == 4


def _exact_prompts(workload: workloads.Workload, tokens: int) -> workloads.Workload:
    """`workload` with each completion prompt replaced by one of exactly `tokens` engine
    tokens (BOS, then one distinct one-token word repeated), distinct across requests."""
    requests = tuple(
        replace(r, prompt=f" {chr(ord('a') + r.index)}" * (tokens - 1)) for r in workload.requests
    )
    return replace(workload, requests=requests)


def test_single_request_timing_matches_the_engine_model() -> None:
    workload = workloads.no_reuse(requests=1, prompt_tokens=100, output_tokens=50)
    outcome = _run(workload, "round_robin", pods=1).outcomes[0]
    # The engine counts its own tokens: about the workload's 100 pseudo-tokens.
    tokens = prepare(workload)[0].prompt_tokens
    assert 80 <= tokens <= 120
    prefill = FAST.prefill_overhead_s + tokens * FAST.prefill_per_token_s
    assert outcome.ttft_s == pytest.approx(prefill)
    # 49 more tokens, one decode step each, batch of one.
    assert outcome.latency_s == pytest.approx(prefill + 49 * FAST.decode_per_token_s)
    assert outcome.output_tokens == 50 and outcome.prompt_tokens == tokens


def test_decode_slows_as_the_batch_fills() -> None:
    engine = EngineConfig(
        max_num_seqs=4, batch_slowdown=1.0, prefill_overhead_s=0.0, prefill_per_token_s=0.0
    )
    # Same prompt length, no reuse, all at once, prefills that take no time: four decode
    # in lockstep and finish together.
    workload = workloads.with_rate(
        workloads.no_reuse(requests=4, prompt_tokens=64, output_tokens=101), 1e9
    )
    outcomes = _run(workload, "round_robin", pods=1, engine=engine).outcomes
    # Four running: each step is 1 ms x (1 + 1.0 x 3/4); 100 steps after the first token.
    for outcome in outcomes:
        assert outcome.latency_s - outcome.ttft_s == pytest.approx(100 * 0.001 * 1.75, rel=1e-6)


def test_oracle_hit_rate_bounds_every_router(small: workloads.Workload) -> None:
    prepared = prepare(small)
    rates = {r: _run(small, r, prepared=prepared).pod_hit_rate for r in ROUTERS}
    assert all(rate is not None for rate in rates.values())
    for router, rate in rates.items():
        assert rates["oracle"] >= rate - 1e-12, (router, rates)
    # The shape's ideal: every prompt after its group's first reuses the system prompt.
    assert rates["oracle"] > rates["round_robin"]


def test_epp_reuses_prefixes_like_the_oracle(small: workloads.Workload) -> None:
    epp = _run(small, "epp")
    oracle = _run(small, "oracle")
    assert epp.pod_hit_rate is not None and oracle.pod_hit_rate is not None
    assert epp.pod_hit_rate >= 0.9 * oracle.pod_hit_rate
    assert epp.epp_cpu_us_per_decision is not None and epp.epp_cpu_us_per_decision > 0
    stats = epp.extra["router_stats"]
    assert stats["decisions"] == len(small.requests)
    assert stats["index_capacity_blocks"] == FAST.num_gpu_blocks  # learned from the scrape


def test_round_robin_spreads_evenly(small: workloads.Workload) -> None:
    result = _run(small, "round_robin")
    counts: dict[str, int] = {}
    for outcome in result.outcomes:
        assert outcome.pod is not None
        counts[outcome.pod] = counts.get(outcome.pod, 0) + 1
    assert len(counts) == 4
    assert max(counts.values()) - min(counts.values()) <= 1


def test_consistent_hashing_sends_one_group_to_one_pod(small: workloads.Workload) -> None:
    result = _run(small, "consistent_hash")
    pods_of_group: dict[str, set[str]] = {}
    for request, outcome in zip(small.requests, result.outcomes, strict=True):
        assert outcome.pod is not None
        pods_of_group.setdefault(request.group, set()).add(outcome.pod)
    assert all(len(pods) == 1 for pods in pods_of_group.values())
    assert len({next(iter(p)) for p in pods_of_group.values()}) > 1  # groups do spread


def test_consistent_hash_ring_moves_few_keys_when_a_pod_joins() -> None:
    names = tuple(f"pod-{i}" for i in range(8))
    before = ConsistentHash(names)
    after = ConsistentHash((*names, "pod-8"))
    workload = workloads.no_reuse(requests=400, prompt_tokens=64)
    prepared = prepare(workload)
    moved = sum(
        1 for request in prepared if before.route(request, 0.0).pod != after.route(request, 0.0).pod
    )
    assert moved < 400 * 0.25  # about 1/9 should move; round robin would move most


def test_multi_turn_follow_ups_wait_for_the_previous_turn() -> None:
    workload = workloads.multi_turn(
        conversations=6, turns=3, system_prompts=2, system_tokens=128, user_tokens=16,
        reply_tokens=8, think_s=0.5, rate=4.0, seed=2,
    )  # fmt: skip
    for router in ("epp", "round_robin"):
        result = _run(workload, router)
        ends = {o.index: o.start_s + o.latency_s for o in result.outcomes}
        starts = {o.index: o.start_s for o in result.outcomes}
        for request in workload.requests:
            if request.after is not None:
                assert starts[request.index] == pytest.approx(
                    max(request.arrival_s, ends[request.after] + request.think_s)
                )
                assert starts[request.index] >= ends[request.after]


def test_epp_keeps_conversations_on_their_pod() -> None:
    workload = workloads.multi_turn(
        conversations=8, turns=4, system_prompts=2, system_tokens=256, user_tokens=16,
        reply_tokens=16, think_s=0.2, rate=4.0, seed=3,
    )  # fmt: skip
    result = _run(workload, "epp")
    pods_of_session: dict[str | None, set[str | None]] = {}
    for request, outcome in zip(workload.requests, result.outcomes, strict=True):
        pods_of_session.setdefault(request.session, set()).add(outcome.pod)
    assert all(len(pods) == 1 for pods in pods_of_session.values())
    assert result.pod_hit_rate is not None
    assert result.pod_hit_rate > _run(workload, "round_robin").pod_hit_rate  # type: ignore[operator]


def test_full_queues_answer_429() -> None:
    tight = EngineConfig(max_num_seqs=1, max_waiting=1, num_gpu_blocks=512)
    workload = workloads.burst(
        requests=12, prefix_tokens=64, question_tokens=8, output_tokens=20, window_s=0.0
    )
    for router in ("round_robin", "least_outstanding", "oracle"):
        result = _run(workload, router, pods=2, engine=tight)
        statuses = [o.status for o in result.outcomes]
        # Each pod runs one and queues one: four served, the rest refused by the pods.
        assert statuses.count(200) == 4, router
        assert statuses.count(429) == 8, router
        refused = [o for o in result.outcomes if o.status == 429]
        assert all(o.ttft_s is None and o.output_tokens == 0 and o.pod for o in refused)


def test_a_saturated_pool_holds_normal_requests_and_sheds_only_sheddable_ones() -> None:
    """Admission in virtual time (the live EPP's queue, scheduling/admission.py): once a
    scrape shows the single 1-slot pod saturated, normal requests wait in the EPP and are
    all served; sheddable ones (priority < 0) get 429 at once."""
    workload = workloads.burst(
        requests=60, prefix_tokens=64, question_tokens=8, output_tokens=20, window_s=0.5
    )
    tight = EngineConfig(max_num_seqs=1, max_waiting=100, num_gpu_blocks=512)
    prepared = prepare(workload, tight.block_size)
    held = _run(workload, "epp", pods=1, engine=tight, prepared=prepared)
    assert all(o.status == 200 for o in held.outcomes)
    assert held.extra["router_stats"]["waited_in_epp"] > 0
    mixed = tuple(replace(p, priority=-1 if p.index % 2 else 0) for p in prepared)
    shed = _run(workload, "epp", pods=1, engine=tight, prepared=mixed)
    refused = [o for o in shed.outcomes if o.status != 200]
    assert refused and all(o.index % 2 == 1 for o in refused)
    assert all(o.error == "rejected-saturated" for o in refused)
    assert all(o.status == 200 for o in shed.outcomes if o.index % 2 == 0)


def test_multi_lora_runs_with_adapters_on_every_router() -> None:
    workload = workloads.multi_lora(
        adapters=6, requests=60, prefix_tokens=64, question_tokens=16, output_tokens=8, rate=20.0
    )
    assert {r.model for r in workload.requests} <= set(workload.params["adapters"])
    hit_rates = {}
    for router in ROUTERS:
        result = _run(workload, router)
        assert len(result.outcomes) == 60 and all(o.ok for o in result.outcomes), router
        hit_rates[router] = result.pod_hit_rate
    # Each tenant's prompts open with its own prefix: the EPP keeps a tenant where its
    # prefix is cached, round robin scatters them.
    assert hit_rates["epp"] is not None and hit_rates["round_robin"] is not None
    assert hit_rates["epp"] > hit_rates["round_robin"], hit_rates


def test_prefills_on_one_pod_queue_first_come_first_served() -> None:
    workload = workloads.no_reuse(requests=3, prompt_tokens=100, output_tokens=4, rate=1000.0)
    workload = workloads.with_rate(workload, 1e6)  # all three within a microsecond
    workload = _exact_prompts(workload, 100)
    assert [p.prompt_tokens for p in prepare(workload)] == [100, 100, 100]
    one_pod = _run(workload, "round_robin", pods=1)
    prefill = FAST.prefill_overhead_s + 100 * FAST.prefill_per_token_s
    ttfts = sorted(o.ttft_s or 0 for o in one_pod.outcomes)
    assert ttfts == pytest.approx([prefill, 2 * prefill, 3 * prefill], rel=1e-3)
    # Spread over three pods, nobody waits.
    spread = _run(workload, "round_robin", pods=3)
    assert max(o.ttft_s or 0 for o in spread.outcomes) == pytest.approx(prefill, rel=1e-3)


def test_decode_steps_carry_a_prefill_chunk_while_a_prefill_runs() -> None:
    # 1 ms per token of prefill and decode, chunks of 10 tokens (10 ms), no batch effect.
    engine = EngineConfig(
        max_num_seqs=4,
        batch_slowdown=0.0,
        prefill_overhead_s=0.0,
        prefill_per_token_s=0.001,
        decode_per_token_s=0.001,
        max_num_batched_tokens=10,
    )
    workload = workloads.no_reuse(requests=2, prompt_tokens=100, output_tokens=101)
    workload = _exact_prompts(workload, 100)
    requests = (
        replace(workload.requests[0], arrival_s=0.0),
        replace(workload.requests[1], arrival_s=0.15, max_tokens=2),
    )
    workload = replace(workload, requests=requests)
    first, second = _run(workload, "round_robin", pods=1, engine=engine).outcomes
    # The first decodes from 0.1; 50 tokens by 0.15; during the second's prefill
    # (0.15-0.25) each step is 1 ms + a 10 ms chunk: 100 / 11 tokens; then 1 ms each.
    tokens_left = 100 - 50 - 0.1 / 0.011
    assert first.latency_s == pytest.approx(0.25 + tokens_left * 0.001, rel=1e-6)
    assert second.ttft_s == pytest.approx(0.1, rel=1e-6)


def test_a_pod_reuses_a_prefix_still_in_prefill_once_it_is_computed() -> None:
    # A herd on one pod: the first request computes the prefix; the others, started
    # while it does, look it up when their own prefill begins, after it (FCFS).
    workload = workloads.burst(
        requests=4, prefix_tokens=256, question_tokens=16, output_tokens=4, window_s=0.0
    )
    herd = _run(workload, "round_robin", pods=1)
    cached = sorted(o.cached_tokens for o in herd.outcomes)
    assert cached[0] == 0 and all(c >= 256 for c in cached[1:])
    what_if = replace(FAST, lookup_at_admission=True)
    recomputed = _run(workload, "round_robin", pods=1, engine=what_if)
    assert all(o.cached_tokens == 0 for o in recomputed.outcomes)
    assert max(o.ttft_s or 0 for o in recomputed.outcomes) > max(
        o.ttft_s or 0 for o in herd.outcomes
    )


def test_expected_ttft_what_if_routes_equal_cold_prompts_like_round_robin() -> None:
    # With equal prompts and nothing to reuse, sending each request where the prefills
    # queued so far end first is round robin in the order pods free up.
    engine = replace(FAST, max_num_seqs=64)
    workload = workloads.with_rate(
        workloads.no_reuse(requests=200, prompt_tokens=200, output_tokens=20), 120.0
    )
    what_if = _run(workload, "epp_prefill", engine=engine)
    again = _run(workload, "epp_prefill", engine=engine)
    round_robin = _run(workload, "round_robin", engine=engine)
    assert _key(what_if) == _key(again)
    assert all(o.ok for o in what_if.outcomes)
    # Scores within the tie epsilon go to the pod with less in flight, not strictly the
    # earliest lane: the same TTFTs to within a few percent.
    ttfts = sorted(o.ttft_s or 0 for o in what_if.outcomes)
    rr = sorted(o.ttft_s or 0 for o in round_robin.outcomes)
    assert sum(ttfts) == pytest.approx(sum(rr), rel=0.03)
    assert ttfts[-1] == pytest.approx(rr[-1], rel=0.1)
    assert what_if.extra["router_stats"]["prefill_weight"] == 0.5


def test_expected_ttft_what_if_is_the_epp_with_its_prefill_scorer_on() -> None:
    # A thin configuration of the real thing: weights halved, `prefill` 0.5, and the
    # scorer's cost model taken from the pods' engine.
    pods = VirtualPods(("pod-0", "pod-1"), (SimEngine(FAST), SimEngine(FAST)), "m")
    router = make_router("epp_prefill", pods, epp_config=EppConfig())
    scheduling = router.config.scheduling  # type: ignore[attr-defined]
    assert scheduling.weights == {
        "cache": 0.30, "load": 0.10, "queue": 0.05, "health": 0.025, "adapter": 0.025,
        "prefill": 0.5,
    }  # fmt: skip
    estimate = scheduling.prefill_estimate
    assert (estimate.overhead_s, estimate.per_token_s, estimate.per_cached_token_s) == (
        FAST.prefill_overhead_s,
        FAST.prefill_per_token_s,
        FAST.prefill_per_cached_token_s,
    )
    assert "prefill" in router.scheduler.weights  # type: ignore[attr-defined]


def test_kv_fraction_sizes_the_pods_from_distinct_prefix_blocks(small: workloads.Workload) -> None:
    prepared = prepare(small)
    distinct = distinct_prefix_blocks(prepared)
    # Only system prompts repeat: the full blocks of the tokens each group's prompts share
    # (the engine's tokens, about the 256 pseudo-tokens each system prompt was sized as).
    tokenizer = SimTokenizer()
    groups: dict[str, list[list[int]]] = {}
    for r in small.requests:
        assert r.prompt is not None
        groups.setdefault(r.group, []).append(
            list(tokenizer.encode(r.prompt, add_special_tokens=True))
        )
    shared = [
        next(
            (i for i, ids in enumerate(zip(*prompts, strict=False)) if len(set(ids)) > 1),
            min(map(len, prompts)),
        )
        for prompts in groups.values()
    ]
    assert distinct == sum(length // 16 for length in shared)
    assert distinct == pytest.approx(SMALL.groups * SMALL.system_tokens // 16, rel=0.1)
    sized = size_kv_for_fraction(FAST, prepared, 4, 2.0)
    assert sized.num_gpu_blocks * 4 == pytest.approx(2.0 * distinct, abs=4)
    # Never smaller than the largest request.
    assert size_kv_for_fraction(FAST, prepared, 4, 0.001).num_gpu_blocks >= (256 + 32 + 16) // 16


def test_prepared_hashes_are_the_simulated_pods_hashes(small: workloads.Workload) -> None:
    request = prepare(small)[0]
    body = json.loads(request.body)
    # The simulated pod's tokens (BOS first, as vLLM tokenizes a completion) and hashes.
    tokens = SimTokenizer().encode(body["prompt"], add_special_tokens=True)
    assert request.prompt_tokens == len(tokens)
    assert list(request.hashes) == sim_block_hashes(tokens, 16)
    assert len(request.hashes) == request.prompt_tokens // 16
    # About as many tokens as the workload's pseudo-tokens, and no hash of the router's.
    assert request.prompt_tokens == pytest.approx(
        SMALL.system_tokens + SMALL.question_tokens, rel=0.1
    )
    router_tokens = ByteEstimateTokenizer().encode(body["prompt"])
    router_hashes = epp_block_hashes(router_tokens, 16, chain_seed(body["model"]))
    assert not set(request.hashes) & set(router_hashes)
    engine = SimEngine(FAST)
    assert (
        engine.submit("a", request.hashes, request.prompt_tokens, request.max_tokens)
        is Admission.QUEUED
    )
    assert request.path == "/v1/completions" and b'"stream":true' in request.body


def test_prepared_chats_are_rendered_by_the_simulated_pods_template() -> None:
    workload = workloads.multi_turn(
        conversations=2, turns=2, system_tokens=64, user_tokens=8, reply_tokens=8
    )
    for bench, request in zip(workload.requests, prepare(workload), strict=True):
        assert bench.messages is not None and request.path == "/v1/chat/completions"
        messages = [ChatMessage(m.role, m.content) for m in bench.messages]
        tokens = SimTokenizer().encode_chat(messages)
        assert request.prompt_tokens == len(tokens)
        assert list(request.hashes) == sim_block_hashes(tokens, 16)


def test_prepare_refuses_what_a_simulated_pod_would_refuse(small: workloads.Workload) -> None:
    unknown = replace(small.requests[0], model="not-served")
    with pytest.raises(ValueError, match="would refuse"):
        prepare(replace(small, requests=(unknown, *small.requests[1:])))


def test_pods_view_is_read_only_for_routers() -> None:
    pods = VirtualPods(("pod-0",), (SimEngine(FAST),), "m")
    assert len(pods) == 1
    with pytest.raises(AttributeError):
        pods.names = ()  # type: ignore[misc]


def test_the_spec_weights_what_if_is_the_epp_with_the_spec_score() -> None:
    from epp.config import SPEC_WEIGHTS

    pods = VirtualPods(("pod-0", "pod-1"), (SimEngine(FAST), SimEngine(FAST)), "m")
    spec = make_router("epp_spec", pods, epp_config=EppConfig())
    assert spec.name == "epp_spec"
    assert spec.stats()["weights"] == SPEC_WEIGHTS
    assert make_router("epp", pods).stats()["weights"]["prefill"] == 0.5
