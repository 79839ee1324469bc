"""What a soak run's samples mean: growth slopes and their verdicts, latency quantiles from
Prometheus histogram deltas, the ceiling of a rate ladder, and the recovery after a burst.

Pure functions over recorded numbers, so the verdicts are tested without a stack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epp_harness.stats import percentile


def slope_per_minute(times_s: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of `values` over `times_s`, per minute (0 for < 2 distinct times)."""
    n = len(times_s)
    if n != len(values):
        raise ValueError("times and values differ in length")
    if n < 2:
        return 0.0
    mean_t = sum(times_s) / n
    mean_v = sum(values) / n
    var_t = sum((t - mean_t) ** 2 for t in times_s)
    if var_t == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in zip(times_s, values, strict=True))
    return cov / var_t * 60.0


@dataclass(frozen=True, slots=True)
class Growth:
    """One resource's trend over the steady window."""

    name: str
    unit: str
    first: float
    last: float
    mean: float
    slope_per_min: float
    limit_per_min: float  # the largest slope still called flat

    @property
    def flat(self) -> bool:
        return self.slope_per_min <= self.limit_per_min


# Flat means a leak this size or smaller could not matter within a day of this load:
# RSS under 0.5 MB/min (< 720 MB/day, and a 10-minute fit cannot resolve much less on a
# Python heap that breathes by a few MB); fds under 0.2 per minute (one leaked descriptor
# in 5 minutes); tasks under 0.5 per minute (tasks follow in-flight requests, which swing by
# tens at this rate; a leak of one task per request would show as thousands per minute).
FLAT_LIMITS: Mapping[str, float] = {"rss_mb": 0.5, "open_fds": 0.2, "asyncio_tasks": 0.5}


def growth(name: str, unit: str, times_s: Sequence[float], values: Sequence[float]) -> Growth:
    if not values:
        raise ValueError(f"no samples of {name}")
    return Growth(
        name=name,
        unit=unit,
        first=values[0],
        last=values[-1],
        mean=sum(values) / len(values),
        slope_per_min=slope_per_minute(times_s, values),
        limit_per_min=FLAT_LIMITS[name],
    )


def histogram_quantile(
    q: float, before: Mapping[float, float], after: Mapping[float, float]
) -> float | None:
    """The q-quantile (0..1) of the observations between two snapshots of one cumulative
    histogram (upper bound -> count, +Inf included), interpolated linearly inside the bucket
    as PromQL's histogram_quantile does; None when nothing was observed. A quantile in the
    +Inf bucket is reported as the largest finite bound."""
    bounds = sorted(after)
    deltas = [after[b] - before.get(b, 0.0) for b in bounds]
    total = deltas[-1] if deltas else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, deltas, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass(frozen=True, slots=True)
class Step:
    """One rung of the rate ladder."""

    offered_rps: float
    achieved_rps: float
    ok: int
    failed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None


# Latency "starts to climb" when the median TTFT is this much above the lowest rate's,
# plus a few milliseconds so that scheduler noise on an idle stack is not a climb.
CLIMB_FACTOR = 1.5
CLIMB_SLACK_S = 0.005
# A rung the client could not offer (CPU) is past the ceiling whatever the latency said.
MIN_ACHIEVED_SHARE = 0.9


def step_holds(step: Step, baseline: Step) -> bool:
    """The stack kept up at this rung: nothing failed, the rate was delivered, and the
    median TTFT did not climb above the lowest rung's."""
    if step.failed or step.ttft_p50_s is None or baseline.ttft_p50_s is None:
        return False
    if step.achieved_rps < MIN_ACHIEVED_SHARE * step.offered_rps:
        return False
    return step.ttft_p50_s <= CLIMB_FACTOR * baseline.ttft_p50_s + CLIMB_SLACK_S


def ceiling(steps: Sequence[Step]) -> float | None:
    """The highest offered rate below the first rung that did not hold (None: not even the
    first held)."""
    if not steps:
        return None
    best: float | None = None
    for step in steps:
        if not step_holds(step, steps[0]):
            break
        best = step.offered_rps
    return best


def windowed_p50(
    points: Sequence[tuple[float, float]], start_s: float, end_s: float, window_s: float
) -> list[tuple[float, float | None]]:
    """(window start, median of the values sent in it) for consecutive windows."""
    out: list[tuple[float, float | None]] = []
    t = start_s
    while t < end_s:
        values = [v for sent, v in points if t <= sent < t + window_s]
        out.append((t, percentile(values, 50)))
        t += window_s
    return out


# Recovered means back within the steady band for this many consecutive 1-s windows: on a
# shared machine a single slow second long after the burst is other work, not the burst.
RECOVERY_HOLD_WINDOWS = 5


def recovery_s(
    points: Sequence[tuple[float, float]],
    burst_end_s: float,
    run_end_s: float,
    steady_p50_s: float,
    window_s: float = 1.0,
    hold_windows: int = RECOVERY_HOLD_WINDOWS,
) -> float | None:
    """Seconds from the burst's end until the TTFT median of requests sent in each window
    is back within CLIMB_FACTOR of the steady median (plus the slack) for `hold_windows`
    windows in a row; 0 if it never left, None if it never came back."""
    limit = CLIMB_FACTOR * steady_p50_s + CLIMB_SLACK_S
    windows = windowed_p50(points, burst_end_s, run_end_s, window_s)
    streak_start: float | None = None
    streak = 0
    for start, p50 in windows:
        if p50 is not None and p50 <= limit:
            if streak_start is None:
                streak_start = start
            streak += 1
            if streak >= hold_windows:
                return streak_start - burst_end_s
        else:
            streak_start, streak = None, 0
    return None
