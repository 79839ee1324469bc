"""What every benchmark runner consumes and produces, so that workloads, runners
(virtual-time and live), baselines and reports stay interchangeable."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from epp.tokenization.protocol import ChatMessage


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload, fully determined by the workload's seed.

    Open-loop requests arrive at `arrival_s`. A later turn of a conversation
    (`after` = index of the previous turn) is sent `think_s` after that turn completes,
    so `arrival_s` is then only a lower bound. Assistant replies inside `messages` are
    written by the workload, not taken from the server: prefix reuse in vLLM comes from
    the prompt blocks, so the cache behaviour is the same and the workload stays fixed.
    """

    index: int
    arrival_s: float
    kind: Literal["chat", "completion"]
    model: str
    max_tokens: int
    prompt: str | None = None  # completion
    messages: tuple[ChatMessage, ...] | None = None  # chat
    group: str = ""  # shared-prefix group (system prompt / tenant / adapter)
    session: str | None = None  # conversation id
    after: int | None = None  # index of the request this one follows (multi-turn)
    think_s: float = 0.0
    cache_salt: str | None = None

    def body(self, stream: bool = True) -> dict[str, Any]:
        """The OpenAI request body for live runs."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.kind == "chat":
            assert self.messages is not None
            body["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        else:
            body["prompt"] = self.prompt
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return body


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestOutcome:
    index: int
    pod: str | None
    status: int  # HTTP status (virtual runs: 200, or 429 when the queue is full)
    start_s: float  # when it was sent, from the run's start
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass(slots=True)
class RunResult:
    """One router on one workload at one rate."""

    router: str
    workload: str
    rate: float | None  # requests/s offered (None: closed loop)
    pods: int
    duration_s: float
    outcomes: list[RequestOutcome]
    pod_hit_rate: float | None = None  # as the pods report it (vllm:prefix_cache_* deltas)
    epp_cpu_us_per_decision: float | None = None
    mode: Literal["virtual", "live"] = "virtual"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
