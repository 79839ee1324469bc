"""The engine's side of a scrape: a real prometheus_client registry holding vLLM's families,
rendered as vLLM's /metrics renders it.

vLLM mounts `prometheus_client.make_asgi_app(registry)` at /metrics
(vllm/entrypoints/serve/instrumentator/metrics.py); per request that app calls
`exposition._bake_output(registry, accept, accept_encoding, params, False)`: it collects
the registry (or, with `?name[]=` parameters, `registry.restricted_registry(names)`:
only the collectors of those names, only those samples), encodes the text format, and
gzips it when the client's Accept-Encoding names gzip. `render` calls exactly that.

The registry is built from a real page (tests/fixtures/vllm-0.33-metrics.txt): each family
a real Gauge / Counter / Histogram of the page's name, labels and buckets, set to the
page's values, so collecting and rendering it costs what vLLM's own registry costs.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import _bake_output
from prometheus_client.parser import text_string_to_metric_families


def vllm_registry(page: str) -> CollectorRegistry:
    """A registry of real metric objects holding the families and values of `page`, with
    the process, platform and GC collectors that prometheus_client's default registry
    (vLLM's, outside multiprocess mode) holds."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    for family in text_string_to_metric_families(page):
        if family.name.endswith("_created"):
            continue  # prometheus_client writes these itself for counters and histograms
        if family.type == "gauge":
            _gauge(registry, family)
        elif family.type == "counter":
            _counter(registry, family)
        elif family.type == "histogram":
            _histogram(registry, family)
    return registry


def _label_names(samples: list, drop: tuple[str, ...] = ()) -> list[str]:
    names: list[str] = []
    for sample in samples:
        for key in sample.labels:
            if key not in names and key not in drop:
                names.append(key)
    return names


def _gauge(registry: CollectorRegistry, family) -> None:  # type: ignore[no-untyped-def]
    names = _label_names(family.samples)
    gauge = Gauge(family.name, family.documentation, names, registry=registry)
    for sample in family.samples:
        (gauge.labels(**sample.labels) if names else gauge).set(sample.value)


def _counter(registry: CollectorRegistry, family) -> None:  # type: ignore[no-untyped-def]
    totals = [s for s in family.samples if s.name.endswith("_total")]
    names = _label_names(totals)
    counter = Counter(family.name, family.documentation, names, registry=registry)
    for sample in totals:
        (counter.labels(**sample.labels) if names else counter).inc(sample.value)


def _histogram(registry: CollectorRegistry, family) -> None:  # type: ignore[no-untyped-def]
    buckets = [s for s in family.samples if s.name.endswith("_bucket")]
    names = _label_names(buckets, drop=("le",))
    bounds = sorted({float(s.labels["le"]) for s in buckets})
    histogram = Histogram(
        family.name, family.documentation, names, registry=registry, buckets=bounds
    )
    series: dict[tuple[str, ...], dict[str, float]] = {}
    sums: dict[tuple[str, ...], float] = {}
    for sample in family.samples:
        key = tuple(sample.labels.get(n, "") for n in names)
        if sample.name.endswith("_bucket"):
            series.setdefault(key, {})[sample.labels["le"]] = sample.value
        elif sample.name.endswith("_sum"):
            sums[key] = sample.value
    for key, cumulative in series.items():
        child = histogram.labels(*key) if names else histogram
        previous = 0.0
        # Set the histogram's own per-bucket counters (the page shows them cumulated).
        for i, bound in enumerate(bounds):
            text = next(le for le in cumulative if float(le) == bound)
            child._buckets[i].set(cumulative[text] - previous)
            previous = cumulative[text]
        child._sum.set(sums.get(key, 0.0))


def render(registry: CollectorRegistry, url: str = "/metrics", accept_encoding: str = "") -> bytes:
    """What vLLM's /metrics answers a GET of `url` (its query: `name[]` filters) with this
    Accept-Encoding: the body (gzipped if gzip is accepted)."""
    params = parse_qs(urlsplit(url).query)
    _status, _headers, body = _bake_output(registry, "*/*", accept_encoding, params, False)
    return bytes(body)
