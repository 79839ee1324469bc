"""Every answer the EPP gives itself instead of routing: counted and logged, in one place.

The ext_proc server calls `Answers.answered` once for each ImmediateResponse it sends
(400, 404, 413, 429, 503, 500 ...):

- `epp_answers_total{status,reason}` counts every one. Both labels come from the EPP's
  code (the reason is the `x-request-dropped-reason` header), never from the client.
- one INFO line `request_answered` with the request id, status, reason and the answer's
  message (which never quotes the prompt), rate-limited per (status, reason): a token
  bucket of `burst` lines refilled at `per_second` lines a second. Lines over the budget
  are dropped and counted in `epp_answer_logs_suppressed_total{reason}`; the next line
  logged for that reason carries `suppressed=N`, how many were dropped since the last
  one. A flood of 10,000 bad requests a second thus writes about `per_second` lines a
  second per reason, and the counters still count every answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from epp.observability.loop_metrics import LoopCounter

log = structlog.get_logger("epp.answers")

DEFAULT_BURST = 20
DEFAULT_PER_SECOND = 5.0
MESSAGE_LIMIT = 200


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    suppressed: int = 0


class Answers:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        burst: int = DEFAULT_BURST,
        per_second: float = DEFAULT_PER_SECOND,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = LoopCounter(
            "epp_answers_total",
            "Requests the EPP answered itself instead of routing them (ImmediateResponse),"
            " by HTTP status and reason (the x-request-dropped-reason header).",
            ["status", "reason"],
            registry=registry,
        )
        self.suppressed = LoopCounter(
            "epp_answer_logs_suppressed_total",
            "request_answered log lines dropped by the per-reason rate limit (the answers"
            " are still counted in epp_answers_total).",
            ["reason"],
            registry=registry,
        )
        self._burst = float(burst)
        self._rate = per_second
        self._clock = clock
        self._buckets: dict[tuple[int, str], _Bucket] = {}

    def answered(
        self, request_id: str | None, status: int, reason: str, message: str = "", **fields: Any
    ) -> None:
        """Count one answer and log it unless its reason is over its log budget."""
        self.total.labels(str(status), reason).inc()
        suppressed = self._admit((status, reason))
        if suppressed is None:
            self.suppressed.labels(reason).inc()
            return
        if suppressed:
            fields["suppressed"] = suppressed
        if len(message) > MESSAGE_LIMIT:
            message = message[:MESSAGE_LIMIT] + "..."
        log.info(
            "request_answered",
            request_id=request_id,
            status=status,
            reason=reason,
            message=message,
            **fields,
        )

    def _admit(self, key: tuple[int, str]) -> int | None:
        """None: over budget. Else how many lines of this key were dropped before."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self._burst, now)
        else:
            bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) * self._rate)
            bucket.at = now
        if bucket.tokens < 1.0:
            bucket.suppressed += 1
            return None
        bucket.tokens -= 1.0
        dropped, bucket.suppressed = bucket.suppressed, 0
        return dropped
