"""PreciseIndex: a simulated engine's KV events (the simulator hashes with its own code,
SHA-256 over msgpack, as vLLM does) applied to the prefix index must make the router's own
hashes of the same tokens match exactly what the engine holds, per pod."""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path

import pytest

from epp.prefix.hashing import BlockHash, block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.prefix.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventDecoder,
    KvEventStats,
    split_events,
)
from epp.prefix.precise import PreciseIndex
from vllm_sim import hashing as sim_hashing
from vllm_sim.engine import EngineConfig, SimEngine
from vllm_sim.kv_events import encode_event_batch

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"


class Engine:
    """A simulated vLLM engine with KV events on, driven one request at a time; its
    events go through the real wire format (encode, then our decoder)."""

    def __init__(self, block_size: int = 16, num_gpu_blocks: int = 4096) -> None:
        self.block_size = block_size
        self.engine = SimEngine(
            EngineConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=4),
            kv_events=True,
        )
        self.now = 0.0
        self.n = 0
        self.decoder = KvEventDecoder()

    def serve(self, ids: list[int], lora: str | None = None, salt: str | None = None) -> None:
        if lora is not None:
            self.engine.load_adapter(lora)
        hashes = sim_hashing.block_hashes(ids, self.block_size, lora_name=lora, cache_salt=salt)
        self.n += 1
        req = f"r{self.n}"
        self.engine.submit(
            req, hashes, len(ids), 1, lora, prompt_token_ids=array("I", ids), cache_salt=salt
        )
        assert self.engine.start_ready(self.now)
        self.now += 10.0
        self.engine.finish(req, 1)

    def events(self) -> list[KvEvent]:
        payload = encode_event_batch(self.engine.drain_kv_events(), ts=self.now)
        batch = self.decoder.decode(payload)
        assert batch is not None
        return batch.events

    def cached(self) -> set[int]:
        return set(self.engine._pool._copies)  # the engine's own view, for comparison


def router_hashes(
    ids: list[int], lora: str | None = None, salt: str | None = None, block_size: int = 16
) -> list[BlockHash]:
    """What the router computes for a request (epp.routing: chain_seed(served, adapter,
    cache_salt), served = the adapter when there is one)."""
    return block_hashes(array("I", ids), block_size, chain_seed(lora or MODEL, lora, salt))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 120_000) for _ in range(n)]


def setup(
    pods: tuple[str, ...] = ("a",), capacity: int = 100_000, block_size: int = 16
) -> tuple[PrefixIndex, PreciseIndex]:
    index = PrefixIndex(capacity)
    precise = PreciseIndex(index, block_size, KvEventStats())
    for pod in pods:
        precise.attach(pod, MODEL)
    return index, precise


