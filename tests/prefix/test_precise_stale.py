"""Stale routing in precise mode: a simulated engine (its own hashing, its own cache) runs
the requests; its KV events, through PreciseIndex, decide which decisions' predicted
matches it did not have."""

from __future__ import annotations

import random
from array import array

from epp.prefix.hashing import BlockHash, block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.prefix.kv_events import KvEventDecoder
from epp.prefix.precise import PreciseIndex
from epp.prefix.precise_stale import PreciseStaleCheck, claim_cap
from vllm_sim import hashing as sim_hashing
from vllm_sim.engine import EngineConfig, SimEngine
from vllm_sim.kv_events import encode_event_batch

MODEL = "m"


class Rig:
    """One precise pod: the router's side (index, precise, stale check) and the engine."""

    def __init__(self, lookup_at_admission: bool = False, **engine: int) -> None:
        self.engine = SimEngine(
            EngineConfig(
                block_size=16,
                max_num_seqs=8,
                lookup_at_admission=lookup_at_admission,
                **engine,  # type: ignore[arg-type]
            ),
            kv_events=True,
        )
        self.index = PrefixIndex(100_000, predicted_ttl_s=100.0, clock=lambda: 0.0)
        self.precise = PreciseIndex(self.index, 16, stale=PreciseStaleCheck(grace_s=1.0))
        self.precise.attach("pod", MODEL)
        self.decoder = KvEventDecoder()
        self.now = 0.0
        self.n = 0

    def route(self, ids: list[int]) -> str:
        """What the Router does for a precise pod: match, open the claim, record."""
        hashes = block_hashes(array("I", ids), 16, chain_seed(MODEL))
        matched = self.index.match(hashes).get("pod", 0)
        self.n += 1
        token = f"t{self.n}"
        self.precise.dispatched(token, "pod", hashes, matched, len(ids), self.now)
        self.index.record("pod", hashes, self.now)
        engine_hashes = sim_hashing.block_hashes(ids, 16)
        self.engine.submit(token, engine_hashes, len(ids), 1, prompt_token_ids=array("I", ids))
        return token

    def run(self, *tokens: str) -> None:
        """Start what is queued, finish these requests, deliver the engine's events."""
        self.engine.start_ready(self.now)
        self.now += 1.0
        for token in tokens:
            self.engine.finish(token, 1)
        self.deliver()
        for token in tokens:
            self.precise.completed(token, self.now)

    def deliver(self) -> None:
        events = self.engine.drain_kv_events()
        if events:
            batch = self.decoder.decode(encode_event_batch(events, ts=self.now))
            assert batch is not None
            self.precise.apply("pod", batch)

    def settle(self) -> tuple[int, int]:
        self.now += 5.0
        self.precise.poll(self.now)
        return self.precise.stale.stale, self.precise.stale.checked


def prompt(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 100_000) for _ in range(n)]


def test_a_hit_on_reported_blocks_is_not_stale():
    rig = Rig()
    ids = prompt(1)
    rig.run(rig.route(ids))
    rig.run(rig.route([*ids, *prompt(2, 32)]))  # the engine reuses the 10 blocks
    assert rig.settle() == (0, 1)


def test_blocks_the_index_holds_but_the_engine_lost_make_the_decision_stale():
    rig = Rig(num_gpu_blocks=24)
    ids = prompt(1)
    rig.run(rig.route(ids))
    # Other prompts push the first one out; the removals are lost on the way.
    for seed in (5, 6):
        token = rig.route(prompt(seed))
        rig.engine.start_ready(rig.now)
        rig.engine.finish(token, 1)
    events = rig.engine.drain_kv_events()
    stores = [e for e in events if type(e).__name__ == "BlockStored"]
    batch = rig.decoder.decode(encode_event_batch(stores, ts=rig.now))
    assert batch is not None
    rig.precise.apply("pod", batch)
    assert rig.index.match(block_hashes(array("I", ids), 16, chain_seed(MODEL))) == {"pod": 10}
    rig.run(rig.route(ids))  # predicted 10 blocks; the engine computes them again
    assert rig.settle() == (1, 1)  # the two others predicted nothing: no claims


def test_a_sibling_that_follows_a_prediction_is_fine_when_the_first_one_computed_it():
    rig = Rig()
    ids = prompt(1)
    first = rig.route(ids)  # predicts nothing: no claim
    second = rig.route([*ids, *prompt(2, 32)])  # claims the first one's predicted blocks
    rig.run(first, second)  # the engine's prefill lane: the second reuses the first's
    assert rig.settle() == (0, 1)


def test_a_sibling_that_ran_before_the_prediction_came_true_is_stale():
    rig = Rig(lookup_at_admission=True)  # both look up before either has computed
    ids = prompt(1)
    first = rig.route(ids)
    second = rig.route([*ids, *prompt(2, 32)])
    rig.run(first, second)
    assert rig.settle() == (1, 1)


def test_a_fully_cached_prompts_recomputed_last_block_is_not_a_miss():
    rig = Rig()
    ids = prompt(1, 160)  # exactly 10 blocks: the engine recomputes the last one
    rig.run(rig.route(ids))
    rig.run(rig.route(ids))
    assert rig.settle() == (0, 1)
    assert claim_cap(160, 16, 16) == 9 and claim_cap(161, 16, 16) == 10
    assert claim_cap(160, 16, 32) == 8  # engine blocks of 32: 4 of them, 8 of ours


def test_a_claim_is_checked_only_after_its_grace_and_open_claims_can_be_dropped():
    check = PreciseStaleCheck(grace_s=1.0, max_open_s=10.0)
    hashes = [BlockHash(i) for i in range(1, 11)]
    common = {"block_size": 16, "engine_block_size": 16, "confirmed": True}
    assert check.dispatched("a", "pod", hashes, 5, 160, now=0.0, **common)
    assert not check.dispatched("b", "pod", hashes, 0, 160, now=0.0, **common)  # no match
    assert check.dispatched("c", "pod", hashes, 3, 160, now=0.0, **common)
    check.stored("pod", [BlockHash(5)])  # a's claimed block, computed: a is stale
    check.completed("a", 2.0)
    check.poll(2.5)
    assert (check.stale, check.checked) == (0, 0)
    check.poll(3.0)
    assert (check.stale, check.checked) == (1, 1)
    check.poll(20.0)  # c never completed
    assert check.dropped == 1 and check.open_claims == 0
    assert check.dispatched("d", "other", hashes, 5, 160, now=20.0, **common)
    check.forget_pod("other")
    assert check.open_claims == 0 and check.dropped == 2
