"""The demo workload: reproducible, prefix-structured, shared system prompts."""

from __future__ import annotations

import dataclasses

import pytest

from epp_demo.workload import (
    BYTES_PER_TOKEN,
    WorkloadSpec,
    chat_request_body,
    generate,
    turn_messages,
)

SMALL = WorkloadSpec(
    seed=7,
    system_prompts=3,
    system_prompt_tokens=200,
    conversations=9,
    turns=3,
    user_message_tokens=20,
)


def test_same_seed_gives_identical_workload() -> None:
    assert generate(SMALL) == generate(SMALL)


def test_different_seed_gives_different_prompts() -> None:
    other = generate(dataclasses.replace(SMALL, seed=8))
    assert other.system_prompts != generate(SMALL).system_prompts


def test_sizes_follow_the_spec() -> None:
    workload = generate(SMALL)
    assert len(workload.system_prompts) == 3
    assert len(workload.conversations) == 9
    assert workload.total_requests == 27
    for prompt in workload.system_prompts:
        # A short header plus exactly the requested body length.
        body = prompt.split("] ", 1)[1]
        assert len(body.encode()) == 200 * BYTES_PER_TOKEN
    for conversation in workload.conversations:
        assert len(conversation.turns) == 3
        assert conversation.turns[0].think_time_s == 0.0
        for turn in conversation.turns[1:]:
            assert 0.0 <= turn.think_time_s <= 0.05


def test_text_is_varied_words_not_a_repeated_character() -> None:
    prompt = generate(SMALL).system_prompts[0]
    words = prompt.split()
    assert len(set(words)) > 50
    assert len(set(prompt)) > 15


def test_system_prompts_are_distinct_and_shared_evenly() -> None:
    workload = generate(SMALL)
    assert len(set(workload.system_prompts)) == 3
    groups = [c.system_prompt_index for c in workload.conversations]
    assert sorted(groups.count(i) for i in range(3)) == [3, 3, 3]
    # Distinct from the first 16-token block on, so groups never share a cached block.
    heads = {p[: 16 * BYTES_PER_TOKEN] for p in workload.system_prompts}
    assert len(heads) == 3


def test_user_messages_are_unique_across_conversations() -> None:
    workload = generate(SMALL)
    messages = [t.user_message for c in workload.conversations for t in c.turns]
    assert len(set(messages)) == len(messages)


def test_next_turn_extends_previous_turn_with_the_reply() -> None:
    workload = generate(SMALL)
    conversation = workload.conversations[4]
    replies = ["first answer", "second answer"]
    previous = turn_messages(workload, conversation, 0, [])
    for turn in (1, 2):
        current = turn_messages(workload, conversation, turn, replies[:turn])
        assert current[: len(previous)] == previous
        assert current[len(previous)] == {"role": "assistant", "content": replies[turn - 1]}
        assert current[-1] == {"role": "user", "content": conversation.turns[turn].user_message}
        assert len(current) == len(previous) + 2
        previous = current


def test_conversations_of_a_group_share_the_system_message() -> None:
    workload = generate(SMALL)
    by_group: dict[int, set[str]] = {}
    for conversation in workload.conversations:
        system = turn_messages(workload, conversation, 0, [])[0]
        assert system["role"] == "system"
        by_group.setdefault(conversation.system_prompt_index, set()).add(system["content"])
    assert all(len(contents) == 1 for contents in by_group.values())
    assert len({next(iter(c)) for c in by_group.values()}) == 3


def test_turn_without_enough_replies_is_rejected() -> None:
    workload = generate(SMALL)
    with pytest.raises(ValueError, match="replies"):
        turn_messages(workload, workload.conversations[0], 2, ["only one"])


def test_request_body_streams_with_usage() -> None:
    body = chat_request_body(SMALL, [{"role": "user", "content": "hi"}])
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == SMALL.max_tokens
    assert body["model"] == SMALL.model


@pytest.mark.parametrize(
    "overrides",
    [{"conversations": 0}, {"turns": 0}, {"system_prompts": 0}, {"think_time_ms": (5.0, 1.0)}],
)
def test_invalid_spec_is_rejected(overrides: dict) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(**overrides)
