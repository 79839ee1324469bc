"""The per-request histograms the simulator publishes, with vLLM 0.33's bucket bounds.

Two groups, because only one of them needs a clock:

- `RequestTokenStats`: token counts per finished request. The engine observes these
  itself in `finish`, so every driver gets them for free.
- `LatencyStats`: times per request, in engine seconds. The driver observes these, since
  only it knows when things happened: the HTTP server measures wall time / `time_scale`
  (so a pod run with `--time-scale 0.1` reports the latencies of the pod it imitates, not
  the ten-times-shorter ones it takes), a virtual-time driver uses its own clock.

Like vLLM, time to first token and inter-token latency are observed as they happen; the
other request histograms once a request finishes normally (aborted requests only count in
`request_success_total{finished_reason="abort"}`).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import partial

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip

# e2e, queue, inference, prefill and decode times share these.
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
REQUEST_TIME_BUCKETS = E2E_BUCKETS

# Inter-token latency and time per output token.
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# Token counts per request (prompt, generation, max_tokens, prefill computed).
TOKEN_BUCKETS: tuple[float, ...] = (
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0,
    1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
)  # fmt: skip

PARAMS_N_BUCKETS: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 20.0)
PREEMPTION_BUCKETS: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram: `le` buckets (upper bound inclusive), sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("bucket bounds must be strictly increasing")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[int]:
        """Counts per `le` bound as Prometheus prints them, ending with +Inf (== count)."""
        running = 0
        out: list[int] = []
        for count in self.counts:
            running += count
            out.append(running)
        return out


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    """When one request reached each stage, in engine seconds on the driver's clock."""

    arrived: float  # submitted to the engine (joined the waiting queue)
    scheduled: float  # first scheduled: its prefill began
    first_token: float
    finished: float  # last token out
    output_tokens: int


@dataclass(slots=True)
class LatencyStats:
    """Request times, in engine seconds (see the module docstring for who observes them)."""

    ttft: Histogram = field(default_factory=partial(Histogram, TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=partial(Histogram, E2E_BUCKETS))
    inter_token: Histogram = field(default_factory=partial(Histogram, ITL_BUCKETS))
    time_per_output_token: Histogram = field(default_factory=partial(Histogram, ITL_BUCKETS))
    queue: Histogram = field(default_factory=partial(Histogram, REQUEST_TIME_BUCKETS))
    inference: Histogram = field(default_factory=partial(Histogram, REQUEST_TIME_BUCKETS))
    prefill: Histogram = field(default_factory=partial(Histogram, REQUEST_TIME_BUCKETS))
    decode: Histogram = field(default_factory=partial(Histogram, REQUEST_TIME_BUCKETS))

    def observe_finished(self, timeline: RequestTimeline) -> None:
        """Every per-request time but TTFT and ITL, which are observed as they happen."""
        self.e2e.observe(timeline.finished - timeline.arrived)
        self.queue.observe(timeline.scheduled - timeline.arrived)
        self.inference.observe(timeline.finished - timeline.scheduled)
        self.prefill.observe(timeline.first_token - timeline.scheduled)
        decode = timeline.finished - timeline.first_token
        self.decode.observe(decode)
        if timeline.output_tokens > 1:
            self.time_per_output_token.observe(decode / (timeline.output_tokens - 1))


@dataclass(slots=True)
class RequestTokenStats:
    """Token counts of requests that finished normally, as vLLM's request histograms."""

    prompt_tokens: Histogram = field(default_factory=partial(Histogram, TOKEN_BUCKETS))
    generation_tokens: Histogram = field(default_factory=partial(Histogram, TOKEN_BUCKETS))
    max_num_generation_tokens: Histogram = field(default_factory=partial(Histogram, TOKEN_BUCKETS))
    params_n: Histogram = field(default_factory=partial(Histogram, PARAMS_N_BUCKETS))
    params_max_tokens: Histogram = field(default_factory=partial(Histogram, TOKEN_BUCKETS))
    num_preemptions: Histogram = field(default_factory=partial(Histogram, PREEMPTION_BUCKETS))
    prefill_kv_computed_tokens: Histogram = field(default_factory=partial(Histogram, TOKEN_BUCKETS))

    def observe(
        self, prompt_tokens: int, cached_tokens: int, output_tokens: int, max_tokens: int
    ) -> None:
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(output_tokens)
        # One sequence per request (n = 1), so the most it may generate is max_tokens.
        self.max_num_generation_tokens.observe(max_tokens)
        self.params_n.observe(1)
        self.params_max_tokens.observe(max_tokens)
        self.num_preemptions.observe(0)  # blocks are reserved up front: never preempted
        self.prefill_kv_computed_tokens.observe(prompt_tokens - cached_tokens)
