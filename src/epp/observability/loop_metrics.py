"""Histograms and counters written on the event loop only: no lock, a binary search.

prometheus_client guards every value with a mutex and finds a histogram's bucket with a
linear scan over its bounds: about 1.5 us an observation, and a routed request makes some
fifteen (the decision's own series and the reference EPP's twins). These subclasses keep
its API (`labels`, `observe`, `inc`) and its exposition (the same samples, labels and
`_created`), and change only the storage: plain floats, and the bucket found with
`bisect_left` over the upper bounds (the first bound >= the amount, the one the linear
scan stops at). tests/observability/test_loop_metrics.py holds them to prometheus_client's
own classes, page for page.

Invariant: every write to these, and every collection, happens on the event loop's
thread (the router's decisions and completions; /metrics collects on the loop, see
metrics.py), so the GIL orders them. A series written from another thread keeps
prometheus_client's classes. Exemplars are not supported.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client import metrics as _client_metrics
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


def _created_series() -> bool:
    # prometheus_client's switch (PROMETHEUS_DISABLE_CREATED_SERIES, disable_created_metrics)
    return bool(getattr(_client_metrics, "_use_created", True))


class LoopHistogram(Histogram):
    def _metric_init(self) -> None:
        self._created = time.time()
        self._counts = [0.0] * len(self._upper_bounds)
        self._total = 0.0
        self._labels_le = [floatToGoString(b) for b in self._upper_bounds]

    def observe(self, amount: float, exemplar: Any = None) -> None:
        try:
            counts = self._counts
        except AttributeError:  # a parent with label names: not observable
            self._raise_if_not_observable()
            raise
        if exemplar:
            raise TypeError("LoopHistogram does not keep exemplars")
        self._total += amount
        if amount == amount:  # a NaN falls in no bucket, as prometheus_client's scan
            counts[bisect_left(self._upper_bounds, amount)] += 1.0

    def _child_samples(self) -> Iterable[Sample]:
        samples = []
        acc = 0.0
        for le, count in zip(self._labels_le, self._counts, strict=True):
            acc += count
            samples.append(Sample("_bucket", {"le": le}, acc, None, None))
        samples.append(Sample("_count", {}, acc, None, None))
        if self._upper_bounds[0] >= 0:
            samples.append(Sample("_sum", {}, self._total, None, None))
        if _created_series():
            samples.append(Sample("_created", {}, self._created, None, None))
        return tuple(samples)


class _Value:
    """A counter's value (`get`, `set` and `inc`, as prometheus_client's values)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def get(self) -> float:
        return self.value

    def set(self, value: float) -> None:
        self.value = value

    def inc(self, amount: float) -> None:
        self.value += amount

    def get_exemplar(self) -> None:
        return None


class LoopCounter(Counter):
    def _metric_init(self) -> None:
        self._created = time.time()
        self._value = _Value()

    def inc(self, amount: float = 1, exemplar: Any = None) -> None:
        try:
            value = self._value
        except AttributeError:  # a parent with label names: not observable
            self._raise_if_not_observable()
            raise
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        if exemplar:
            raise TypeError("LoopCounter does not keep exemplars")
        value.value += amount
