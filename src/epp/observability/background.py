"""Errors of the EPP's background work (the maintenance loop's steps, the queue's release
passes): counted, logged with the traceback at most once per interval per step, and
survived. A step that raises is retried at its next turn; nothing stops for good.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter

log = structlog.get_logger("epp.background")

LOG_INTERVAL_S = 60.0


@dataclass(slots=True)
class _StepLog:
    logged_at: float
    suppressed: int = 0


class BackgroundErrors:
    """`failed(step, exc)` from inside an `except` block: one count, and the traceback
    logged unless this step logged one less than `interval_s` ago (those are counted in
    the next line's `suppressed`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counter = Counter(
            "epp_background_errors_total",
            "Exceptions in the EPP's background work, by step (health-refresh, queue-retry,"
            " queue-release, precise-stale, readiness); the work goes on.",
            ["step"],
            registry=registry,
        )
        self._interval_s = interval_s
        self._clock = clock
        self._logs: dict[str, _StepLog] = {}

    def failed(self, step: str, exc: BaseException) -> None:
        self.counter.labels(step).inc()
        now = self._clock()
        last = self._logs.get(step)
        if last is not None and now - last.logged_at < self._interval_s:
            last.suppressed += 1
            return
        suppressed = last.suppressed if last is not None else 0
        self._logs[step] = _StepLog(now)
        log.error(
            "background_step_failed",
            step=step,
            error=f"{type(exc).__name__}: {exc}"[:500],
            suppressed_since_last=suppressed,
            exc_info=exc,
        )
