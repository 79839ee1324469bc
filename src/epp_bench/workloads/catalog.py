"""The field's benchmark workloads, as seeded `Workload`s (see `epp_bench.workloads.types`).

Every generator is a pure function of its arguments: the same seed gives the same
requests, byte for byte, so every router (virtual or live) faces exactly the same traffic.
Lengths are in pseudo-tokens of 4 UTF-8 bytes, the EPP's byte estimate (the simulated
pod's own tokenizer counts within 1% of it on these texts), and texts are ASCII so that
bytes equal characters and lengths are exact.

- `shared_prefix`: inference-perf's `shared_prefix` data type, the field's standard
  (groups x prompts per group; prompt = system prompt + " " + question, completions API,
  shuffled so the groups interleave). `STANDARD` is llm-d's published shape, `QUICK` a
  scaled-down one for fast runs.
- `multi_turn`: chat conversations over shared system prompts; every turn resends the whole
  history (assistant replies written here), after a think time.
- `multi_lora`: tenants, one LoRA adapter each (model = adapter name), Zipf popularity,
  each tenant with its own prefix.
- `no_reuse`: unique prompts; prefix-aware routing must not lose to load balancing here.
- `burst`: a thundering herd: many requests with one new prefix at (almost) one instant.

Open-loop arrivals are Poisson at the given rate; `with_rate` / `rate_ladder` re-time the
same prompts for a sweep of rates.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from epp.tokenization.estimate import BYTES_PER_PSEUDO_TOKEN
from epp.tokenization.protocol import ChatMessage
from epp_bench.workloads.types import BenchRequest, Workload

DEFAULT_MODEL = "sim-llama-8b"
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_LETTER_WEIGHTS = (12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1)
_VOCABULARY_SIZE = 2000


@dataclass(frozen=True, slots=True)
class SharedPrefixShape:
    """inference-perf `shared_prefix` parameters, in tokens."""

    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int

    @property
    def requests(self) -> int:
        return self.groups * self.prompts_per_group


# llm-d's published benchmark (field.md): 150 x 5, 6,000 / 1,200 / 1,000.
STANDARD = SharedPrefixShape(150, 5, 6000, 1200, 1000)
# The same ratios scaled down about 4x in prompt and 10x in output: seconds, not minutes.
QUICK = SharedPrefixShape(30, 5, 1500, 300, 100)


class TextSource:
    """Seeded pseudo-text of an exact length: random words from a fixed vocabulary.

    Words make blocks differ (a run of one character would hash every block alike) and are
    drawn in bulk with `random.choices`, which keeps the 7 MB of the standard shape well
    under a second.
    """

    __slots__ = ("_rng", "_words")

    def __init__(self, rng: random.Random, vocabulary_size: int = _VOCABULARY_SIZE) -> None:
        self._rng = rng
        words: set[str] = set()
        while len(words) < vocabulary_size:
            length = rng.randint(2, 9)
            words.add("".join(rng.choices(_LETTERS, _LETTER_WEIGHTS, k=length)))
        self._words = sorted(words)

    def text(self, tokens: int, header: str = "") -> str:
        """`header` then words, exactly `tokens * 4` bytes (the header counts)."""
        target = tokens * BYTES_PER_PSEUDO_TOKEN
        parts = [header]
        length = len(header)
        while length < target:
            # ~6.5 bytes per word with its space; draw a little more than needed.
            words = self._rng.choices(self._words, k=(target - length) // 6 + 8)
            chunk = " ".join(words) + " "
            parts.append(chunk)
            length += len(chunk)
        return "".join(parts)[:target]


def poisson_arrivals(
    count: int, rate: float, rng: random.Random, start: float = 0.0
) -> list[float]:
    """`count` arrival times of a Poisson process of `rate` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    times: list[float] = []
    now = start
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def shared_prefix(
    shape: SharedPrefixShape = STANDARD,
    *,
    rate: float = 10.0,
    seed: int = 0,
    requests: int | None = None,
    model: str = DEFAULT_MODEL,
    name: str = "shared-prefix",
) -> Workload:
    """inference-perf's `shared_prefix`: prompt = system prompt of its group + " " + question.

    As inference-perf does, the prompts are shuffled and then sent in that order, cycling
    when `requests` exceeds groups x prompts (a longer stage reuses whole prompts).
    """
    _check_positive(
        groups=shape.groups,
        prompts_per_group=shape.prompts_per_group,
        system_tokens=shape.system_tokens,
        question_tokens=shape.question_tokens,
        output_tokens=shape.output_tokens,
    )
    rng = random.Random(seed)
    source = TextSource(rng)
    prompts: list[tuple[str, str]] = []
    for group in range(shape.groups):
        system = source.text(shape.system_tokens, f"[group {group} system] ")
        for prompt in range(shape.prompts_per_group):
            # The separator is one byte, as in inference-perf; the question fills the rest.
            question = source.text(shape.question_tokens, f"[g{group} q{prompt}] ")
            prompts.append((f"group-{group}", system + " " + question))
    rng.shuffle(prompts)
    count = len(prompts) if requests is None else requests
    _check_positive(requests=count)
    arrivals = poisson_arrivals(count, rate, rng)
    out = tuple(
        BenchRequest(
            index=i,
            arrival_s=arrivals[i],
            kind="completion",
            model=model,
            max_tokens=shape.output_tokens,
            prompt=prompts[i % len(prompts)][1],
            group=prompts[i % len(prompts)][0],
        )
        for i in range(count)
    )
    return Workload(
        name=name,
        requests=out,
        description=(
            f"inference-perf shared_prefix: {shape.groups} groups x {shape.prompts_per_group}"
            f" prompts, system {shape.system_tokens} / question {shape.question_tokens} /"
            f" output {shape.output_tokens} tokens, Poisson arrivals"
        ),
        params={
            "shape": {
                "groups": shape.groups,
                "prompts_per_group": shape.prompts_per_group,
                "system_tokens": shape.system_tokens,
                "question_tokens": shape.question_tokens,
                "output_tokens": shape.output_tokens,
            },
            "rate": rate,
            "seed": seed,
            "model": model,
        },
    )


