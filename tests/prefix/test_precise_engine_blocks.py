"""A precise pod whose engine blocks span several of ours (vLLM on the CPU: 32 tokens, the
router: 16) reuses whole engine blocks only. Half an engine block held, the same first
tokens inside another prompt's block, is no hit: the match must not count it, or every
decision that relies on it is predicted wrong and its stale-routing claim names a block
the engine then computes (seen against two real vLLM servers:
tests/e2e/test_vllm_precise_e2e.py). A simulated engine, with its own hashing, runs the
requests."""

from __future__ import annotations

import random
from array import array

from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.prefix.kv_events import KvEventDecoder
from epp.prefix.precise import PreciseIndex
from epp.prefix.precise_stale import PreciseStaleCheck
from vllm_sim import hashing as sim_hashing
from vllm_sim.engine import EngineConfig, SimEngine
from vllm_sim.kv_events import encode_event_batch

MODEL = "m"
OURS, ENGINE = 16, 32


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 100_000) for _ in range(n)]


class Pod:
    """The router's side (index, precise, stale check) and one engine of 32-token blocks."""

    def __init__(self, num_gpu_blocks: int = 1000) -> None:
        config = EngineConfig(block_size=ENGINE, max_num_seqs=8, num_gpu_blocks=num_gpu_blocks)
        self.engine = SimEngine(config, kv_events=True)
        self.index = PrefixIndex(100_000, predicted_ttl_s=100.0, clock=lambda: 0.0)
        self.precise = PreciseIndex(self.index, OURS, stale=PreciseStaleCheck(grace_s=1.0))
        self.precise.attach("pod", MODEL)
        self.decoder = KvEventDecoder()
        self.now = 0.0
        self.n = 0

    def route(self, ids: list[int], advance: float = 1.0) -> int:
        """What the Router does: match, open the claim, record; then the engine runs it
        and its events are applied, and it completes. The match the router used."""
        hashes = block_hashes(array("I", ids), OURS, chain_seed(MODEL))
        matched = self.index.match(hashes).get("pod", 0)
        self.n += 1
        token = f"t{self.n}"
        self.precise.dispatched(token, "pod", hashes, matched, len(ids), self.now)
        self.index.record("pod", hashes, self.now)
        engine_hashes = sim_hashing.block_hashes(ids, ENGINE)
        self.engine.submit(token, engine_hashes, len(ids), 1, prompt_token_ids=array("I", ids))
        self.engine.start_ready(self.now)
        self.now += advance
        self.engine.finish(token, 1)
        batch = self.decoder.decode(encode_event_batch(self.engine.drain_kv_events(), ts=0.0))
        assert batch is not None
        self.precise.apply("pod", batch)
        self.precise.completed(token, self.now)
        return matched

    def settle(self) -> tuple[int, int]:
        self.now += 5.0
        self.precise.poll(self.now)
        return self.precise.stale.stale, self.precise.stale.checked


def test_half_an_engine_block_is_no_match_and_no_stale_claim():
    pod = Pod()
    first = prompt(1, 100)  # 3 engine blocks: 6 of ours
    assert pod.route(first) == 0
    # Shares 80 tokens: 2.5 engine blocks. The engine reuses 2 (64 tokens), and so many
    # the match says; the 5th of our blocks is held only inside the first prompt's 3rd.
    second = [*first[:80], *prompt(2, 60)]
    hashes = block_hashes(array("I", second), OURS, chain_seed(MODEL))
    assert pod.index.match(hashes) == {"pod": 4}
    assert pod.route(second) == 4
    assert pod.settle() == (0, 1)


def test_whole_engine_blocks_still_match_in_full():
    pod = Pod()
    first = prompt(3, 100)
    pod.route(first)
    assert pod.route([*first[:96], *prompt(4, 40)]) == 6  # 3 whole engine blocks
    assert pod.settle() == (0, 1)


def test_an_approximate_pod_matches_in_our_blocks_again():
    pod = Pod()
    first = prompt(5, 100)
    pod.route(first)
    pod.precise.detach("pod")
    hashes = block_hashes(array("I", first), OURS, chain_seed(MODEL))
    pod.index.record("pod", hashes[:5])
    assert pod.index.match(hashes) == {"pod": 5}


def test_a_claimed_block_computed_again_by_another_prompt_after_the_hit_is_not_stale():
    """Seen against real vLLM under eviction: a decision hit its claimed block; within the
    claim's grace the block was evicted and computed again by another prompt sharing it.
    That store is the other request's (its event goes on with its own blocks)."""
    pod = Pod(num_gpu_blocks=14)
    shared = prompt(6, 128)  # 4 engine blocks
    pod.route([*shared, *prompt(7, 40)])
    hit = pod.route([*shared, *prompt(8, 40)], advance=0.0)  # claims the 4th block
    assert hit == 8
    for seed in (9, 10, 11, 19, 20):  # push the shared prefix out of the engine
        pod.route(prompt(seed, 128), advance=0.0)
    assert pod.index.match(block_hashes(array("I", shared), OURS, chain_seed(MODEL))) == {}
    pod.route([*shared, *prompt(12, 40)], advance=0.0)  # computes it again, then its own
    assert pod.settle() == (0, 1)


def test_a_claimant_that_computed_its_block_again_is_stale():
    pod = Pod(num_gpu_blocks=14)
    shared = prompt(13, 128)
    pod.route([*shared, *prompt(14, 40)])
    hashes = block_hashes(array("I", [*shared, *prompt(15, 40)]), OURS, chain_seed(MODEL))
    # Dispatched on the index's word, then the block is lost before the request runs:
    # the engine computes it (and the rest of its prompt) in the request's own event.
    pod.precise.dispatched("late", "pod", hashes, 8, 168, pod.now)
    for seed in (16, 17, 18, 21, 22):
        pod.route(prompt(seed, 128), advance=0.0)
    ids = [*shared, *prompt(15, 40)]
    pod.engine.submit(
        "late", sim_hashing.block_hashes(ids, ENGINE), len(ids), 1, prompt_token_ids=array("I", ids)
    )
    pod.engine.start_ready(pod.now)
    pod.engine.finish("late", 1)
    batch = pod.decoder.decode(encode_event_batch(pod.engine.drain_kv_events(), ts=0.0))
    assert batch is not None
    pod.precise.apply("pod", batch)
    pod.precise.completed("late", pod.now)
    assert pod.settle() == (1, 1)  # the prompts that pushed it out claimed nothing


def test_another_prompt_sharing_more_than_the_claim_is_told_by_where_it_goes_on():
    """The other prompt shares blocks beyond the claimed one, then its own follow."""
    pod = Pod(num_gpu_blocks=14)
    head = prompt(23, 128)  # what the pod holds when the claimant is routed: 4 blocks
    pod.route([*head, *prompt(24, 40)])
    shared = [*head, *prompt(25, 64)]  # 6 blocks shared by the claimant and the other
    assert pod.route([*shared, *prompt(26, 40)], advance=0.0) == 8  # claims the 4th
    for seed in (27, 28, 29, 30, 31):
        pod.route(prompt(seed, 128), advance=0.0)
    pod.route([*shared, *prompt(32, 40)], advance=0.0)  # 4th, 5th, 6th, then its own
    assert pod.settle() == (0, 1)
