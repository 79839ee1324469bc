"""A pod's continuous health in [0, 1] from what the EPP can observe without the pod's help.

- Scrape failures: each consecutive failure costs `failure_health_step` (default 0.25), so
  three in a row (150 ms at the default interval) put a dead pod below the 0.3 cut-off.
  One good scrape restores it. A failure is charged only once another pod's page has
  been fetched after it: failures that hit every pod at once (a partition between the
  EPP and the pods, the EPP's own network or loop) are the EPP's problem, and excluding
  everybody would stop traffic that Envoy can still deliver. A dead pod whose peers
  answer is charged within a scrape interval of each failure.
- Staleness: metrics older than `stale_after_s` mean 0, so a frozen pod whose scrapes
  hang never looks idle on old numbers. Likewise only when some other pod's page was
  fetched after this one's went stale; otherwise staleness is not held against it, the
  gauges are not trusted, and routing falls back on the EPP's own counts.
- Response errors: a moving average of 5xx answers scales health down, so a pod that
  accepts connections but fails requests loses traffic gradually. The average decays
  towards 0 with `error_decay_s`, because a pod excluded for errors gets no requests
  whose success could lower it: without decay it would never come back. Every 5xx
  counts, 500 included: vLLM answers 400 for a body it rejects, and 500 when the engine
  fails (EngineDeadError, an internal error), so a 500 is the pod's until proven
  otherwise. A client whose requests make pods fail is bounded by the floor instead.
- Hysteresis: below `scheduling.health_threshold` (0.3) a pod is unhealthy, and it comes
  back only at `readmit_health` (0.5). With the defaults, a pod excluded at a 100% error
  rate returns after 10 s x ln(1/0.5) = 6.9 s; if it still fails, three errors exclude it
  again and it rests another 10 s x ln(0.74/0.5) = 3.9 s. A flapping pod is retried every
  few seconds with a handful of requests, not on every scrape.
- Floor and panic (per model, EndpointStore): a pod `down` for scrapes or staleness is
  always excluded; a pod unhealthy for errors only while at most
  `max_error_exclusion_share` of its model's pods (rounded down; 0.5) are excluded, the
  worst first, so one client's failing requests never empty a model. A model left with
  no routable pod (or fewer than `healthy_panic_share`) is in panic: all its pods are
  routed to, as Envoy does below its healthy_panic_threshold.
A pod that was never scraped successfully has no health evidence: 0.5, routable but
behind any pod known to be good.

This module is the only writer of the health fields of an Endpoint (the ownership table
is in datalayer/endpoint.py): the failures charged and waiting to be charged, the 5xx
average, `health`, `down`, `unhealthy`, `excluded`, `panic` and `gauges_valid`. The store
decides when (a page, a failure, a response, the clock) and calls the functions below.
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


def base_health(
    endpoint: Endpoint, now: float, config: DataLayerConfig, reached_at: float
) -> float:
    """Health from scraping alone. `reached_at`: the latest fetch of any pod's page."""
    if endpoint.metrics_at is None:
        return UNKNOWN_HEALTH if endpoint.charged_failures == 0 else 0.0
    if is_stale(endpoint, now, config) and reached_at - endpoint.metrics_at > config.stale_after_s:
        return 0.0  # others were fetched after this page went stale: the pod is silent
    return max(0.0, 1.0 - config.failure_health_step * endpoint.charged_failures)


def with_errors(base: float, endpoint: Endpoint, now: float, config: DataLayerConfig) -> float:
    """Health: the scraping health scaled down by the decayed 5xx rate."""
    errors = decayed_error_rate(endpoint, now, config)
    return max(0.0, min(1.0, base * (1.0 - errors)))


def failure_seen(endpoint: Endpoint, now: float, max_unconfirmed: int) -> None:
    """A scrape failed at `now`: it waits to be charged until another pod's page is fetched
    after it. More than `max_unconfirmed` waiting could not lower health further."""
    if len(endpoint.unconfirmed_failures) < max_unconfirmed:
        endpoint.unconfirmed_failures.append(now)


def page_fetched(endpoint: Endpoint) -> None:
    """A good page: the pod's failures, charged or waiting, are forgiven."""
    endpoint.charged_failures = 0
    endpoint.unconfirmed_failures.clear()


def response_seen(endpoint: Endpoint, status: int, now: float, config: DataLayerConfig) -> None:
    """A response with `status` came back from the pod: fold it into the decaying 5xx
    average (every 5xx counts, see above)."""
    failed = 1.0 if status >= 500 else 0.0
    current = decayed_error_rate(endpoint, now, config)
    endpoint.error_rate = current + config.error_rate_alpha * (failed - current)
    endpoint.error_at = now


def assess(
    endpoint: Endpoint, now: float, config: DataLayerConfig, reached_at: float, threshold: float
) -> bool:
    """Re-derive the pod's health, `down`, `unhealthy` and `gauges_valid` at `now`;
    `reached_at` is the latest fetch of any pod's page. Returns whether `down` or
    `unhealthy` changed: the floor of the pod's model (`apply_floor`) must then be
    re-applied, which needs the model's other pods and so is the store's call."""
    unconfirmed = endpoint.unconfirmed_failures
    while unconfirmed and unconfirmed[0] <= reached_at:
        unconfirmed.popleft()  # another pod answered after it: this failure is the pod's
        endpoint.charged_failures += 1
    base = base_health(endpoint, now, config, reached_at)
    endpoint.health = with_errors(base, endpoint, now, config)
    was = (endpoint.down, endpoint.unhealthy)
    endpoint.down = base < threshold
    update_exclusion(endpoint, threshold, config.readmit_health)
    valid = endpoint.metrics is not None and not is_stale(endpoint, now, config)
    if valid != endpoint.gauges_valid:
        endpoint.gauges_valid = valid
        endpoint.refresh()
    return was != (endpoint.down, endpoint.unhealthy)


def update_exclusion(endpoint: Endpoint, threshold: float, readmit: float) -> None:
    """Apply the hysteresis to `unhealthy`: below `threshold`, back at `readmit` or above."""
    if endpoint.unhealthy:
        if endpoint.health >= max(readmit, threshold):
            endpoint.unhealthy = False
    elif endpoint.health < threshold:
        endpoint.unhealthy = True


def apply_floor(
    pods: list[Endpoint], max_error_share: float, panic_share: float, panic: bool
) -> bool:
    """Decide `excluded` and `panic` for the pods of one model; returns whether the model
    is in panic. Pods `down` are out whatever the floor; pods unhealthy for errors only
    fill what room `max_error_share` leaves, those already out first (no churn), then the
    worst. Panic: no pod routable, or fewer than `panic_share` of them."""
    total = len(pods)
    room = math.floor(max_error_share * total + 1e-9) - sum(1 for e in pods if e.down)
    erroring = [e for e in pods if e.unhealthy and not e.down]
    if len(erroring) > 1:
        erroring.sort(key=lambda e: (not e.excluded, e.health))
    for e in pods:
        if e.down:
            e.excluded = True
        elif not e.unhealthy:
            e.excluded = False
    for rank, e in enumerate(erroring):
        e.excluded = rank < room
    routable = sum(1 for e in pods if not e.excluded)
    in_panic = panic and total > 0 and (routable == 0 or routable < panic_share * total)
    for e in pods:
        e.panic = in_panic
    return in_panic
