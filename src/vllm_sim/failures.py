"""Failure injection, for testing how routers cope with pods that misbehave.

Per request, on the OpenAI endpoints and /metrics:

- the header `x-sim-fail: KIND` forces one failure on that request;
- `--failure-rate F --failure-kinds K,...` picks one at random for a fraction F of the
  generation requests (seeded with `--seed`, so a run is reproducible).

Kinds:

- `429`, `500`, `503`: an immediate error in vLLM's OpenAI shape;
- `hang`: the request takes its slot and KV blocks as usual but never answers; it gives
  them back when the client gives up (disconnects);
- `drop`: the TCP connection is closed without a response; a generation request is
  dropped when its first token is ready, and a streamed one after that token's chunk;
- `slow-metrics` (on GET /metrics only): the page comes after `--metrics-delay-ms`, or
  after `SLOW_METRICS_DEFAULT_S` when no delay is configured.

Per pod, at runtime (`POST /sim/fail`, see `PodFaults`): /health answers an error status;
/metrics answers garbage, hangs, or repeats its last page (frozen); every generation
request fails one way (`generation`: an error status, hang or drop) or starts late
(`delay_ms`: a slow pod); the KV-event publisher loses, reorders or duplicates batches
(`kv_events`). `--metrics-delay-ms` slows every /metrics.

This module decides; the server carries the decision out.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from vllm_sim.openai_errors import ApiError, error_type

FAIL_HEADER = "x-sim-fail"
# Set on every response an injected failure produced, so that a test can tell them apart.
INJECTED_HEADER = "x-sim-injected-failure"
# Beyond the 1 s scrape timeout of the usual endpoint pickers.
SLOW_METRICS_DEFAULT_S = 2.0


class FailureKind(StrEnum):
    TOO_MANY_REQUESTS = "429"
    INTERNAL_ERROR = "500"
    UNAVAILABLE = "503"
    HANG = "hang"
    DROP = "drop"
    SLOW_METRICS = "slow-metrics"

    @property
    def status(self) -> int | None:
        """The HTTP status of an error kind; None for the others."""
        return int(self.value) if self.value.isdigit() else None


ERROR_KINDS = frozenset(k for k in FailureKind if k.status is not None)
# What `--failure-kinds` may pick from at random (slow-metrics is not about a request).
RANDOM_KINDS = frozenset(FailureKind) - {FailureKind.SLOW_METRICS}

_ERROR_MESSAGES = {
    FailureKind.TOO_MANY_REQUESTS: "The server is overloaded, retry later.",
    FailureKind.INTERNAL_ERROR: "The engine failed while serving the request.",
    FailureKind.UNAVAILABLE: "The engine is unavailable.",
}


def injected_error(kind: FailureKind) -> ApiError:
    """The error response of an error kind (429/500/503), in vLLM's shape."""
    status = kind.status
    if status is None:
        raise ValueError(f"{kind} is not an error status")
    return ApiError(status, f"{_ERROR_MESSAGES[kind]} (injected failure)", error_type(status))


def parse_kinds(text: str) -> tuple[FailureKind, ...]:
    """`--failure-kinds`: comma-separated kinds -> tuple; ValueError names a bad one."""
    kinds: list[FailureKind] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            kind = FailureKind(item)
        except ValueError:
            raise ValueError(f"unknown failure kind {item!r}") from None
        if kind not in RANDOM_KINDS:
            raise ValueError(f"{item!r} cannot be injected at random")
        if kind not in kinds:
            kinds.append(kind)
    if not kinds:
        raise ValueError("no failure kinds given")
    return tuple(kinds)


@dataclass(frozen=True, slots=True)
class FailureConfig:
    """Random failures on generation requests (none by default)."""

    rate: float = 0.0
    kinds: tuple[FailureKind, ...] = (
        FailureKind.TOO_MANY_REQUESTS,
        FailureKind.INTERNAL_ERROR,
        FailureKind.UNAVAILABLE,
    )
    seed: int | None = None
    metrics_delay_s: float = 0.0  # every /metrics answers this much later (wall seconds)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError("failure rate must be in [0, 1]")
        if not self.kinds or any(kind not in RANDOM_KINDS for kind in self.kinds):
            raise ValueError(f"failure kinds must be among {sorted(RANDOM_KINDS)}")
        if not 0.0 <= self.metrics_delay_s < float("inf"):
            raise ValueError("metrics delay must be a finite number >= 0")


