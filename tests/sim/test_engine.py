"""The engine model, driven by hand with an explicit clock."""

from __future__ import annotations

import itertools
from array import array

import pytest

from vllm_sim.engine import Admission, EngineConfig, FinishReason, SimEngine, StartedRequest
from vllm_sim.hashing import BlockHash, block_hashes
from vllm_sim.tokenizer import ChatMessage, SimTokenizer


def tokens(n: int, start: int = 0) -> array[int]:
    return array("I", range(start, start + n))


def hashes_of(
    toks: array[int], block_size: int = 16, salt: str | None = None, adapter: str | None = None
) -> list[BlockHash]:
    return block_hashes(toks, block_size, lora_name=adapter, cache_salt=salt)


def common_prefix_length(a: list[BlockHash], b: list[BlockHash]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


class Driver:
    """Submits and starts requests with fresh ids, as a server would, on a clock that
    `serve` moves past each request's prefill (the next one finds the pod's prefill idle)."""

    def __init__(self, **config: object) -> None:
        self.engine = SimEngine(EngineConfig(**config))  # type: ignore[arg-type]
        self._ids = itertools.count()
        self.clock = 0.0

    def submit(
        self,
        toks: array[int],
        max_tokens: int = 1,
        adapter: str | None = None,
        salt: str | None = None,
    ) -> tuple[str, Admission]:
        req_id = f"r{next(self._ids)}"
        hashes = hashes_of(toks, self.engine.config.block_size, salt, adapter)
        return req_id, self.engine.submit(req_id, hashes, len(toks), max_tokens, adapter)

    def run(
        self,
        toks: array[int],
        max_tokens: int = 1,
        adapter: str | None = None,
        now: float | None = None,
    ) -> StartedRequest:
        """Submit and start one request on an otherwise idle engine; leaves it running."""
        self.clock = self.clock if now is None else max(self.clock, now)
        req_id, admission = self.submit(toks, max_tokens, adapter)
        assert admission is Admission.QUEUED
        [started] = self.engine.start_ready(self.clock if now is None else now)
        assert started.req_id == req_id
        return started

    def serve(self, toks: array[int], max_tokens: int = 1) -> StartedRequest:
        """Run one request to completion (the clock moves to the end of its prefill)."""
        started = self.run(toks, max_tokens)
        self.clock += started.prefill_seconds
        self.engine.finish(started.req_id, max_tokens)
        return started


# -- prefix reuse ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_lengths", "expected_cached"),
    [
        # A conversation growing by whole turns reuses every full block of the last turn.
        ((100, 200, 320), (0, 96, 192)),
        # The same prompt again: all 20 blocks are cached, but the last one is recomputed.
        ((320, 320), (0, 304)),
        # A shorter prompt sharing the start reuses its full blocks, minus the last token.
        ((320, 33, 32), (0, 32, 16)),
    ],
)
def test_prefix_reuse_of_token_prompts(
    prompt_lengths: tuple[int, ...], expected_cached: tuple[int, ...]
) -> None:
    driver = Driver()
    cached = tuple(driver.serve(tokens(n)).cached_tokens for n in prompt_lengths)
    assert cached == expected_cached
    counters = driver.engine.counters
    assert counters.prefix_cache_queries == sum(prompt_lengths)
    assert counters.prefix_cache_hits == sum(expected_cached)
    assert counters.prompt_tokens == sum(prompt_lengths)


@pytest.mark.parametrize(
    ("prompt_tokens", "expected_cached"),
    [(15, 0), (16, 0), (17, 16), (32, 16), (33, 32), (48, 32), (49, 48)],
)
def test_cached_tokens_stay_below_the_prompt_length(
    prompt_tokens: int, expected_cached: int
) -> None:
    driver = Driver()
    driver.serve(tokens(prompt_tokens))
    assert driver.serve(tokens(prompt_tokens)).cached_tokens == expected_cached