def test_the_routers_hashes_match_what_the_engine_stored():
    rng = random.Random(1)
    engine = Engine()
    index, precise = setup()
    system = tokens(rng, 160)
    first, second = system + tokens(rng, 50), system + tokens(rng, 70)
    engine.serve(first)
    engine.serve(second)  # reuses the system prompt's 10 blocks: only the rest is stored
    precise.apply_events("a", engine.events())
    assert index.match(router_hashes(first)) == {"a": len(first) // 16}
    assert index.match(router_hashes(second)) == {"a": len(second) // 16}
    assert index.match(router_hashes(system + tokens(rng, 40))) == {"a": 10}
    assert set(index.engine_blocks("a")) == engine.cached()
    assert precise.stats.counts["unknown_parent"] == 0


@pytest.mark.parametrize(("lora", "salt"), [("sql", None), (None, "tenant-b"), ("sql", "t")])
def test_lora_and_cache_salt_enter_the_key_as_the_engine_mixes_them(lora, salt):
    rng = random.Random(2)
    engine = Engine()
    index, precise = setup()
    ids = tokens(rng, 100)
    engine.serve(ids, lora=lora, salt=salt)
    precise.apply_events("a", engine.events())
    assert index.match(router_hashes(ids, lora, salt)) == {"a": 6}
    assert index.match(router_hashes(ids)) == {}  # another tenant / the base model: no hit
    assert index.match(router_hashes(ids, lora, "other")) == {}


def test_an_engine_block_of_twice_our_size_gives_two_of_our_keys():
    rng = random.Random(3)
    engine = Engine(block_size=32)
    index, precise = setup()
    ids = tokens(rng, 100)  # 3 engine blocks = 6 of ours
    engine.serve(ids)
    precise.apply_events("a", engine.events())
    assert index.match(router_hashes(ids)) == {"a": 6}
    assert index.blocks("a") == 3  # counted in the engine's blocks


def test_an_engine_block_size_we_cannot_split_is_kept_unmatchable_and_counted():
    rng = random.Random(4)
    engine = Engine(block_size=24)
    index, precise = setup()
    ids = tokens(rng, 100)
    engine.serve(ids)
    precise.apply_events("a", engine.events())
    assert index.match(router_hashes(ids)) == {}
    assert index.blocks("a") == 4
    assert precise.stats.counts["unsupported_block_size"] == 4


def test_evictions_follow_the_engine_and_touch_only_that_pod():
    rng = random.Random(5)
    small = Engine(num_gpu_blocks=20)  # pod a: evicts
    big = Engine()  # pod b: keeps everything
    index, precise = setup(("a", "b"))
    prompts = [tokens(rng, 96) for _ in range(6)]  # 6 blocks each: a holds about 3 prompts
    for ids in prompts:
        small.serve(ids)
        big.serve(ids)
        precise.apply_events("a", small.events())
        precise.apply_events("b", big.events())
    assert precise.stats.counts["blocks_removed"] > 0
    assert precise.stats.counts["unknown_removals"] == 0
    assert set(index.engine_blocks("a")) == small.cached()
    for ids in prompts:
        got = index.match(router_hashes(ids))
        assert got.get("b") == 6
        held = sim_hashing.block_hashes(ids, 16)
        depth = next((i for i, h in enumerate(held) if h not in small.cached()), 6)
        assert got.get("a", 0) == depth


def test_all_blocks_cleared_drops_the_pods_entries_and_predictions():
    rng = random.Random(6)
    engine = Engine()
    index, precise = setup(("a", "b"))
    ids = tokens(rng, 64)
    engine.serve(ids)
    events = engine.events()
    precise.apply_events("a", events)
    precise.apply_events("b", events)
    other = router_hashes(tokens(rng, 64))
    index.record("a", other, now=0.0)  # a predicted entry
    precise.apply_events("a", [AllBlocksCleared()])
    assert index.match(router_hashes(ids)) == {"b": 4}
    assert index.match(other) == {}
    assert index.blocks("a") == 0 and precise.stats.counts["all_blocks_cleared"] == 1


def test_a_child_of_an_unknown_parent_is_kept_unmatchable_and_its_removal_recognised():
    """After a router restart the engine stores children of blocks we never saw: they are
    kept (not silently dropped), match nothing, and their eviction is not 'unknown'."""
    rng = random.Random(7)
    engine = Engine()
    index, precise = setup()
    head = tokens(rng, 64)
    engine.serve(head)
    engine.events()  # missed: the router was not listening yet
    longer = head + tokens(rng, 64)
    engine.serve(longer)
    precise.apply_events("a", engine.events())
    assert precise.stats.counts["unknown_parent"] == 4
    assert index.blocks("a") == 4
    assert index.match(router_hashes(longer)) == {}
    # A grandchild is unmatchable too, and removals of these blocks are known ones.
    child = BlockStored(
        block_hashes=[12345],
        parent_block_hash=sim_hashing.block_hashes(longer, 16)[-1],
        token_ids=list(range(16)),
        block_size=16,
    )
    precise.apply_events("a", [child])
    assert precise.stats.counts["unknown_parent"] == 5
    removed = [*sim_hashing.block_hashes(longer, 16)[4:], 12345]
    precise.apply_events("a", [BlockRemoved(block_hashes=removed)])
    assert index.blocks("a") == 0
    assert precise.stats.counts["unknown_removals"] == 0


def test_predicted_entries_expire_unless_an_event_confirms_them():
    rng = random.Random(8)
    engine = Engine()
    index = PrefixIndex(100_000, predicted_ttl_s=2.0, clock=lambda: 0.0)
    precise = PreciseIndex(index, 16)
    precise.attach("a", MODEL)
    confirmed, guessed = tokens(rng, 64), tokens(rng, 64)
    index.record("a", router_hashes(confirmed), now=10.0)
    index.record("a", router_hashes(guessed), now=10.0)
    assert index.match(router_hashes(confirmed)) == {"a": 4}
    assert index.match(router_hashes(guessed)) == {"a": 4}
    engine.serve(confirmed)
    precise.apply_events("a", engine.events())
    assert index.expire(11.9) == 0
    assert index.expire(12.0) == 4  # the guessed prompt's four blocks
    assert index.match(router_hashes(confirmed)) == {"a": 4}
    assert index.match(router_hashes(guessed)) == {}


def test_predicting_again_refreshes_and_a_confirmed_block_is_never_expired():
    index = PrefixIndex(1000, predicted_ttl_s=1.0, clock=lambda: 0.0)
    index.set_precise("a", True)
    index.store_engine_blocks("a", [1], [BlockHash(100)], 1)
    index.predict("a", [BlockHash(100), BlockHash(101)], now=0.0)
    index.predict("a", [BlockHash(101)], now=0.5)
    assert index.expire(1.0) == 0  # 100 was confirmed, 101 refreshed
    assert index.match([BlockHash(100), BlockHash(101)]) == {"a": 2}
    assert index.expire(1.5) == 1
    assert index.match([BlockHash(100), BlockHash(101)]) == {"a": 1}


def test_match_expires_predictions_by_the_index_clock():
    now = [0.0]
    index = PrefixIndex(1000, predicted_ttl_s=2.0, clock=lambda: now[0])
    index.set_precise("a", True)
    index.record("a", [BlockHash(1), BlockHash(2)])
    assert index.match([BlockHash(1)]) == {"a": 1}
    now[0] = 2.5
    assert index.match([BlockHash(1)]) == {}
    assert index.blocks("a") == 0


def test_a_block_the_engine_caches_twice_goes_with_its_last_copy():
    index, precise = setup()
    stored = BlockStored(
        block_hashes=[7], parent_block_hash=None, token_ids=list(range(16)), block_size=16
    )
    precise.apply_events("a", [stored, stored])
    key = router_hashes(list(range(16)))
    precise.apply_events("a", [BlockRemoved(block_hashes=[7])])
    assert index.match(key) == {"a": 1}
    precise.apply_events("a", [BlockRemoved(block_hashes=[7])])
    assert index.match(key) == {}


def test_other_tiers_groups_and_opaque_extra_keys_never_match():
    index, precise = setup()
    ids = list(range(1000, 1032))
    base = {"block_hashes": [1, 2], "parent_block_hash": None, "token_ids": ids}
    precise.apply_events(
        "a",
        [
            BlockStored(**base, block_size=16, medium="CPU"),  # type: ignore[arg-type]
            BlockStored(**base, block_size=16, kv_cache_spec_kind="sliding_window"),  # type: ignore[arg-type]
        ],
    )
    assert index.blocks("a") == 0
    assert precise.stats.counts["ignored_medium"] == precise.stats.counts["ignored_group"] == 2
    image = BlockStored(**base, block_size=16, extra_keys=[None, ["img-hash-1"]])  # type: ignore[arg-type]
    precise.apply_events("a", [image])
    assert index.match(router_hashes(ids)) == {"a": 1}  # the text block before the image
    assert precise.stats.counts["opaque_extra_keys"] == 1


def test_events_for_a_pod_not_followed_are_counted_and_change_nothing():
    index, precise = setup(("a",))
    stored = BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=list(range(16)), block_size=16
    )
    assert precise.apply_events("ghost", [stored]) == 0
    assert precise.stats.counts["unknown_pod"] == 1
    assert index.pods() == ["a"] and index.nodes == 0


def test_bad_token_ids_keep_the_block_unmatchable():
    index, precise = setup()
    bad = BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=[2**33] * 16, block_size=16
    )
    precise.apply_events("a", [bad])
    assert index.blocks("a") == 1 and index.nodes == 0
    assert precise.stats.counts["invalid_event"] == 1


