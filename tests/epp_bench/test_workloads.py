"""Benchmark workloads: seeded, shaped as asked, Poisson at the asked rate, chats that grow."""

from __future__ import annotations

import statistics
import time

import pytest

from epp.tokenization.estimate import BYTES_PER_PSEUDO_TOKEN, ByteEstimateTokenizer
from epp_bench.workloads import catalog as workloads
from epp_bench.workloads.types import BenchRequest

TINY = workloads.SharedPrefixShape(
    groups=4, prompts_per_group=3, system_tokens=64, question_tokens=16, output_tokens=8
)


def _system_part(request: BenchRequest, system_tokens: int) -> str:
    assert request.prompt is not None
    return request.prompt[: system_tokens * BYTES_PER_PSEUDO_TOKEN]


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_every_workload_is_deterministic_for_a_seed(name: str) -> None:
    assert workloads.by_name(name, seed=3) == workloads.by_name(name, seed=3)
    assert workloads.by_name(name, seed=3) != workloads.by_name(name, seed=4)


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_requests_are_indexed_in_order_and_arrive_in_order(name: str) -> None:
    requests = workloads.by_name(name).requests
    assert [r.index for r in requests] == list(range(len(requests)))
    open_loop = [r.arrival_s for r in requests if r.after is None]
    assert open_loop == sorted(open_loop)


