"""Metric label values that come from client input, bounded.

A label value is a time series for as long as the process lives. Values a client chooses
(the `model` of a request, the LoRA adapter it names) must not create series at will:
10,000 distinct model names once made 10,000 series, a 6 MB /metrics page, and scrapes
that blocked routing for 0.4 s each.

`BoundedLabel` admits, each with its own series:
- values known from configuration (`allow`) or reported by the pods (`known`, re-read at
  most once per `refresh_s` and only when a value is not yet admitted);
- at most `limit` other values, first come first served;
and maps everything else to `"other"`. A value longer than `max_length` characters, or one
that is not valid Unicode (an unpaired surrogate cannot be written to the page), is never
admitted unless known.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

OTHER = "other"
DEFAULT_LIMIT = 100
DEFAULT_MAX_LENGTH = 128


class BoundedLabel:
    def __init__(
        self,
        limit: int = DEFAULT_LIMIT,
        *,
        known: Callable[[], Iterable[str | None]] | None = None,
        max_length: int = DEFAULT_MAX_LENGTH,
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self.limit = limit
        self.max_length = max_length
        self._known_source = known
        self._refresh_s = refresh_s
        self._clock = clock
        self._known_at = -float("inf")
        self._known: frozenset[str] = frozenset()
        self._allowed: set[str] = set()
        self._admitted: set[str] = {"", OTHER}
        self._first_come = 0

    @property
    def first_come(self) -> int:
        """How many of the `limit` slots for unknown values are taken."""
        return self._first_come

    def allow(self, values: Iterable[str | None]) -> None:
        """Values known from configuration: always admitted, never counted in `limit`."""
        for value in values:
            if value:
                self._allowed.add(value)
                self._admitted.add(value)

    def __call__(self, value: str | None) -> str:
        if value is None:
            return ""
        if value in self._admitted:
            return value
        if value in self._allowed or value in self._known_values():
            self._admitted.add(value)
            return value
        if self._first_come < self.limit and self._admissible(value):
            self._first_come += 1
            self._admitted.add(value)
            return value
        return OTHER

    def _admissible(self, value: str) -> bool:
        if len(value) > self.max_length:
            return False
        if value.isascii():
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True

    def _known_values(self) -> frozenset[str]:
        if self._known_source is None:
            return self._known
        now = self._clock()
        if now - self._known_at >= self._refresh_s:
            self._known_at = now
            self._known = frozenset(v for v in self._known_source() if v)
        return self._known


class BoundedMetric:
    """A labelled prometheus_client metric whose client-controlled labels are bounded.

    `labels(...)` maps each bounded label's value through its `BoundedLabel` first, by
    position or by name; everything else is the wrapped metric's own API.
    """

    def __init__(self, metric: Any, **bounds: BoundedLabel) -> None:
        self._metric = metric
        names = list(metric._labelnames)
        unknown = set(bounds) - set(names)
        if unknown:
            raise ValueError(f"no such labels: {', '.join(sorted(unknown))}")
        self._by_position = [(names.index(name), bound) for name, bound in bounds.items()]
        self._by_name = bounds

    def labels(self, *values: Any, **named: Any) -> Any:
        if values:
            mapped = list(values)
            for position, bound in self._by_position:
                if position < len(mapped):
                    mapped[position] = bound(mapped[position])
            return self._metric.labels(*mapped)
        for name, bound in self._by_name.items():
            if name in named:
                named[name] = bound(named[name])
        return self._metric.labels(**named)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metric, name)