def test_growing_chat_conversation_reuses_earlier_turns() -> None:
    tokenizer = SimTokenizer()
    driver = Driver()
    conversation = [ChatMessage("system", "You are a terse assistant for a hardware store. " * 4)]
    previous: list[BlockHash] = []
    for turn in range(4):
        conversation.append(ChatMessage("user", f"Question {turn}: where are the hinges? " * 3))
        toks = tokenizer.encode_chat(conversation)
        hashes = hashes_of(toks)
        started = driver.serve(toks)
        common = common_prefix_length(previous, hashes)
        assert started.cached_tokens == 16 * min(common, (len(toks) - 1) // 16)
        if turn:
            # Everything up to the previous turn's generation prompt is shared.
            assert started.cached_tokens >= 16 * (len(previous) - 1) > 0
        conversation.append(ChatMessage("assistant", "Aisle seven, next to the screws."))
        previous = hashes


def test_cache_salt_keeps_blocks_apart() -> None:
    driver = Driver()
    driver.serve(tokens(64))
    driver.submit(tokens(64), salt="tenant-b")
    [started] = driver.engine.start_ready(0.0)
    assert started.cached_tokens == 0


# -- KV capacity and eviction ------------------------------------------------------------


def test_prompt_blocks_stay_cached_after_finish_and_are_evicted_lru_when_space_is_needed() -> None:
    # 8 blocks of 4 tokens. Every request below holds its 3 full prompt blocks plus 1
    # private block (partial prompt block + output).
    driver = Driver(block_size=4, num_gpu_blocks=8)
    engine = driver.engine
    a, b = tokens(15, start=1000), tokens(15, start=2000)
    driver.serve(a)
    driver.serve(b)  # cache now holds A's 3 blocks (older) and B's 3 blocks
    assert engine.cached_blocks == 6
    assert engine.kv_cache_usage == 0.0  # cached but idle blocks count as free, as in vLLM
    driver.serve(tokens(15, start=3000))  # 2 free blocks, needs 4: evicts A's tail two
    assert driver.serve(b).cached_tokens == 12  # B untouched (and its last block recomputed)
    assert driver.serve(a).cached_tokens == 4  # only A's first block survived


def test_blocks_of_running_requests_are_never_evicted() -> None:
    driver = Driver(block_size=4, num_gpu_blocks=8)
    engine = driver.engine
    running = driver.run(tokens(15, start=1000))  # pins 4 blocks
    driver.serve(tokens(15, start=2000))  # leaves 3 evictable blocks
    # Needs 5 new blocks: 4 free or evictable, so it has to wait.
    waiting_id, admission = driver.submit(tokens(19, start=3000))
    assert admission is Admission.QUEUED
    assert engine.start_ready(0.0) == []
    assert engine.is_waiting(waiting_id)
    engine.finish(running.req_id, 1)
    [started] = engine.start_ready(0.0)
    assert started.req_id == waiting_id
    # The running request's blocks survived the pressure: its prompt is still cached.
    engine.finish(waiting_id, 1)
    assert driver.serve(tokens(15, start=1000)).cached_tokens == 12


def test_kv_cache_usage_counts_pinned_blocks_once_per_block() -> None:
    driver = Driver(block_size=4, num_gpu_blocks=10)
    engine = driver.engine
    toks = tokens(10)  # 2 full blocks; with 2 output tokens, 3 blocks in all
    first = driver.run(toks, max_tokens=2)
    assert engine.kv_cache_usage == pytest.approx(0.3)
    req_id, _ = driver.submit(toks, max_tokens=2)
    engine.start_ready(0.0)
    assert engine.kv_cache_usage == pytest.approx(0.4)  # shares the 2 prompt blocks
    engine.finish(first.req_id, 2)
    engine.finish(req_id, 2)
    assert engine.kv_cache_usage == 0.0
    assert engine.cached_blocks == 2


def test_a_request_that_can_never_fit_is_refused() -> None:
    driver = Driver(block_size=4, num_gpu_blocks=8)
    assert driver.submit(tokens(30), max_tokens=2)[1] is Admission.QUEUED  # 32 tokens: fits
    assert driver.submit(tokens(30), max_tokens=3)[1] is Admission.TOO_LONG
    assert driver.engine.config.max_context_tokens == 32


def test_a_request_waiting_for_blocks_holds_the_queue_behind_it() -> None:
    driver = Driver(block_size=4, num_gpu_blocks=8)
    engine = driver.engine
    first = driver.run(tokens(15, start=1000))  # 4 of 8 blocks
    big_id, _ = driver.submit(tokens(19, start=2000))  # needs 5
    small_id, _ = driver.submit(tokens(3, start=3000))  # needs 1, but must wait its turn
    assert engine.start_ready(0.0) == []
    engine.finish(first.req_id, 1)
    assert [s.req_id for s in engine.start_ready(0.0)] == [big_id, small_id]


# -- queue and slots ---------------------------------------------------------------------


def test_fifo_queue_and_rejection_when_full() -> None:
    driver = Driver(max_num_seqs=2, max_waiting=2)
    engine = driver.engine
    submitted = [driver.submit(tokens(8, start=100 * i)) for i in range(5)]
    assert [admission for _, admission in submitted] == [Admission.QUEUED] * 4 + [
        Admission.QUEUE_FULL
    ]
    ids = [req_id for req_id, _ in submitted]
    assert [s.req_id for s in engine.start_ready(0.0)] == ids[:2]
    assert (engine.num_running, engine.num_waiting) == (2, 2)
    assert driver.submit(tokens(8))[1] is Admission.QUEUE_FULL
    engine.finish(ids[1], 1)
    assert [s.req_id for s in engine.start_ready(0.0)] == [ids[2]]
    assert driver.submit(tokens(8))[1] is Admission.QUEUED


@pytest.mark.parametrize(
    ("max_num_seqs", "max_waiting", "admitted"),
    [(1, 0, 1), (2, 0, 2), (1, 1, 2), (3, 2, 5)],
)
def test_free_slots_and_max_waiting_bound_admission(
    max_num_seqs: int, max_waiting: int, admitted: int
) -> None:
    driver = Driver(max_num_seqs=max_num_seqs, max_waiting=max_waiting)
    results = [driver.submit(tokens(8, start=100 * i))[1] for i in range(admitted + 1)]
    assert results.count(Admission.QUEUED) == admitted
    assert results[-1] is Admission.QUEUE_FULL


def test_finishing_a_waiting_request_removes_it_as_aborted() -> None:
    driver = Driver(max_num_seqs=1)
    engine = driver.engine
    running = driver.run(tokens(8))
    waiting_id, _ = driver.submit(tokens(8, start=50))
    engine.finish(waiting_id, 0, FinishReason.ABORT)
    engine.finish(running.req_id, 1)
    assert engine.start_ready(0.0) == []
    assert (engine.num_running, engine.num_waiting) == (0, 0)
    finished = engine.counters.finished
    assert (finished[FinishReason.ABORT], finished[FinishReason.LENGTH]) == (1, 1)
    assert engine.counters.prompt_tokens == 8  # the aborted one never reached prefill
    with pytest.raises(KeyError):
        engine.finish(waiting_id, 0)


# -- latency -----------------------------------------------------------------------------


def test_prefill_time_counts_only_uncached_tokens() -> None:
    driver = Driver(prefill_overhead_s=0.01, prefill_per_token_s=0.001)
    assert driver.serve(tokens(100)).prefill_seconds == pytest.approx(0.01 + 100 * 0.001)
    assert driver.serve(tokens(100)).prefill_seconds == pytest.approx(0.01 + 4 * 0.001)


@pytest.mark.parametrize(
    ("running", "expected"), [(0, 0.01), (1, 0.01), (3, 0.0125), (4, 0.01375), (6, 0.01375)]
)
def test_decode_slows_as_the_batch_fills(running: int, expected: float) -> None:
    driver = Driver(max_num_seqs=4, decode_per_token_s=0.01, batch_slowdown=0.5)
    for i in range(running):
        driver.submit(tokens(8, start=100 * i))
    driver.engine.start_ready(0.0)
    assert driver.engine.decode_step_seconds() == pytest.approx(expected)


# -- prefill compute: shared, first come first served ----------------------------------

# 1 ms per uncached token, 10 ms overhead, no lookup cost: a 100-token prefill takes 0.11 s.
LANE = {"prefill_overhead_s": 0.01, "prefill_per_token_s": 0.001, "decode_per_token_s": 0.002}


def test_concurrent_cold_prefills_queue_on_the_pods_compute() -> None:
    driver = Driver(**LANE)
    engine = driver.engine
    first_id, _ = driver.submit(tokens(100, start=1000))
    second_id, _ = driver.submit(tokens(100, start=2000))
    first, second = engine.start_ready(0.0)
    assert (first.req_id, second.req_id) == (first_id, second_id)
    assert first.prefill_seconds == pytest.approx(0.11)
    assert first.prefill_wait_seconds == 0.0
    # The second one waits for the first, then takes as long again: twice the time.
    assert second.prefill_wait_seconds == pytest.approx(0.11)
    assert second.prefill_seconds == pytest.approx(0.22)
    # A third one started later waits only for what is left.
    driver.submit(tokens(100, start=3000))
    [third] = engine.start_ready(0.2)
    assert third.prefill_wait_seconds == pytest.approx(0.02)
    assert third.prefill_seconds == pytest.approx(0.13)
    assert engine.prefill_busy_until(0.2) == pytest.approx(0.33)
    # On an idle pod nothing waits.
    fourth = driver.run(tokens(100, start=4000), now=1.0)
    assert (fourth.prefill_wait_seconds, fourth.prefill_seconds) == (0.0, pytest.approx(0.11))


def test_a_cached_prompt_waits_its_turn_but_its_own_prefill_is_short() -> None:
    driver = Driver(**LANE)
    engine = driver.engine
    driver.serve(tokens(100, start=500))  # cached from now on; the clock is at 0.11
    now = driver.clock
    driver.submit(tokens(100, start=1000))  # cold
    cached_id, _ = driver.submit(tokens(100, start=500))
    cold, cached = engine.start_ready(now)
    assert cached.req_id == cached_id and cached.cached_tokens == 96
    # It waits behind the cold one (FCFS), but its own part is 4 uncached tokens.
    assert cached.prefill_wait_seconds == pytest.approx(cold.prefill_seconds)
    own = cached.prefill_seconds - cached.prefill_wait_seconds
    assert own == pytest.approx(0.01 + 4 * 0.001)
    assert cached.prefill_seconds == pytest.approx(0.11 + 0.014)


def test_blocks_are_reusable_only_once_their_prefill_is_over() -> None:
    driver = Driver(**LANE)
    engine = driver.engine
    prompt = tokens(100)
    hashes = hashes_of(prompt)
    leader = driver.run(prompt)  # computes 6 blocks from 0 to 0.11
    assert leader.prefill_seconds == pytest.approx(0.11)
    assert engine.cached_prefix_blocks(hashes) == 6  # allocated and cached...
    assert engine.cached_prefix_blocks(hashes, now=0.05) == 0  # ...but not computed yet
    assert engine.cached_prefix_blocks(hashes, now=0.11) == 6
    # A follower started while the leader computes them looks them up when its own
    # prefill begins, after the leader's (FCFS): by then they are computed, so it
    # reuses them, and only its own short part follows the wait.
    follower = driver.run(prompt, now=0.05)
    assert follower.cached_tokens == 96
    assert follower.prefill_wait_seconds == pytest.approx(0.06)
    assert follower.prefill_seconds == pytest.approx(0.06 + 0.014)


def test_lookup_at_admission_what_if_recomputes_blocks_still_in_prefill() -> None:
    driver = Driver(**LANE, lookup_at_admission=True)
    engine = driver.engine
    prompt = tokens(100)
    driver.run(prompt)  # 0 -> 0.11
    early = driver.run(prompt, now=0.05)
    assert early.cached_tokens == 0  # the leader's blocks were not computed at 0.05
    assert early.prefill_seconds == pytest.approx(0.06 + 0.11)
    late = driver.run(prompt, now=0.12)
    assert late.cached_tokens == 96  # computed by the leader at 0.11
    assert engine.reusable_prefix_blocks(hashes_of(prompt), 0.12) == 6


def test_decode_slows_while_a_prefill_is_in_progress() -> None:
    # One chunk is 100 tokens x 1 ms = 0.1 s of prefill compute per step.
    driver = Driver(**LANE, max_num_batched_tokens=100, batch_slowdown=0.0)
    engine = driver.engine
    driver.run(tokens(500))  # prefill 0 -> 0.51
    itl = 0.002
    assert engine.decode_step_seconds() == pytest.approx(itl)  # no clock: the batch alone
    assert engine.decode_step_seconds(0.2) == pytest.approx(itl + 0.1)  # a full chunk
    assert engine.decode_step_seconds(0.46) == pytest.approx(itl + 0.05)  # the last bit
    assert engine.decode_step_seconds(0.51) == pytest.approx(itl)  # prefill over
    # Prefills queued behind one another fill a step's chunk together.
    driver.submit(tokens(30, start=1000))
    driver.submit(tokens(30, start=2000))
    engine.start_ready(1.0)  # 1.0 -> 1.04 -> 1.08
    assert engine.decode_step_seconds(1.0) == pytest.approx(itl + 0.08)
    assert engine.decode_step_seconds(1.05) == pytest.approx(itl + 0.03)


def test_requests_queued_behind_prefills_are_waiting_on_the_metrics() -> None:
    driver = Driver(**LANE)
    engine = driver.engine
    for start in (1000, 2000, 3000):
        driver.submit(tokens(100, start=start))
    engine.start_ready(0.0)  # prefills 0-0.11, 0.11-0.22, 0.22-0.33
    assert (engine.num_running, engine.num_waiting) == (3, 0)
    assert engine.num_prefill_queued(0.0) == 2
    assert engine.num_prefill_queued(0.15) == 1
    assert engine.num_prefill_queued(0.3) == 0


def test_the_prefill_model_is_deterministic() -> None:
    def replay() -> list[StartedRequest]:
        driver = Driver(**LANE, max_num_seqs=3, num_gpu_blocks=64)
        engine = driver.engine
        started: list[StartedRequest] = []
        now = 0.0
        for i in range(12):
            driver.submit(tokens(60 + 10 * (i % 3), start=100 * (i % 4)), max_tokens=4)
            started += engine.start_ready(now)
            if engine.num_running == 3:
                engine.finish(started[len(started) - 3].req_id, 4)
                started += engine.start_ready(now)
            now += 0.04
        return started

    assert replay() == replay()


# -- LoRA --------------------------------------------------------------------------------


def test_adapter_load_time_is_paid_once_per_load() -> None:
    driver = Driver(lora_load_s=0.2, prefill_overhead_s=0.0, prefill_per_token_s=0.0)
    engine = driver.engine
    first = driver.run(tokens(8), adapter="sql", now=1.0)
    assert first.adapter_wait_seconds == pytest.approx(0.2)
    assert first.prefill_seconds == pytest.approx(0.2)
    # Started while the adapter is still loading: waits for the same load to finish.
    second = driver.run(tokens(8, start=50), adapter="sql", now=1.05)
    assert second.adapter_wait_seconds == pytest.approx(0.15)
    engine.finish(first.req_id, 1)
    engine.finish(second.req_id, 1)
    # Resident after its requests finished: free from then on.
    assert driver.run(tokens(8, start=90), adapter="sql", now=5.0).adapter_wait_seconds == 0.0
    assert engine.loaded_adapters == ("sql",)


def test_adapter_without_a_slot_waits_without_blocking_others() -> None:
    driver = Driver(max_loras=2)
    engine = driver.engine
    a = driver.run(tokens(8, start=1), adapter="a")
    b = driver.run(tokens(8, start=2), adapter="b")
    c_id, _ = driver.submit(tokens(8, start=3), adapter="c")
    base_id, _ = driver.submit(tokens(8, start=4))
    assert [s.req_id for s in engine.start_ready(0.0)] == [base_id]
    assert engine.running_adapters == ("a", "b")
    assert engine.waiting_adapters == ("c",)
    engine.finish(a.req_id, 1)
    [started] = engine.start_ready(1.0)
    assert started.req_id == c_id
    assert started.adapter_wait_seconds > 0
    assert set(engine.loaded_adapters) == {"b", "c"}  # a was idle, so it was unloaded
    assert engine.running_adapters == ("b", "c")
    engine.finish(b.req_id, 1)
    assert list(engine.running_adapters) == ["c"]


@pytest.mark.parametrize(("rank", "wait"), [(8, 0.1), (16, 0.2), (32, 0.4), (64, 0.8)])
def test_adapter_load_time_follows_its_rank(rank: int, wait: float) -> None:
    driver = Driver(lora_load_s=0.2)
    driver.engine.load_adapter("sql", rank)
    assert driver.engine.adapter_rank("sql") == rank
    started = driver.run(tokens(8), adapter="sql", now=3.0)
    assert started.adapter_wait_seconds == pytest.approx(wait)


def test_an_adapter_never_registered_loads_with_the_default_rank() -> None:
    driver = Driver(lora_load_s=0.2)
    assert driver.run(tokens(8), adapter="ad-hoc").adapter_wait_seconds == pytest.approx(0.2)


def test_load_adapter_with_a_clock_preloads_it_into_a_free_or_idle_slot() -> None:
    driver = Driver(max_loras=1, lora_load_s=0.2)
    engine = driver.engine
    assert engine.load_adapter("a", 64, now=10.0) == pytest.approx(0.8)
    assert engine.loaded_adapters == ("a",)
    # Its first request arrives half-way through the load and waits for the rest only.
    first = driver.run(tokens(8), adapter="a", now=10.4)
    assert first.adapter_wait_seconds == pytest.approx(0.4)
    # With the only slot busy, a second adapter is registered but not resident.
    engine.load_adapter("b", 16, now=11.0)
    assert engine.loaded_adapters == ("a",)
    engine.finish(first.req_id, 1)
    engine.load_adapter("b", 16, now=12.0)  # "a" is idle now: evicted for "b"
    assert engine.loaded_adapters == ("b",)


def test_unload_frees_an_idle_slot_at_once_and_a_busy_one_when_its_requests_end() -> None:
    driver = Driver(max_loras=2)
    engine = driver.engine
    busy = driver.run(tokens(8), adapter="busy")
    driver.serve(tokens(8, start=50))
    engine.load_adapter("idle", now=0.0)
    assert set(engine.loaded_adapters) == {"busy", "idle"}
    engine.unload_adapter("idle")
    engine.unload_adapter("busy")
    assert engine.loaded_adapters == ("busy",)
    engine.finish(busy.req_id, 1)
    assert engine.loaded_adapters == ()
    assert engine.adapter_rank("busy") == 16  # forgotten: back to the default


def test_token_histograms_count_only_requests_that_finished_normally() -> None:
    driver = Driver()
    engine = driver.engine
    driver.serve(tokens(40), max_tokens=3)
    driver.serve(tokens(40), max_tokens=3)  # 32 of its tokens were cached
    aborted = driver.run(tokens(40, start=500), max_tokens=3)
    engine.finish(aborted.req_id, 1, FinishReason.ABORT)
    stats = engine.request_stats
    assert (stats.prompt_tokens.count, stats.prompt_tokens.total) == (2, 80)
    assert stats.generation_tokens.total == 6
    assert stats.params_max_tokens.total == 6
    assert stats.prefill_kv_computed_tokens.total == 40 + 8


def test_queue_full_refusals_are_counted_and_foreseeable() -> None:
    driver = Driver(max_num_seqs=1, max_waiting=0)
    assert not driver.engine.queue_full
    results = []
    for i in range(3):
        results.append(driver.submit(tokens(8, start=10 * i))[1])
        driver.engine.start_ready(0.0)
        assert driver.engine.queue_full
    assert results.count(Admission.QUEUE_FULL) == 2
    assert driver.engine.counters.queue_full_rejections == 2


def test_cached_prefix_blocks_is_a_read_only_lookup() -> None:
    driver = Driver()
    driver.serve(tokens(40))
    engine = driver.engine
    assert engine.cached_prefix_blocks(hashes_of(tokens(64))) == 2
    assert engine.cached_prefix_blocks(hashes_of(tokens(64, start=1))) == 0
    assert engine.counters.prefix_cache_queries == 40  # not counted as a query


def test_cached_tokens_cost_their_lookup_time() -> None:
    driver = Driver(
        prefill_overhead_s=0.01, prefill_per_token_s=0.001, prefill_per_cached_token_s=0.0001
    )
    driver.serve(tokens(100))
    assert driver.serve(tokens(100)).prefill_seconds == pytest.approx(
        0.01 + 4 * 0.001 + 96 * 0.0001
    )


# -- copies of a hash and output blocks (vLLM's block pool) --------------------------------


def test_a_fully_cached_prompt_recomputes_its_last_block_into_a_second_copy() -> None:
    driver = Driver(num_gpu_blocks=10)
    engine = driver.engine
    driver.serve(tokens(64))  # 4 blocks, exactly
    assert engine.cached_blocks == 4
    again = driver.run(tokens(64))
    assert again.cached_tokens == 48
    # The recomputed last block is a new block under the same hash, held with the 3 hits.
    assert engine.cached_blocks == 5
    assert engine.kv_cache_usage == pytest.approx(0.4)
    engine.finish(again.req_id, 1)
    assert engine.cached_prefix_blocks(hashes_of(tokens(64))) == 4


def test_the_reservation_leaves_out_the_last_generated_token() -> None:
    # vLLM never feeds the last sampled token back, so its KV never needs a slot: 31
    # prompt tokens and 2 output tokens fit in 2 blocks of 16.
    driver = Driver(num_gpu_blocks=10)
    driver.run(tokens(31), max_tokens=2)
    assert driver.engine.kv_cache_usage == pytest.approx(0.2)
    driver.run(tokens(31, start=100), max_tokens=3)
    assert driver.engine.kv_cache_usage == pytest.approx(0.5)


def serve_with_output(
    engine: SimEngine,
    req_id: str,
    toks: array[int],
    output: list[int],
    *,
    produced: int | None = None,
    adapter: str | None = None,
    salt: str | None = None,
) -> StartedRequest:
    block_size = engine.config.block_size
    hashes = hashes_of(toks, block_size, salt, adapter)
    admission = engine.submit(
        req_id,
        hashes,
        len(toks),
        len(output),
        adapter,
        prompt_token_ids=toks,
        cache_salt=salt,
    )
    assert admission is Admission.QUEUED
    [started] = engine.start_ready(0.0)
    produced = len(output) if produced is None else produced
    engine.finish(req_id, produced, output_token_ids=output[:produced])
    return started


def test_full_output_blocks_are_cached_and_a_prompt_quoting_the_output_hits_them() -> None:
    # vLLM's case (docs/benchmarks/sim-vs-vllm.md): 40 prompt ids and 40 generated ones
    # fill 2 blocks of 32 (79 tokens have KV); the 40 + 40 + 10 new ids then hit both.
    engine = SimEngine(EngineConfig(block_size=32, num_gpu_blocks=40))
    prompt, output, extra = tokens(40, 1000), list(range(5000, 5040)), tokens(10, 9000)
    serve_with_output(engine, "gen", prompt, output)
    assert engine.cached_blocks == 2
    follow_up = array("I", [*prompt, *output, *extra])
    assert serve_with_output(engine, "next", follow_up, [1]).cached_tokens == 64
    # A different output is a different block: only the prompt's first block hits.
    other = array("I", [*prompt, *range(6000, 6040), *extra])
    assert engine.cached_prefix_blocks(block_hashes(other, 32)) == 1


@pytest.mark.parametrize(
    ("prompt_tokens", "produced", "cached"),
    [
        (40, 40, 2),  # 79 tokens with KV: 2 full blocks
        (40, 24, 1),  # 63: the second block lacks the last generated token's KV
        (40, 25, 2),  # 64
        (64, 1, 2),  # the first token is sampled from the prompt: nothing to cache
        (10, 30, 1),  # 39: block 0 holds prompt and output, chained to NONE_HASH
    ],
)
def test_output_blocks_count_every_token_but_the_last_generated(
    prompt_tokens: int, produced: int, cached: int
) -> None:
    engine = SimEngine(EngineConfig(block_size=32, num_gpu_blocks=40))
    output = list(range(7000, 7040))
    serve_with_output(engine, "r", tokens(prompt_tokens, 100), output, produced=produced)
    assert engine.cached_blocks == cached
    sequence = array("I", [*tokens(prompt_tokens, 100), *output[: produced - 1]])
    hashes = block_hashes(sequence, 32)
    assert engine.cached_prefix_blocks(hashes) == cached == len(hashes)


def test_output_blocks_carry_the_adapter_and_salt_of_their_request() -> None:
    # Hashed as the prompt's are: the LoRA name on every block, cache_salt on block 0 (a
    # short prompt's block 0 is filled by its output).
    engine = SimEngine(EngineConfig(block_size=16, num_gpu_blocks=40))
    prompt, output = tokens(10, 100), list(range(7000, 7030))
    serve_with_output(engine, "r", prompt, output, adapter="sql", salt="tenant-a")
    sequence = array("I", [*prompt, *output[:29]])
    salted = hashes_of(sequence, 16, "tenant-a", "sql")
    assert len(salted) == 2 and engine.cached_prefix_blocks(salted) == 2
    assert engine.cached_prefix_blocks(hashes_of(sequence, 16, None, "sql")) == 0
    assert engine.cached_prefix_blocks(hashes_of(sequence, 16, "tenant-a")) == 0


def test_no_output_blocks_without_the_output_ids() -> None:
    engine = SimEngine(EngineConfig(block_size=16, num_gpu_blocks=40))
    toks = tokens(20)
    engine.submit("a", hashes_of(toks), 20, 20)  # the virtual benchmark's way: no ids
    engine.start_ready(0.0)
    engine.finish("a", 20)
    assert engine.cached_blocks == 1
    # With the ids, a prompt shorter than a block gets its block 0 from the output.
    short, output = tokens(8, start=300), list(range(20))
    engine.submit("b", [], 8, 20, prompt_token_ids=short)
    engine.start_ready(0.0)
    engine.finish("b", 20, output_token_ids=output)
    assert engine.cached_blocks == 2
    assert engine.cached_prefix_blocks(hashes_of(array("I", [*short, *output[:8]]))) == 1


def test_a_request_running_through_a_reset_caches_no_output_blocks() -> None:
    engine = SimEngine(EngineConfig(block_size=16, num_gpu_blocks=40))
    toks = tokens(20)
    engine.submit("a", hashes_of(toks), 20, 30, prompt_token_ids=toks)
    engine.start_ready(0.0)
    engine.reset_prefix_cache()
    engine.finish("a", 30, output_token_ids=list(range(30)))
    assert (engine.cached_blocks, engine.kv_cache_usage) == (0, 0.0)


def test_output_blocks_are_evicted_before_the_prompt_they_continue() -> None:
    engine = SimEngine(EngineConfig(block_size=4, num_gpu_blocks=6))
    prompt = tokens(8, 100)
    serve_with_output(engine, "gen", prompt, list(range(900, 905)))  # 2 prompt + 1 output
    assert engine.cached_blocks == 3
    serve_with_output(engine, "other", tokens(16, 500), [1])  # 4 blocks: 1 to evict
    assert engine.cached_prefix_blocks(hashes_of(prompt, 4)) == 2


# -- reset -------------------------------------------------------------------------------


def test_reset_prefix_cache_forgets_every_block_and_frees_held_ones_on_release() -> None:
    # After a reset nothing may be reused, or a KV-event subscriber told AllBlocksCleared
    # would miss hits; blocks a running request holds stay allocated until it finishes.
    driver = Driver(num_gpu_blocks=10)
    engine = driver.engine
    driver.serve(tokens(64, start=0))
    running = driver.run(tokens(64, start=1000), max_tokens=2)  # 4 prompt blocks + 1 private
    assert engine.reset_prefix_cache() == 4  # the idle blocks
    assert engine.cached_blocks == 0
    assert engine.kv_cache_usage == pytest.approx(0.5)  # still held
    # The same prompt cached anew while the old copy is still held counts twice.
    again = driver.run(tokens(64, start=1000), max_tokens=2)
    assert again.cached_tokens == 0
    assert engine.kv_cache_usage == pytest.approx(1.0)
    engine.finish(running.req_id, 1)
    engine.finish(again.req_id, 1)
    assert engine.kv_cache_usage == 0.0
    assert engine.cached_blocks == 4  # only the copy stored after the reset
    assert driver.serve(tokens(64, start=1000)).cached_tokens == 48
    assert driver.serve(tokens(64, start=0)).cached_tokens == 0


# -- validation --------------------------------------------------------------------------


def test_submit_rejects_inconsistent_input() -> None:
    engine = SimEngine()
    with pytest.raises(ValueError, match="one hash per full block"):
        engine.submit("x", [], 32, 1)
    with pytest.raises(ValueError, match="at least 1"):
        engine.submit("x", [], 0, 1)
    engine.submit("x", hashes_of(tokens(16)), 16, 1)
    with pytest.raises(ValueError, match="already"):
        engine.submit("x", hashes_of(tokens(16)), 16, 1)


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 0},
        {"num_gpu_blocks": 0},
        {"max_num_seqs": 0},
        {"max_waiting": -1},
        {"max_loras": 0},
        {"decode_per_token_s": -0.1},
        {"prefill_per_token_s": float("nan")},
        {"lora_load_s": float("inf")},
        {"prefill_per_cached_token_s": -1.0},
        {"gpu_memory_utilization": 0.0},
        {"gpu_memory_utilization": 1.5},
    ],
)
def test_engine_config_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**bad)  # type: ignore[arg-type]