def test_split_events_apply_exactly_as_the_whole_batch():
    rng = random.Random(9)
    engine = Engine(block_size=32)
    for _ in range(8):
        engine.serve(tokens(rng, 700))
    events = engine.events()
    whole_index, whole = setup()
    sliced_index, sliced = setup()
    whole.apply_events("a", events)
    for piece in split_events(events, 3):
        sliced.apply_events("a", piece)
    assert sorted(whole_index.engine_blocks("a")) == sorted(sliced_index.engine_blocks("a"))
    assert whole_index._holders.bits == sliced_index._holders.bits


def test_the_precise_capacity_bounds_engine_blocks_when_removals_are_lost():
    index, precise = setup(capacity=64)
    for i in range(100):
        stored = BlockStored(
            block_hashes=[i], parent_block_hash=None, token_ids=[i] * 16, block_size=16
        )
        precise.apply_events("a", [stored])
    assert index.blocks("a") <= 64
    assert index.precise_capacity_evictions > 0


def test_switching_mode_forgets_the_other_modes_entries():
    index, precise = setup(("a",))
    index.record("b", [BlockHash(1), BlockHash(2)])  # approximate pod b
    precise.attach("b", MODEL)
    assert index.match([BlockHash(1)]) == {}
    index.store_engine_blocks("b", [9], [BlockHash(1)], 1)
    precise.detach("b")
    assert index.match([BlockHash(1)]) == {} and not index.is_precise("b")


