"""A pod's continuous health in [0, 1] from what the EPP can observe without the pod's help.

- Scrape failures: each consecutive failure costs `failure_health_step` (default 0.25), so
  three in a row (150 ms at the default interval) put a dead pod below the 0.3 cut-off.
- Staleness: metrics older than `stale_after_s` mean 0, so a frozen pod whose scrapes time
  out never looks idle on old numbers.
- Response errors: a moving average of 5xx answers the EPP sees on the response path
  scales health down, so a pod that accepts connections but fails requests loses traffic
  gradually.
A pod that was never scraped successfully has no health evidence: 0.5, routable but
behind any pod known to be good.
"""

from __future__ import annotations

from epp.config import DataLayerConfig
from epp.datalayer.endpoint import Endpoint

UNKNOWN_HEALTH = 0.5


def compute_health(endpoint: Endpoint, now: float, config: DataLayerConfig) -> float:
    if endpoint.metrics_at is None:
        base = UNKNOWN_HEALTH if endpoint.consecutive_failures == 0 else 0.0
    elif now - endpoint.metrics_at > config.stale_after_s:
        return 0.0
    else:
        base = 1.0 - config.failure_health_step * endpoint.consecutive_failures
    return max(0.0, min(1.0, base * (1.0 - endpoint.error_rate)))
