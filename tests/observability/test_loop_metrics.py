"""LoopHistogram and LoopCounter (epp/observability/loop_metrics.py) against
prometheus_client's own Histogram and Counter: the same observations give the same page,
sample for sample, in the text and the OpenMetrics formats."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from epp.observability.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = [
    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    (1, 8, 64, 512, 4096, 32768),
    (-5.0, 0.0, 5.0),  # a negative first bound: no _sum sample
    (0.5,),
    (0.0, 1.0),  # a first bound of 0: a _sum sample (the rule is >= 0)
]


def amounts(rng: random.Random, bounds: tuple[float, ...]) -> list[float]:
    out = [*bounds, *(math.nextafter(b, math.inf) for b in bounds)]  # on and past each bound
    out += [rng.uniform(-10, bounds[-1] * 2) for _ in range(200)]
    out += [0.0, -0.0, math.inf, -math.inf, math.nan, 1e300, int(bounds[-1])]
    rng.shuffle(out)
    return out


def pages(fill) -> tuple[str, str]:
    """The same observations into prometheus_client's classes and ours: both pages, with
    the creation times (the only thing that may differ) set equal."""
    out = []
    for histogram, counter in ((Histogram, Counter), (LoopHistogram, LoopCounter)):
        registry = CollectorRegistry()
        fill(registry, histogram, counter)
        for collector in list(registry._collector_to_names):
            for metric in [collector, *getattr(collector, "_metrics", {}).values()]:
                metric._created = 1.0
        out.append((generate_latest(registry).decode(), generate_openmetrics(registry).decode()))
    return out[0], out[1]


@pytest.mark.parametrize("bounds", BUCKETS)
def test_a_histogram_page_is_prometheus_clients(bounds):
    rng = random.Random(len(bounds))
    values = amounts(rng, bounds)

    def fill(registry, histogram, counter):
        plain = histogram("h_plain", "plain", buckets=bounds, registry=registry)
        labelled = histogram("h_labelled", "by model", ["model"], buckets=bounds, registry=registry)
        for v in values:
            plain.observe(v)
            labelled.labels(rng.choice(["a", "b"])).observe(v)

    rng_state = rng.getstate()
    theirs = pages(lambda *a: (rng.setstate(rng_state), fill(*a)))
    assert theirs[0] == theirs[1]
    assert 'h_plain_bucket{le="+Inf"}' in theirs[1][0]


def test_a_counter_page_is_prometheus_clients():
    def fill(registry, histogram, counter):
        plain = counter("c_plain", "plain", registry=registry)
        labelled = counter("c_labelled_total", "by code", ["code"], registry=registry)
        for i in range(50):
            plain.inc()
            plain.inc(0.25)
            labelled.labels(str(i % 3)).inc(i)
        labelled.labels("reset").inc(7)
        labelled.labels("reset").reset()

    theirs, ours = pages(fill)
    assert theirs == ours
    assert "c_plain_total 62.5" in ours[0]


def refusal(call) -> tuple[type, str]:
    with pytest.raises(Exception) as caught:
        call()
    return type(caught.value), str(caught.value)


def test_misuse_is_refused_as_prometheus_client_refuses_it():
    made = {}
    for histogram, counter in ((Histogram, Counter), (LoopHistogram, LoopCounter)):
        registry = CollectorRegistry()
        made[histogram] = (
            histogram("h", "h", ["model"], registry=registry),
            counter("c", "c", ["code"], registry=registry),
        )
    (h_theirs, c_theirs), (h_ours, c_ours) = made[Histogram], made[LoopHistogram]
    assert refusal(lambda: h_ours.observe(1.0)) == refusal(lambda: h_theirs.observe(1.0))
    assert refusal(lambda: c_ours.inc()) == refusal(lambda: c_theirs.inc())
    negative = refusal(lambda: c_ours.labels("x").inc(-1))
    assert negative == refusal(lambda: c_theirs.labels("x").inc(-1))
    with pytest.raises(TypeError, match="exemplars"):
        h_ours.labels("m").observe(1.0, {"trace_id": "1"})
    with pytest.raises(TypeError, match="exemplars"):
        c_ours.labels("m").inc(1.0, {"trace_id": "1"})
    # A child's value as prometheus_client's (tests read it this way).
    child = c_ours.labels("y")
    child.inc(3)
    assert child._value.get() == 3.0


def test_the_created_series_follow_prometheus_clients_switch():
    """disable_created_metrics() (or PROMETHEUS_DISABLE_CREATED_SERIES) drops _created
    from prometheus_client's pages: from ours too, and enabling brings it back."""

    def fill(registry, histogram, counter):
        histogram("h", "h", buckets=(1.0,), registry=registry).observe(0.5)
        counter("c", "c", registry=registry).inc()

    was_on = prometheus_metrics._use_created
    try:
        disable_created_metrics()
        theirs, ours = pages(fill)
        assert theirs == ours
        assert "_created" not in ours[0] + ours[1]
        enable_created_metrics()
        theirs, ours = pages(fill)
        assert theirs == ours
        assert "h_created" in ours[0] and "c_created" in ours[0]
    finally:
        (enable_created_metrics if was_on else disable_created_metrics)()
