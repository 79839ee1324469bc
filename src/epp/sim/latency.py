"""Latency histograms the simulator publishes, with vLLM 0.33's bucket bounds.

Observations are engine seconds (see `epp.sim.server` for how wall time maps to them), so a
pod run with `--time-scale 0.1` reports the latencies of the pod it imitates, not the
ten-times-shorter ones it actually takes. A virtual-time driver observes its own values.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip

E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


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


@dataclass(slots=True)
class LatencyStats:
    """Time to first token and end-to-end latency of served requests."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