def test_a_real_vllm_event_stream_applies_with_every_removal_known():
    """vLLM 0.32's own events (block size 32, a cache of 40 blocks, one salted prompt, a
    prefix-cache reset): applied in order, every BlockRemoved names a block the index
    held, and the index ends with exactly what the stream leaves cached."""
    capture = json.loads((ROOT / "docs/benchmarks/sim-vs-vllm/vllm.json").read_text())
    index, precise = setup()
    expected: set[int] = set()
    for message in capture["kv_events"]["messages"]:
        events: list[KvEvent] = []
        for raw in message["events"]:
            if raw["type"] == "BlockStored":
                parent = raw["parent_block_hash"]
                event: KvEvent = BlockStored(
                    block_hashes=[int(h, 16) for h in raw["block_hashes"]],
                    parent_block_hash=None if parent is None else int(parent, 16),
                    token_ids=raw["token_ids"],
                    block_size=raw["block_size"],
                    medium=raw["medium"],
                    extra_keys=raw["extra_keys"],
                    kv_cache_spec_kind=raw["kv_cache_spec_kind"],
                )
                expected.update(event.block_hashes)
            elif raw["type"] == "BlockRemoved":
                event = BlockRemoved(block_hashes=[int(h, 16) for h in raw["block_hashes"]])
                expected.difference_update(event.block_hashes)
            else:
                event = AllBlocksCleared()
                expected.clear()
            events.append(event)
        precise.apply_events("a", events)
    counts = precise.stats.counts
    assert counts["unknown_removals"] == 0 and counts["blocks_removed"] > 30
    assert counts["all_blocks_cleared"] == 1
    assert set(index.engine_blocks("a")) == expected
    assert counts["unknown_parent"] == 0  # every parent was seen first