def test_shared_prefix_shape_and_exact_lengths() -> None:
    workload = workloads.shared_prefix(TINY, rate=5.0, seed=1)
    requests = workload.requests
    assert len(requests) == TINY.groups * TINY.prompts_per_group
    # system prompt + " " + question, in bytes of ASCII: 4 per pseudo-token (+1 separator).
    expected = (TINY.system_tokens + TINY.question_tokens) * BYTES_PER_PSEUDO_TOKEN + 1
    assert {len(r.prompt or "") for r in requests} == {expected}
    assert all(r.prompt and r.prompt.isascii() for r in requests)
    assert {r.max_tokens for r in requests} == {TINY.output_tokens}
    assert all(r.kind == "completion" for r in requests)
    by_group: dict[str, set[str]] = {}
    for request in requests:
        by_group.setdefault(request.group, set()).add(_system_part(request, TINY.system_tokens))
    assert len(by_group) == TINY.groups
    # One system prompt per group, a different one for every group.
    assert all(len(prompts) == 1 for prompts in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == TINY.groups
    # Questions all differ.
    assert len({r.prompt for r in requests}) == len(requests)


def test_shared_prefix_text_varies_block_to_block() -> None:
    request = workloads.shared_prefix(TINY, seed=2).requests[0]
    block = 16 * BYTES_PER_PSEUDO_TOKEN
    assert request.prompt is not None
    chunks = [request.prompt[i : i + block] for i in range(0, len(request.prompt) - block, block)]
    assert len(set(chunks)) == len(chunks)
    assert len(set(request.prompt)) > 15  # words, not a repeated character


def test_shared_prefix_interleaves_groups_and_cycles_when_asked_for_more() -> None:
    workload = workloads.shared_prefix(TINY, seed=0, requests=30)
    groups = [r.group for r in workload.requests]
    assert len(groups) == 30
    first_pass = groups[:12]
    assert first_pass != sorted(first_pass)  # shuffled, not group after group
    assert [r.prompt for r in workload.requests[12:24]] == [
        r.prompt for r in workload.requests[:12]
    ]


def test_standard_and_quick_shapes() -> None:
    assert workloads.SharedPrefixShape(150, 5, 6000, 1200, 1000) == workloads.STANDARD
    assert workloads.STANDARD.requests == 750
    assert workloads.QUICK.requests == 150


def test_generating_the_standard_shape_is_fast() -> None:
    # CPU time of this process (about 0.13 s): the other processes of a loaded machine do not
    # count, as they do in wall time (0.5 to 1.4 s measured for the same work). The bound is
    # a guard against a several-fold slower generator, not a benchmark.
    started = time.process_time()
    workload = workloads.shared_prefix(workloads.STANDARD)
    elapsed = time.process_time() - started
    assert len(workload.requests) == 750
    assert elapsed < 0.6


def test_poisson_rate_is_roughly_the_asked_rate() -> None:
    import random

    times = workloads.poisson_arrivals(4000, 25.0, random.Random(7))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 25.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(1 / 25.0, rel=0.1)
    with pytest.raises(ValueError):
        workloads.poisson_arrivals(3, 0.0, random.Random(0))


def test_rate_ladder_keeps_prompts_and_changes_only_arrivals() -> None:
    base = workloads.shared_prefix(TINY, rate=1.0)
    slow, fast = workloads.rate_ladder(base, [2.0, 50.0])
    assert [r.prompt for r in slow.requests] == [r.prompt for r in base.requests]
    assert slow.params["rate"] == 2.0 and fast.params["rate"] == 50.0
    assert fast.requests[-1].arrival_s < slow.requests[-1].arrival_s
    many = workloads.with_rate(workloads.shared_prefix(TINY, requests=2000), 40.0)
    assert workloads.offered_rate(many.requests) == pytest.approx(40.0, rel=0.1)


def test_multi_turn_histories_grow_by_prefix() -> None:
    workload = workloads.multi_turn(conversations=6, turns=3, system_prompts=2, seed=5)
    requests = workload.requests
    assert len(requests) == 18
    tokenizer = ByteEstimateTokenizer()
    for request in requests:
        assert request.kind == "chat" and request.messages is not None
        assert request.messages[0].role == "system"
        assert request.messages[-1].role == "user"
        if request.after is None:
            assert len(request.messages) == 2
            assert request.think_s == 0.0
            continue
        previous = requests[request.after]
        assert previous.messages is not None
        assert previous.session == request.session and previous.group == request.group
        # Same history, then the assistant's reply and the next user message.
        assert request.messages[: len(previous.messages)] == previous.messages
        assert [m.role for m in request.messages[len(previous.messages) :]] == [
            "assistant",
            "user",
        ]
        assert request.think_s > 0
        assert request.arrival_s == pytest.approx(previous.arrival_s + request.think_s)
        # The rendered prompt of the previous turn is a token prefix of this one.
        before = tokenizer.encode_chat(previous.messages)[:-4]  # minus the generation prompt
        assert tokenizer.encode_chat(request.messages)[: len(before)] == before
    sessions = {r.session for r in requests}
    assert len(sessions) == 6
    assert len({r.group for r in requests}) == 2


def test_multi_lora_zipf_skew_and_own_prefix_per_tenant() -> None:
    workload = workloads.multi_lora(adapters=12, requests=3000, zipf_exponent=1.0, seed=1)
    counts: dict[str, int] = {}
    prefixes: dict[str, set[str]] = {}
    for request in workload.requests:
        counts[request.model] = counts.get(request.model, 0) + 1
        assert request.prompt is not None
        prefixes.setdefault(request.model, set()).add(request.prompt[:200])
    assert len(counts) == 12
    assert set(workload.params["adapters"]) == set(counts)
    assert set(workload.params["adapters"].values()) == {workloads.DEFAULT_MODEL}
    weights = workloads.zipf_weights(12, 1.0)
    assert counts["lora-00"] / 3000 == pytest.approx(weights[0], rel=0.1)
    assert counts["lora-00"] > 5 * counts["lora-11"]
    assert all(len(p) == 1 for p in prefixes.values())
    assert len({next(iter(p)) for p in prefixes.values()}) == 12


def test_no_reuse_prompts_differ_from_the_first_block() -> None:
    workload = workloads.no_reuse(requests=50, prompt_tokens=100)
    first_blocks = {(r.prompt or "")[:64] for r in workload.requests}
    assert len(first_blocks) == 50
    assert {len(r.prompt or "") for r in workload.requests} == {400}


def test_burst_shares_one_prefix_within_the_window() -> None:
    workload = workloads.burst(requests=40, prefix_tokens=100, window_s=0.05)
    prefixes = {(r.prompt or "")[:400] for r in workload.requests}
    assert len(prefixes) == 1
    assert max(r.arrival_s for r in workload.requests) <= 0.05
    assert len({r.prompt for r in workload.requests}) == 40


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        workloads.shared_prefix(workloads.SharedPrefixShape(0, 5, 10, 10, 10))
    with pytest.raises(ValueError):
        workloads.multi_turn(think_s=-1.0)
    with pytest.raises(ValueError):
        workloads.by_name("nope")
