"""The EPP's Prometheus metrics (`epp_*`, plus per-pod gauges), on its own registry.

Per-request metrics are updated once per decision outside the scoring loop; per-pod
gauges are refreshed from the endpoint store when /metrics is scraped, not on the hot path.

Labels that come from client input (`model`, `adapter`) are bounded (labels.py): values
the configuration or the pods know, plus at most `client_label_limit` others, then
`"other"`. `model_label` / `adapter_label` give the bounded value; `decisions` and
`adapter_loads` apply it themselves, whatever the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datalayer.endpoint import Endpoint
from epp.observability.labels import DEFAULT_LIMIT, BoundedLabel, BoundedMetric
from epp.observability.loop_lag import LoopLagMonitor

RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
LATENCY_US_BUCKETS = (25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 51200)


class _PodCollector(Collector):
    """Per-pod gauges read from the store at scrape time."""

    def __init__(
        self, endpoints: Callable[[], Iterable[Endpoint]], index_blocks: Callable[[str], int]
    ):
        self._endpoints = endpoints
        self._index_blocks = index_blocks

    def collect(self) -> Iterator[Metric]:
        families = {
            "epp_queue_depth": (
                "Waiting requests per pod (scraped + sent since).",
                lambda e: e.queue_depth,
            ),
            "epp_pod_health_score": (
                "Continuous health in [0,1]; < 0.3 is excluded.",
                lambda e: e.health,
            ),
            "epp_pod_kv_cache_usage": ("KV-cache usage reported by the pod.", lambda e: e.kv_usage),
            "epp_pod_in_flight_requests": (
                "Requests routed to the pod, not completed.",
                lambda e: e.in_flight,
            ),
            "epp_pod_scrape_failures": (
                "Consecutive failed metric scrapes.",
                lambda e: e.consecutive_failures,
            ),
            "epp_pod_prefix_blocks": (
                "Blocks the prefix index holds for the pod.",
                lambda e: self._index_blocks(e.name),
            ),
        }
        endpoints = list(self._endpoints())
        for name, (doc, value) in families.items():
            family = GaugeMetricFamily(name, doc, labels=["pod"])
            for endpoint in endpoints:
                family.add_metric([endpoint.name], float(value(endpoint)))
            yield family


class EppMetrics:
    def __init__(self, client_label_limit: int = DEFAULT_LIMIT) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._endpoints: Callable[[], Iterable[Endpoint]] = tuple
        self.models = BoundedLabel(client_label_limit, known=self._pod_models)
        self.adapters = BoundedLabel(client_label_limit, known=self._pod_adapters)
        self.decisions = BoundedMetric(
            Counter(
                "epp_routing_decisions_total",
                "Requests handled, by model (bounded: unknown models beyond a limit are"
                " 'other') and result.",
                ["model", "result"],
                registry=r,
            ),
            model=self.models,
        )
        self.cache_match = Histogram(
            "epp_cache_match_ratio",
            "Cache match ratio of the chosen pod.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.best_possible_match = Histogram(
            "epp_best_cache_match_ratio",
            "Best cache match among all known pods: tells 'no reuse possible' from 'reuse lost'.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.composite = Histogram(
            "epp_composite_score",
            "Composite score of the chosen pod.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.latency_us = Histogram(
            "epp_scoring_latency_us",
            "Parse + hash + lookup + score + pick, in microseconds.",
            buckets=LATENCY_US_BUCKETS,
            registry=r,
        )
        self.candidates = Histogram(
            "epp_candidate_pods",
            "Pods left after filtering.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.adapter_loads = BoundedMetric(
            Counter(
                "epp_adapter_loads_triggered_total",
                "Requests sent to a pod without their LoRA adapter loaded (adapter bounded"
                " like model).",
                ["adapter"],
                registry=r,
            ),
            adapter=self.adapters,
        )
        self.fallback_served = Counter(
            "epp_fallback_served_total",
            "Requests a fallback endpoint served (primary failed).",
            registry=r,
        )
        self.prefix_nodes = Gauge(
            "epp_prefix_tree_nodes", "Distinct prefixes in the index.", registry=r
        )
        self.streams_failed = Counter(
            "epp_stream_errors_total",
            "ext_proc streams that ended in an internal error.",
            registry=r,
        )

        # Sampling starts with `loop_lag.start()` on the running loop (EppService.start).
        self.loop_lag = LoopLagMonitor(r)

    def watch(
        self, endpoints: Callable[[], Iterable[Endpoint]], index_blocks: Callable[[str], int]
    ) -> None:
        self._endpoints = endpoints
        self.registry.register(_PodCollector(endpoints, index_blocks))

    def model_label(self, model: str | None) -> str:
        """The `model` label value for a client's model name (bounded)."""
        return self.models(model)

    def adapter_label(self, adapter: str | None) -> str:
        """The `adapter` label value for a client's adapter name (bounded)."""
        return self.adapters(adapter)

    def allow_labels(
        self, *, models: Iterable[str | None] = (), adapters: Iterable[str | None] = ()
    ) -> None:
        """Names known from configuration (e.g. `config.adapters` and endpoint models):
        each keeps its own series and takes none of the slots for unknown names."""
        self.models.allow(models)
        self.adapters.allow(adapters)

    def _pod_models(self) -> Iterable[str | None]:
        return [e.model for e in self._endpoints()]

    def _pod_adapters(self) -> Iterable[str]:
        return [a for e in self._endpoints() for a in e.adapters]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
