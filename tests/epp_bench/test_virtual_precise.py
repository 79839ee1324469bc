"""Precise mode in virtual time (epp_bench.virtual.precise): the index the engines' KV
events build is the engines' cache, block by block; stale routing is computed for both
modes; runs are deterministic."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from epp.prefix.blocks import prompt_blocks
from epp.prefix.hashing import block_hashes as epp_block_hashes
from epp.prefix.hashing import chain_seed
from epp.request import parse_request
from epp_bench.virtual.precise import EngineTokenizer, PreciseEppRouter, engine_stale
from epp_bench.virtual.prepare import prepare
from epp_bench.virtual.runner import _Simulation, make_router, run_virtual
from epp_bench.virtual.types import VirtualPods
from epp_bench.workloads import catalog as workloads
from epp_bench.workloads.types import RequestOutcome, RunResult
from vllm_sim.engine import EngineConfig, SimEngine

# Small pods: about 2 prompts each, so blocks are evicted (BlockRemoved) all along.
CHURNY = EngineConfig(
    num_gpu_blocks=40,
    max_num_seqs=4,
    max_waiting=64,
    prefill_overhead_s=0.002,
    prefill_per_token_s=0.0001,
    decode_per_token_s=0.001,
)
ROOMY = EngineConfig(num_gpu_blocks=2048, max_num_seqs=4, max_waiting=64)
SHAPE = workloads.SharedPrefixShape(
    groups=8, prompts_per_group=4, system_tokens=256, question_tokens=32, output_tokens=16
)


@pytest.fixture(autouse=True)
def quiet_routing_logs() -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    yield
    structlog.configure(**saved)


def _simulate(
    workload: workloads.Workload, engine: EngineConfig, pods: int = 4
) -> tuple[PreciseEppRouter, VirtualPods]:
    prepared = prepare(workload, engine.block_size)
    fleet = VirtualPods(
        names=tuple(f"pod-{i}" for i in range(pods)),
        engines=tuple(SimEngine(engine, kv_events=True) for _ in range(pods)),
        served_model=str(workload.params.get("model") or workload.requests[0].model),
    )
    router = make_router("epp_precise", fleet, seed=0)
    assert isinstance(router, PreciseEppRouter)
    _Simulation(prepared, workload, fleet, router, None).run()
    router.flush()
    return router, fleet


def _router_keys(workload: workloads.Workload, engine: EngineConfig) -> dict[int, int]:
    """Engine block hash -> the router's key for the same block, from every prompt: the
    engine's hashes (vllm_sim) beside the router's chained hash of the same token ids."""
    served = str(workload.params.get("model") or workload.requests[0].model)
    keys: dict[int, int] = {}
    for request in prepare(workload, engine.block_size):
        assert request.token_ids is not None
        ours = epp_block_hashes(
            request.token_ids, engine.block_size, chain_seed(served, None, None)
        )
        assert len(ours) == len(request.hashes)
        keys.update(zip(request.hashes, ours, strict=True))
    return keys


@pytest.mark.parametrize("engine", [CHURNY, ROOMY], ids=["churny", "roomy"])
def test_the_precise_index_is_the_engines_cache_block_by_block(engine: EngineConfig) -> None:
    workload = workloads.shared_prefix(SHAPE, rate=20.0, seed=1)
    router, fleet = _simulate(workload, engine)
    keys = _router_keys(workload, engine)
    removed = router.precise.stats.counts["blocks_removed"]
    if engine is CHURNY:
        assert removed > 0  # the small pods evicted: removals were applied too
    for name, sim in zip(fleet.names, fleet.engines, strict=True):
        cached = set(sim._pool._copies)  # the engine's cached hashes
        assert cached, name
        assert set(router.index.engine_blocks(name)) == cached
        for engine_hash in cached:
            assert router.index.engine_block(name, engine_hash) == keys[engine_hash]
        # Reported (not merely predicted) exactly where the engine holds the block.
        held = {keys[h] for h in cached}
        for key in set(keys.values()):
            assert router.index.reported(name, key) == (key in held)
    counts = router.precise.stats.counts
    assert counts["unknown_parent"] == 0 and counts["unknown_removals"] == 0
    assert counts["malformed_payload"] == 0 and counts["invalid_event"] == 0


def test_the_router_hashes_requests_as_the_engine_blocks_are_keyed() -> None:
    """The engine's tokenizer on the router side gives, for each request, the keys the
    events give the engine's blocks (completions and chats)."""
    for workload in (
        workloads.shared_prefix(SHAPE, rate=20.0, seed=1),
        workloads.by_name("multi-turn", seed=0),
    ):
        keys = _router_keys(workload, ROOMY)
        served = str(workload.params.get("model") or workload.requests[0].model)
        for request in prepare(workload, ROOMY.block_size)[:40]:
            parsed = parse_request(request.path, request.body, {}, max_prompt_tokens=1 << 20)
            blocks = prompt_blocks(
                parsed.prompt, EngineTokenizer(), ROOMY.block_size,
                chain_seed(served, None, None), 1 << 16,
            )  # fmt: skip
            assert blocks.prompt_tokens == request.prompt_tokens
            assert list(blocks.hashes) == [keys[h] for h in request.hashes]