def test_fuzz_random_events_for_one_pod_never_change_another_pods_entries():
    rng = random.Random(10)
    engine = Engine()
    index, precise = setup(("victim", "target"))
    prompts = [tokens(rng, 80) for _ in range(5)]
    for ids in prompts:
        engine.serve(ids)
    precise.apply_events("victim", engine.events())
    before = {tuple(ids): index.match(router_hashes(ids)) for ids in prompts}
    known = index.engine_blocks("victim")
    for _ in range(3000):
        n = rng.randrange(1, 4)
        pick = rng.random()
        hashes = [
            rng.choice(known) if rng.random() < 0.5 else rng.getrandbits(64) for _ in range(n)
        ]
        if pick < 0.5:
            size = rng.choice([16, 32, 8, 24])
            event: KvEvent = BlockStored(
                block_hashes=hashes,
                parent_block_hash=rng.choice([None, rng.choice(known), rng.getrandbits(64)]),
                token_ids=[rng.randrange(0, 2**32) for _ in range(n * size)],
                block_size=size,
                lora_name=rng.choice([None, "x"]),
                extra_keys=rng.choice(
                    [None, [rng.choice([None, ["x"], ["s"], [1, 2]]) for _ in range(n)]]
                ),
                medium=rng.choice([None, "GPU", "CPU"]),
            )
        elif pick < 0.95:
            event = BlockRemoved(block_hashes=hashes)
        else:
            event = AllBlocksCleared()
        precise.apply_events("target", [event])
        index.record("target", router_hashes(rng.choice(prompts)), now=float(_))
    for ids in prompts:
        got = index.match(router_hashes(ids))
        assert got.get("victim") == before[tuple(ids)]["victim"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_prefix_stored_once_and_then_only_hit_survives_the_capacity_bound():
    """A system prompt is stored once, then only hit (a hit stores nothing): each routed
    hit marks it used, so the capacity bound (CLOCK) keeps it while the cold suffixes
    stored since go. Insertion order evicted it first, for good."""
    rng = random.Random(21)
    engine = Engine()  # its KV holds everything: only the index's bound (64) evicts
    clock = Clock()
    index = PrefixIndex(64, clock=clock)
    precise = PreciseIndex(index, 16, KvEventStats())
    precise.attach("a", MODEL)
    system = tokens(rng, 64)  # 4 blocks
    engine.serve(system)
    precise.apply_events("a", engine.events())
    for i in range(200):
        clock.now = float(i)
        prompt = system + tokens(rng, 32)  # 2 new blocks each time
        hashes = router_hashes(prompt)
        assert index.match(hashes).get("a") == 4, f"the system prompt was dropped at {i}"
        index.record("a", hashes, token=f"r{i}")  # the decision that routed it (epp.routing)
        engine.serve(prompt)
        precise.apply_events("a", engine.events())
        index.completed(f"r{i}", clock.now)
    assert index.precise_capacity_evictions > 300  # the bound did evict: the cold ones
    assert index.blocks("a") <= 64
    assert index.match(router_hashes(system)) == {"a": 4}


def test_a_prefix_not_hit_again_still_goes_at_its_turn():
    rng = random.Random(22)
    engine = Engine()
    clock = Clock()
    index = PrefixIndex(64, clock=clock)
    precise = PreciseIndex(index, 16, KvEventStats())
    precise.attach("a", MODEL)
    once = tokens(rng, 64)
    engine.serve(once)
    precise.apply_events("a", engine.events())
    index.record("a", router_hashes(once), token="hit")  # one hit, then never again
    index.completed("hit", 0.0)
    for _ in range(100):
        engine.serve(tokens(rng, 32))
        precise.apply_events("a", engine.events())
    assert index.match(router_hashes(once)) == {}


def _resynced_pod(rng: random.Random) -> tuple[Engine, PrefixIndex, PreciseIndex, Clock]:
    engine = Engine()
    clock = Clock()
    index = PrefixIndex(100_000, clock=clock)
    precise = PreciseIndex(index, 16, KvEventStats())
    precise.attach("a", MODEL)
    return engine, index, precise, clock


def test_a_prefix_held_from_before_a_resync_is_relearnt_from_a_routed_requests_events():
    """The engine holds a system prompt stored before the router listened (or before a
    resync whose replay buffer did not reach back). A request routed to the pod with that
    prefix hits it and stores only its own suffix, whose parent we never saw: the open
    prediction places that parent, so the prefix is relearnt as reported, the suffix is
    stored with its keys, and the parent's removal drops the relearnt prefix."""
    rng = random.Random(23)
    engine, index, precise, clock = _resynced_pod(rng)
    system = tokens(rng, 64)
    engine.serve(system)
    engine.events()  # missed
    prompt = system + tokens(rng, 32)
    index.record("a", router_hashes(prompt), token="r1")
    engine.serve(prompt)
    precise.apply_events("a", engine.events())
    index.completed("r1", 0.0)
    clock.now = 100.0  # every prediction expired: only what the engine's word says stays
    assert index.expire(clock.now) == 0  # nothing left to expire: all confirmed
    assert index.match(router_hashes(system)) == {"a": 4}
    assert index.match(router_hashes(prompt)) == {"a": 6}
    assert all(index.reported("a", key) for key in router_hashes(prompt))
    assert precise.stats.counts["relearned_blocks"] == 4
    assert precise.stats.counts["unknown_parent"] == 0
    # The relearnt prefix goes with its last engine block.
    last = sim_hashing.block_hashes(system, 16)[-1]
    precise.apply_events("a", [BlockRemoved(block_hashes=[last])])
    assert index.match(router_hashes(system)) == {}


def test_an_unknown_parent_two_open_predictions_place_differently_is_not_guessed():
    rng = random.Random(24)
    engine, index, precise, clock = _resynced_pod(rng)
    shared = tokens(rng, 16)  # one block both prompts end with
    first, second = tokens(rng, 64) + shared, tokens(rng, 64) + shared
    engine.serve(first)
    engine.events()  # missed: the engine holds `first`
    index.record("a", router_hashes(first), token="r1")
    index.record("a", router_hashes(second), token="r2")
    engine.serve(second)
    precise.apply_events("a", engine.events())  # `second` whole: a root, no guess needed
    orphan = BlockStored(block_hashes=[777], parent_block_hash=999, token_ids=shared, block_size=16)
    precise.apply_events("a", [orphan])  # `shared` after either prefix: ambiguous
    assert precise.stats.counts["relearn_ambiguous"] == 1
    assert precise.stats.counts["unknown_parent"] == 1
    index.completed("r1", 0.0)
    index.completed("r2", 0.0)
    clock.now = 100.0
    assert index.match(router_hashes(first)) == {}


def test_a_child_that_continues_no_open_prediction_stays_unknown():
    rng = random.Random(25)
    engine, index, precise, _ = _resynced_pod(rng)
    head = tokens(rng, 64)
    engine.serve(head)
    engine.events()
    index.record("a", router_hashes(tokens(rng, 96)), token="other")  # another prompt
    engine.serve(head + tokens(rng, 32))  # not routed by us (no prediction of it)
    precise.apply_events("a", engine.events())
    assert precise.stats.counts["unknown_parent"] == 2
    assert precise.stats.counts["relearned_blocks"] == 0
    assert index.match(router_hashes(head)) == {}