class FailureInjector:
    """Decides, request by request, which failure (if any) to inject."""

    __slots__ = ("_rng", "config")

    def __init__(self, config: FailureConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def for_generation(self, header: str | None) -> FailureKind | None:
        """The failure for a completion or chat request: forced by header, or random."""
        if header is not None:
            kind = parse_header(header)
            if kind is FailureKind.SLOW_METRICS:
                raise ApiError(400, f"{FAIL_HEADER}: slow-metrics applies to GET /metrics only.")
            return kind
        config = self.config
        if config.rate > 0.0 and self._rng.random() < config.rate:
            return self._rng.choice(config.kinds)
        return None


def parse_header(value: str) -> FailureKind:
    try:
        return FailureKind(value.strip().lower())
    except ValueError:
        raise ApiError(
            400,
            f"{FAIL_HEADER} must be one of {', '.join(k.value for k in FailureKind)}.",
        ) from None


class MetricsFault(StrEnum):
    GARBAGE = "garbage"  # 200 with a body no Prometheus parser accepts
    HANG = "hang"  # never answers
    FROZEN = "frozen"  # 200 with the page of the switch's moment, again and again


class KvEventsFault(StrEnum):
    """What the publisher does to each batch (numbered and buffered for replay as usual)."""

    DROP = "drop"  # never sent: the subscriber sees a gap at the next batch
    REORDER = "reorder"  # held back and sent after the next batch
    DUPLICATE = "duplicate"  # sent twice


# Pod-wide generation faults (`generation`): the per-request kinds except slow-metrics.
GENERATION_FAULTS = frozenset(RANDOM_KINDS)
MAX_DELAY_MS = 600_000


class TokenizeFault(StrEnum):
    """How POST /tokenize fails (a router asking the engine for ids must fall back)."""

    GARBAGE = "garbage"  # 200 with a body that is not vLLM's answer
    HANG = "hang"  # never answers
    ERROR = "error"  # 500


GARBAGE_METRICS_PAGE = b"<html>\x00\xff this is not a metrics page {{{ vllm:num_requests_running"


@dataclass(slots=True)
class PodFaults:
    """Pod-wide failures switched at runtime with `POST /sim/fail`."""

    health_status: int | None = None  # /health answers this instead of 200
    metrics: MetricsFault | None = None
    tokenize: TokenizeFault | None = None
    generation: FailureKind | None = None  # every generation request fails so
    delay_ms: int = 0  # every generation request starts this much later (a slow pod)
    kv_events: KvEventsFault | None = None

    def update(self, body: Mapping[str, Any]) -> None:
        """Apply a `/sim/fail` body: a key present sets its switch (null clears it).

        Raises ApiError(400) on an unknown key or value, changing nothing.
        """
        keys = {"health", "metrics", "tokenize", "generation", "delay_ms", "kv_events"}
        unknown = sorted(set(body) - keys)
        if unknown:
            raise ApiError(400, f"Unknown keys: {', '.join(unknown)}.")
        health = self.health_status
        if "health" in body:
            value = body["health"]
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 400 <= value <= 599
            ):
                raise ApiError(400, "'health' must be null or an HTTP error status (400-599).")
            health = value
        metrics = _switch(body, "metrics", MetricsFault, self.metrics)
        tokenize = _switch(body, "tokenize", TokenizeFault, self.tokenize)
        generation = _switch(body, "generation", FailureKind, self.generation)
        if generation is not None and generation not in GENERATION_FAULTS:
            raise ApiError(400, "'generation' must be null or one of 429, 500, 503, hang, drop.")
        delay_ms = self.delay_ms
        if "delay_ms" in body:
            value = body["delay_ms"] or 0
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value <= MAX_DELAY_MS
            ):
                raise ApiError(
                    400, f"'delay_ms' must be null or an integer in [0, {MAX_DELAY_MS}]."
                )
            delay_ms = value
        kv_events = _switch(body, "kv_events", KvEventsFault, self.kv_events)
        self.health_status, self.metrics, self.tokenize = health, metrics, tokenize
        self.generation, self.delay_ms, self.kv_events = generation, delay_ms, kv_events

    def state(self) -> dict[str, Any]:
        return {
            "health": self.health_status,
            "metrics": self.metrics,
            "tokenize": self.tokenize,
            "generation": self.generation,
            "delay_ms": self.delay_ms,
            "kv_events": self.kv_events,
        }


_Fault = TypeVar("_Fault", bound=StrEnum)


def _switch(
    body: Mapping[str, Any], key: str, kind: type[_Fault], now: _Fault | None
) -> _Fault | None:
    """The switch `key` after a `/sim/fail` body: its value, null (off), or as it was."""
    if key not in body:
        return now
    value = body[key]
    try:
        return None if value is None else kind(value)
    except ValueError:
        names = ", ".join(f"'{k.value}'" for k in kind)
        raise ApiError(400, f"'{key}' must be null or one of {names}.") from None


@dataclass(slots=True)
class FailureCounts:
    """How many failures were injected, by kind (for tests and logs)."""

    by_kind: dict[FailureKind, int] = field(default_factory=dict)

    def add(self, kind: FailureKind) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def total(self, kinds: Iterable[FailureKind] | None = None) -> int:
        if kinds is None:
            return sum(self.by_kind.values())
        return sum(self.by_kind.get(kind, 0) for kind in kinds)
