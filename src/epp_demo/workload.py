"""A seeded multi-turn chat workload whose conversations share system prompts.

This is the shape that separates a prefix-aware router from a cache-blind one: groups of
conversations open with the same long system prompt, and every turn resends the whole
history, so a pod that served turn k already holds most of turn k+1 in its KV cache.

Everything here is pure: the same spec gives the same prompts, byte for byte, so two runs
through two different stacks face exactly the same requests. Only the assistant replies
come from the server at run time; `turn_messages` threads them into the history.

Lengths are in pseudo-tokens of 4 UTF-8 bytes, the estimate the simulator and the EPP use.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

BYTES_PER_TOKEN = 4
DEFAULT_MODEL = "sim-llama-8b"

# Syllables for pronounceable pseudo-words: prompts look like text (varied bytes, spaces,
# punctuation) rather than runs of one character, which would make every block identical.
_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m")
_VOCABULARY_SIZE = 600


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How to build a workload; every field has the demo's default."""

    seed: int = 0
    system_prompts: int = 4
    system_prompt_tokens: int = 1500
    conversations: int = 32
    turns: int = 4
    user_message_tokens: int = 64
    max_tokens: int = 24
    think_time_ms: tuple[float, float] = (0.0, 50.0)
    model: str = DEFAULT_MODEL

    def __post_init__(self) -> None:
        positive = {
            "system_prompts": self.system_prompts,
            "system_prompt_tokens": self.system_prompt_tokens,
            "conversations": self.conversations,
            "turns": self.turns,
            "user_message_tokens": self.user_message_tokens,
            "max_tokens": self.max_tokens,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        low, high = self.think_time_ms
        if low < 0 or high < low:
            raise ValueError(f"think_time_ms must be 0 <= low <= high, got {self.think_time_ms}")


@dataclass(frozen=True, slots=True)
class Turn:
    """One user message; `think_time_s` is the pause before sending it (0 for turn 0)."""

    user_message: str
    think_time_s: float


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: int
    system_prompt_index: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    system_prompts: tuple[str, ...]
    conversations: tuple[Conversation, ...] = field(repr=False)

    @property
    def total_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def system_prompt(self, conversation: Conversation) -> str:
        return self.system_prompts[conversation.system_prompt_index]


def _vocabulary(rng: random.Random, size: int) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        syllables = rng.randint(1, 3)
        words.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    return sorted(words)


def pseudo_text(rng: random.Random, vocabulary: Sequence[str], tokens: int) -> str:
    """Sentences of random words, `tokens * 4` bytes long (ASCII, so bytes == characters)."""
    target = tokens * BYTES_PER_TOKEN
    parts: list[str] = []
    length = 0
    sentence_left = rng.randint(6, 16)
    capitalize = True
    while length < target:
        word = rng.choice(vocabulary)
        if capitalize:
            word = word.capitalize()
            capitalize = False
        sentence_left -= 1
        if sentence_left == 0:
            word += "."
            sentence_left = rng.randint(6, 16)
            capitalize = True
        piece = word if not parts else " " + word
        parts.append(piece)
        length += len(piece)
    return "".join(parts)[:target]


def generate(spec: WorkloadSpec) -> Workload:
    """The workload for `spec`; deterministic in `spec.seed`."""
    rng = random.Random(spec.seed)
    vocabulary = _vocabulary(rng, _VOCABULARY_SIZE)
    system_prompts = tuple(
        # A distinct header makes prompts differ from their very first block.
        f"[system prompt {index}] " + pseudo_text(rng, vocabulary, spec.system_prompt_tokens)
        for index in range(spec.system_prompts)
    )
    # Balanced groups, in shuffled order: every prompt serves the same number of
    # conversations (+-1), and the groups interleave instead of arriving one after another.
    assignment = [i % spec.system_prompts for i in range(spec.conversations)]
    rng.shuffle(assignment)
    low_ms, high_ms = spec.think_time_ms
    conversations = []
    for conversation_id, prompt_index in enumerate(assignment):
        turns = tuple(
            Turn(
                user_message=f"[c{conversation_id} t{turn}] "
                + pseudo_text(rng, vocabulary, spec.user_message_tokens),
                think_time_s=0.0 if turn == 0 else rng.uniform(low_ms, high_ms) / 1000.0,
            )
            for turn in range(spec.turns)
        )
        conversations.append(Conversation(conversation_id, prompt_index, turns))
    return Workload(spec, system_prompts, tuple(conversations))


def turn_messages(
    workload: Workload, conversation: Conversation, turn_index: int, replies: Sequence[str]
) -> list[dict[str, str]]:
    """The chat history sent for `turn_index`: system, then (user, assistant) pairs, then user.

    `replies` are the assistant texts the server returned for the earlier turns.
    """
    if len(replies) < turn_index:
        raise ValueError(
            f"turn {turn_index} needs {turn_index} earlier replies, got {len(replies)}"
        )
    messages = [{"role": "system", "content": workload.system_prompt(conversation)}]
    for earlier in range(turn_index):
        messages.append({"role": "user", "content": conversation.turns[earlier].user_message})
        messages.append({"role": "assistant", "content": replies[earlier]})
    messages.append({"role": "user", "content": conversation.turns[turn_index].user_message})
    return messages


def chat_request_body(spec: WorkloadSpec, messages: list[dict[str, str]]) -> dict:
    """A streaming /v1/chat/completions body that asks for usage on the last chunk."""
    return {
        "model": spec.model,
        "messages": messages,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