def _stale_key(result: RunResult) -> tuple[object, ...]:
    stats = result.extra["router_stats"]
    return tuple(
        stats[k]
        for k in ("stale_engine", "stale_engine_checked", "stale_events", "stale_events_checked")
    )


def test_precise_runs_are_deterministic_and_count_stale_routing() -> None:
    workload = workloads.shared_prefix(SHAPE, rate=40.0, seed=1)
    first = run_virtual(workload, "epp_precise", pods=4, engine=CHURNY, seed=3)
    second = run_virtual(workload, "epp_precise", pods=4, engine=CHURNY, seed=3)
    assert [(o.pod, o.ttft_s, o.cached_tokens) for o in first.outcomes] == [
        (o.pod, o.ttft_s, o.cached_tokens) for o in second.outcomes
    ]
    assert _stale_key(first) == _stale_key(second)
    stats = first.extra["router_stats"]
    assert stats["stale_events_checked"] > 0 and stats["stale_engine_checked"] > 0
    assert 0.0 <= stats["stale_events_rate"] <= 1.0
    assert stats["kv_event_batches"] > 0 and stats["kv_event_stats"]["blocks_stored"] > 0
    # The approximate EPP gets the engine-side rate too.
    approx = run_virtual(workload, "epp", pods=4, engine=CHURNY, seed=3)
    assert approx.extra["router_stats"]["stale_engine_checked"] > 0


def test_precise_matches_the_approximate_epp_when_nothing_is_evicted() -> None:
    workload = workloads.shared_prefix(SHAPE, rate=20.0, seed=1)
    precise = run_virtual(workload, "epp_precise", pods=4, engine=ROOMY, seed=0)
    oracle = run_virtual(workload, "oracle", pods=4, engine=ROOMY, seed=0)
    assert precise.pod_hit_rate == pytest.approx(oracle.pod_hit_rate)
    assert precise.extra["router_stats"]["stale_engine"] == 0


def _outcome(index: int, cached: int, status: int = 200) -> RequestOutcome:
    return RequestOutcome(
        index=index, pod="p", status=status, start_s=0.0, ttft_s=0.1, latency_s=0.2,
        prompt_tokens=100, cached_tokens=cached, output_tokens=1,
    )  # fmt: skip


def test_engine_stale_definition() -> None:
    workload = workloads.no_reuse(requests=4, prompt_tokens=100, output_tokens=2)
    prepared = [p for p in prepare(workload)]
    engine_tokens = [p.prompt_tokens for p in prepared]
    # Predictions in router tokens equal to the engine's: 4 blocks of 16 predicted.
    predictions = {i: (4, engine_tokens[i]) for i in range(4)}
    outcomes = [_outcome(0, 64), _outcome(1, 32), _outcome(2, 16), _outcome(3, 0, status=429)]
    stale = engine_stale(predictions, outcomes, prepared, 16)
    # 64 reused: fine; 32 = half: fine; 16 < half: stale; the refused one is not checked.
    assert stale["stale_engine_checked"] == 3
    assert stale["stale_engine"] == 1
    # No prediction, nothing to check.
    assert engine_stale({0: (0, 100)}, outcomes, prepared, 16)["stale_engine_checked"] == 0


def test_the_precise_report_tables_every_router_over_seeds(tmp_path: Path) -> None:
    from epp_bench.reports.tables import save_results
    from epp_bench.virtual.precise_report import BEGIN, END, main

    workload = workloads.shared_prefix(SHAPE, rate=40.0, seed=1)
    paths = []
    for seed in (0, 1):
        results = [
            run_virtual(workload, router, pods=4, engine=CHURNY, seed=seed)
            for router in ("epp", "epp_precise", "round_robin")
        ]
        paths.append(save_results(results, tmp_path / f"churny-s{seed}.json", outcomes=False))
    out = tmp_path / "precise.md"
    out.write_text(f"# page\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    assert main(["--out", str(out), "--from", *map(str, paths)]) == 0
    text = out.read_text()
    assert text.startswith("# page") and text.rstrip().endswith("after") and "old" not in text
    assert "### churny" in text and "seeds 0, 1" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"epp", "epp_precise", "round_robin"}
    # The event-side rate only for the precise router; the engine-side one for both EPPs.
    assert rows["epp_precise"].split("|")[5].strip() != "-"
    assert rows["epp"].split("|")[5].strip() == "-" and rows["epp"].split("|")[4].strip() != "-"
    assert rows["round_robin"].split("|")[4].strip() == "-"
