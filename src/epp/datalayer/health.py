"""A pod's continuous health in [0, 1] from what the EPP can observe without the pod's help.

- Scrape failures: each consecutive failure costs `failure_health_step` (default 0.25), so
  three in a row (150 ms at the default interval) put a dead pod below the 0.3 cut-off.
  One good scrape restores it.
- Staleness: metrics older than `stale_after_s` mean 0, so a frozen pod whose scrapes
  hang never looks idle on old numbers. But only while some other pod is fresh: when no
  pod has fresh metrics the fault is the EPP's or the network's (a blocked event loop, a
  partition), and excluding everybody would stop all traffic. Then staleness is ignored,
  the gauges are not trusted, and routing falls back on the EPP's own counts.
- Response errors: a moving average of 5xx answers scales health down, so a pod that
  accepts connections but fails requests loses traffic gradually. The average decays
  towards 0 with `error_decay_s`, because a pod excluded for errors gets no requests
  whose success could lower it: without decay it would never come back.
- Hysteresis: below `scheduling.health_threshold` (0.3) a pod is excluded, and it comes
  back only at `readmit_health` (0.5). With the defaults, a pod excluded at a 100% error
  rate returns after 10 s x ln(1/0.5) = 6.9 s; if it still fails, three errors exclude it
  again and it rests another 10 s x ln(0.74/0.5) = 3.9 s. A flapping pod is retried every
  few seconds with a handful of requests, not on every scrape.
A pod that was never scraped successfully has no health evidence: 0.5, routable but
behind any pod known to be good.
"""

from __future__ import annotations

import math

from epp.config import DataLayerConfig
from epp.datalayer.endpoint import Endpoint

UNKNOWN_HEALTH = 0.5


def decayed_error_rate(endpoint: Endpoint, now: float, config: DataLayerConfig) -> float:
    elapsed = now - endpoint.error_at
    if endpoint.error_rate <= 0.0 or elapsed <= 0.0:
        return endpoint.error_rate
    return endpoint.error_rate * math.exp(-elapsed / config.error_decay_s)


def is_stale(endpoint: Endpoint, now: float, config: DataLayerConfig) -> bool:
    return endpoint.metrics_at is not None and now - endpoint.metrics_at > config.stale_after_s


def compute_health(
    endpoint: Endpoint, now: float, config: DataLayerConfig, *, staleness_counts: bool = True
) -> float:
    if endpoint.metrics_at is None:
        base = UNKNOWN_HEALTH if endpoint.consecutive_failures == 0 else 0.0
    elif staleness_counts and is_stale(endpoint, now, config):
        return 0.0
    else:
        base = 1.0 - config.failure_health_step * endpoint.consecutive_failures
    errors = decayed_error_rate(endpoint, now, config)
    return max(0.0, min(1.0, base * (1.0 - errors)))


def update_exclusion(endpoint: Endpoint, threshold: float, readmit: float) -> None:
    """Apply the hysteresis: excluded below `threshold`, back at `readmit` or above."""
    if endpoint.excluded:
        if endpoint.health >= max(readmit, threshold):
            endpoint.excluded = False
    elif endpoint.health < threshold:
        endpoint.excluded = True