def multi_turn(
    *,
    conversations: int = 64,
    turns: int = 4,
    system_prompts: int = 8,
    system_tokens: int = 1500,
    user_tokens: int = 64,
    reply_tokens: int = 128,
    think_s: float = 2.0,
    rate: float = 2.0,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Chats over shared system prompts; each turn resends the whole history.

    Conversations start as a Poisson process of `rate` per second. Turn k+1 follows turn k
    (`after`) once it completes plus a think time drawn from an exponential of mean
    `think_s`; its `arrival_s` is only a lower bound (turn 0's arrival + the think times).
    The assistant replies in the history are `reply_tokens` long and also the number of
    tokens each turn asks for, so the history grows as it would with a real model.
    """
    _check_positive(
        conversations=conversations,
        turns=turns,
        system_prompts=system_prompts,
        system_tokens=system_tokens,
        user_tokens=user_tokens,
        reply_tokens=reply_tokens,
    )
    if think_s < 0:
        raise ValueError(f"think_s must be >= 0, got {think_s}")
    rng = random.Random(seed)
    source = TextSource(rng)
    systems = [source.text(system_tokens, f"[system prompt {i}] ") for i in range(system_prompts)]
    # Balanced groups, shuffled so that they interleave.
    assignment = [i % system_prompts for i in range(conversations)]
    rng.shuffle(assignment)
    starts = poisson_arrivals(conversations, rate, rng)
    requests: list[BenchRequest] = []
    for conversation, group in enumerate(assignment):
        history: list[ChatMessage] = [ChatMessage("system", systems[group])]
        previous: int | None = None
        arrival = starts[conversation]
        for turn in range(turns):
            think = 0.0 if turn == 0 else rng.expovariate(1.0 / think_s) if think_s else 0.0
            arrival += think
            user = ChatMessage("user", source.text(user_tokens, f"[c{conversation} t{turn}] "))
            history.append(user)
            index = len(requests)
            requests.append(
                BenchRequest(
                    index=index,
                    arrival_s=arrival,
                    kind="chat",
                    model=model,
                    max_tokens=reply_tokens,
                    messages=tuple(history),
                    group=f"system-{group}",
                    session=f"conversation-{conversation}",
                    after=previous,
                    think_s=think,
                )
            )
            history.append(ChatMessage("assistant", source.text(reply_tokens)))
            previous = index
    return Workload(
        name="multi-turn",
        requests=tuple(requests),
        description=(
            f"multi-turn chat: {conversations} conversations x {turns} turns over"
            f" {system_prompts} system prompts of {system_tokens} tokens, user {user_tokens}"
            f" / reply {reply_tokens} tokens, think {think_s:g} s, Poisson conversation starts"
        ),
        params={
            "conversations": conversations,
            "turns": turns,
            "system_prompts": system_prompts,
            "system_tokens": system_tokens,
            "user_tokens": user_tokens,
            "reply_tokens": reply_tokens,
            "think_s": think_s,
            "rate": rate,
            "seed": seed,
            "model": model,
        },
    )


def zipf_weights(count: int, exponent: float) -> list[float]:
    """Popularity of ranks 1..count, proportional to 1 / rank^exponent, summing to 1."""
    raw = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def multi_lora(
    *,
    adapters: int = 12,
    requests: int = 600,
    zipf_exponent: float = 1.0,
    prefix_tokens: int = 1000,
    question_tokens: int = 200,
    output_tokens: int = 100,
    rate: float = 10.0,
    seed: int = 0,
    base_model: str = DEFAULT_MODEL,
) -> Workload:
    """Tenants on LoRA adapters of one base model, popularity skewed by a Zipf law.

    The request's `model` is the adapter's name (how vLLM selects an adapter) and each
    tenant's prompts open with its own prefix. `params["adapters"]` maps every adapter to
    the base model, which is what the EPP's `adapters:` setting needs.
    """
    _check_positive(
        adapters=adapters,
        requests=requests,
        prefix_tokens=prefix_tokens,
        question_tokens=question_tokens,
        output_tokens=output_tokens,
    )
    rng = random.Random(seed)
    source = TextSource(rng)
    names = [f"lora-{i:02d}" for i in range(adapters)]
    prefixes = [source.text(prefix_tokens, f"[tenant {name}] ") for name in names]
    tenants = rng.choices(range(adapters), zipf_weights(adapters, zipf_exponent), k=requests)
    arrivals = poisson_arrivals(requests, rate, rng)
    out = tuple(
        BenchRequest(
            index=i,
            arrival_s=arrivals[i],
            kind="completion",
            model=names[tenant],
            max_tokens=output_tokens,
            prompt=prefixes[tenant] + " " + source.text(question_tokens, f"[r{i}] "),
            group=names[tenant],
        )
        for i, tenant in enumerate(tenants)
    )
    return Workload(
        name="multi-lora",
        requests=out,
        description=(
            f"multi-LoRA: {adapters} adapters, Zipf {zipf_exponent:g}, {requests} requests,"
            f" prefix {prefix_tokens} / question {question_tokens} / output {output_tokens}"
            f" tokens, Poisson arrivals"
        ),
        params={
            "adapters": dict.fromkeys(names, base_model),
            "base_model": base_model,
            "zipf_exponent": zipf_exponent,
            "prefix_tokens": prefix_tokens,
            "question_tokens": question_tokens,
            "output_tokens": output_tokens,
            "rate": rate,
            "seed": seed,
        },
    )


def no_reuse(
    *,
    requests: int = 600,
    prompt_tokens: int = 1000,
    output_tokens: int = 200,
    rate: float = 10.0,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Unique prompts (they differ from their first block): nothing to reuse."""
    _check_positive(requests=requests, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    rng = random.Random(seed)
    source = TextSource(rng)
    arrivals = poisson_arrivals(requests, rate, rng)
    out = tuple(
        BenchRequest(
            index=i,
            arrival_s=arrivals[i],
            kind="completion",
            model=model,
            max_tokens=output_tokens,
            prompt=source.text(prompt_tokens, f"[unique {i}] "),
            group=f"unique-{i}",
        )
        for i in range(requests)
    )
    return Workload(
        name="no-reuse",
        requests=out,
        description=(
            f"no reuse: {requests} unique prompts of {prompt_tokens} tokens, output"
            f" {output_tokens}, Poisson arrivals"
        ),
        params={
            "requests": requests,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "rate": rate,
            "seed": seed,
            "model": model,
        },
    )


def burst(
    *,
    requests: int = 128,
    prefix_tokens: int = 4000,
    question_tokens: int = 200,
    output_tokens: int = 200,
    window_s: float = 0.05,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """A thundering herd: `requests` sharing one new prefix, all within `window_s`.

    The default window is one scrape interval (50 ms), so no router that waits for
    scraped metrics can see the herd building up: only its own accounting can.
    """
    _check_positive(
        requests=requests,
        prefix_tokens=prefix_tokens,
        question_tokens=question_tokens,
        output_tokens=output_tokens,
    )
    if window_s < 0:
        raise ValueError(f"window_s must be >= 0, got {window_s}")
    rng = random.Random(seed)
    source = TextSource(rng)
    prefix = source.text(prefix_tokens, "[herd prefix] ")
    arrivals = sorted(rng.uniform(0.0, window_s) for _ in range(requests))
    out = tuple(
        BenchRequest(
            index=i,
            arrival_s=arrivals[i],
            kind="completion",
            model=model,
            max_tokens=output_tokens,
            prompt=prefix + " " + source.text(question_tokens, f"[herd {i}] "),
            group="herd",
        )
        for i in range(requests)
    )
    return Workload(
        name="burst",
        requests=out,
        description=(
            f"burst: {requests} requests sharing one {prefix_tokens}-token prefix within"
            f" {window_s * 1000:g} ms, question {question_tokens} / output {output_tokens}"
        ),
        params={
            "requests": requests,
            "prefix_tokens": prefix_tokens,
            "question_tokens": question_tokens,
            "output_tokens": output_tokens,
            "window_s": window_s,
            # The herd's own rate; None when it arrives at a single instant.
            "rate": requests / window_s if window_s > 0 else None,
            "seed": seed,
            "model": model,
        },
    )


def with_rate(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """The same prompts at another Poisson rate.

    Open-loop requests (no `after`) get new arrivals in index order; a follow-up turn keeps
    its think time, its arrival moved to its predecessor's arrival + think (a lower bound).
    """
    rng = random.Random(f"rate:{seed}:{rate}")
    open_loop = [r for r in workload.requests if r.after is None]
    arrivals = iter(poisson_arrivals(len(open_loop), rate, rng))
    retimed: list[BenchRequest] = []
    for request in workload.requests:
        if request.after is None:
            arrival = next(arrivals)
        else:
            arrival = retimed[request.after].arrival_s + request.think_s
        retimed.append(replace(request, arrival_s=arrival))
    params: dict[str, Any] = {**workload.params, "rate": rate, "rate_seed": seed}
    return replace(workload, requests=tuple(retimed), params=params)


def rate_ladder(workload: Workload, rates: Iterable[float], seed: int = 0) -> list[Workload]:
    """`with_rate` for each rate: one sweep over the same prompts."""
    return [with_rate(workload, rate, seed) for rate in rates]


def offered_rate(requests: Sequence[BenchRequest]) -> float | None:
    """Open-loop requests per second over their arrival span (None below two requests)."""
    times = sorted(r.arrival_s for r in requests if r.after is None)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


WORKLOADS = (
    "shared-prefix",
    "shared-prefix-small",
    "multi-turn",
    "multi-lora",
    "no-reuse",
    "burst",
)


def by_name(name: str, *, rate: float = 10.0, seed: int = 0) -> Workload:
    """The named workload with its defaults (the CLI's `--workload`)."""
    if name == "shared-prefix":
        return shared_prefix(STANDARD, rate=rate, seed=seed)
    if name == "shared-prefix-small":
        return shared_prefix(QUICK, rate=rate, seed=seed, name="shared-prefix-small")
    if name == "multi-turn":
        return multi_turn(rate=rate, seed=seed)
    if name == "multi-lora":
        return multi_lora(rate=rate, seed=seed)
    if name == "no-reuse":
        return no_reuse(rate=rate, seed=seed)
    if name == "burst":
        return burst(seed=seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
