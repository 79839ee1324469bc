"""The EPP's Prometheus metrics (`epp_*`, plus per-pod gauges), on its own registry.

Per-request metrics are updated once per decision outside the scoring loop; per-pod
gauges are refreshed from the endpoint store when /metrics is scraped, not on the hot path.

A scrape is two steps (`render`): the collectors run on the routing loop, because they read
state only the loop writes (the endpoint store, the index, the subscribers, the KV-event
counts: dicts the loop may resize, which another thread must not iterate); the text
encoding of what they returned, about three quarters of a scrape's CPU at 1,000 pods,
runs in a worker thread, where it reads only those immutable snapshots
(docs/benchmarks/loop.md).

Labels that come from client input (`model`, `adapter`) are bounded (labels.py): values
the configuration or the pods know, plus at most `client_label_limit` others, then
`"other"`. `model_label` / `adapter_label` give the bounded value; `decisions` and
`adapter_loads` apply it themselves, whatever the caller passes.
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import structlog
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import epp
from epp.datalayer.endpoint import Endpoint
from epp.observability.answers import Answers
from epp.observability.background import BackgroundErrors
from epp.observability.discovery import DiscoveryCollector
from epp.observability.kv_events import KvEventsCollector
from epp.observability.labels import DEFAULT_LIMIT, BoundedLabel, BoundedMetric
from epp.observability.logs import trace, trace_enabled
from epp.observability.loop_lag import LoopLagMonitor
from epp.observability.loop_metrics import LoopCounter, LoopHistogram
from epp.observability.stale import StaleCacheTracker
from epp.observability.tasks import register_task_gauge
from epp.observability.upstream import UpstreamMetrics

if TYPE_CHECKING:
    from epp.datalayer.discovery.state import DiscoveryState
    from epp.datalayer.kv_subscriber import KvEventSubscriber
    from epp.datalayer.store import FloorStats
    from epp.prefix.kv_events import KvEventStats

log = structlog.get_logger("epp.datalayer")

RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
# 1000 and 5000: the spec's p99 target and alert threshold (deploy/prometheus) are bucket edges.
LATENCY_US_BUCKETS = (25, 50, 100, 200, 400, 800, 1000, 1600, 3200, 5000, 6400, 12800, 51200)


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
            "epp_pod_excluded": (
                "1 while health keeps the pod out of routing (below the threshold, with"
                " hysteresis).",
                lambda e: 1.0 if e.excluded else 0.0,
            ),
            "epp_pod_exclusion_capped": (
                "1 while the pod's 5xx answers would exclude it but the floor keeps it"
                " routable (scheduling.max_error_exclusion_share of its model are out).",
                lambda e: 1.0 if e.unhealthy and not e.excluded else 0.0,
            ),
            "epp_pod_health_panic": (
                "1 while the pod's model is in panic: too few routable pods, so all are routed to.",
                lambda e: 1.0 if e.panic else 0.0,
            ),
        }
        endpoints = list(self._endpoints())
        for name, (doc, value) in families.items():
            family = GaugeMetricFamily(name, doc, labels=["pod"])
            for endpoint in endpoints:
                family.add_metric([endpoint.name], float(value(endpoint)))
            yield family
        yield GaugeMetricFamily("epp_pods", "Endpoints known (discovered).", value=len(endpoints))
        yield GaugeMetricFamily(
            "epp_healthy_pods",
            "Endpoints health does not exclude (0: every request gets 503).",
            value=sum(1 for e in endpoints if not e.excluded),
        )


class CollectedFamilies(Collector):
    """Families already collected: encoding them reads nothing the loop writes."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)

    def encode(self) -> bytes:
        """The Prometheus text exposition of these families."""
        return generate_latest(self)


class _FloorCollector(Collector):
    """The floor under exclusion's counts (EndpointStore.floor_stats), read at scrape time."""

    def __init__(self, stats: FloorStats):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "epp_health_panics",
            "Times a model entered panic (no routable pod, or fewer than"
            " scheduling.healthy_panic_share): its pods were all routed to.",
            value=self._stats.panics,
        )
        yield CounterMetricFamily(
            "epp_health_panic_requests",
            "Requests routed to a model in panic, excluded pods included.",
            value=self._stats.panic_requests,
        )


def _trace_report(endpoint: Endpoint) -> None:
    page = endpoint.metrics
    trace(
        log,
        "pod_report",
        pod=endpoint.name,
        failures=endpoint.consecutive_failures,
        error=endpoint.last_error,
        waiting=page.waiting if page else None,
        running=page.running if page else None,
        kv_usage=page.kv_usage if page else None,
        prefix_hits=page.prefix_hits if page else None,
        queue_depth=endpoint.queue_depth,
        in_flight=endpoint.in_flight,
        health=round(endpoint.health, 4),
        excluded=endpoint.excluded,
    )


def scrape_failure_reason(error: str | None) -> str:
    """The `reason` of epp_scrape_failures_total for an endpoint's `last_error`."""
    if not error:
        return "other"
    if error.startswith("internal:"):
        return "internal"
    kind, _, detail = error.partition(":")
    if kind in ("TimeoutError", "ServerTimeoutError", "ConnectionTimeoutError"):
        return "timeout"
    if kind == "MetricsFormatError":
        detail = detail.strip()
        if detail.startswith("HTTP "):
            return "http-status"
        if detail.startswith("metrics page larger"):
            return "too-large"
        return "bad-page"
    if "Connect" in kind or "Disconnected" in kind or kind.endswith(("OSError", "Refused")):
        return "connection"
    return "other"


class EppMetrics:
    def __init__(self, client_label_limit: int = DEFAULT_LIMIT) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._endpoints: Callable[[], Iterable[Endpoint]] = tuple
        self.models = BoundedLabel(client_label_limit, known=self._pod_models)
        self.adapters = BoundedLabel(client_label_limit, known=self._pod_adapters)
        self.decisions = BoundedMetric(
            LoopCounter(
                "epp_routing_decisions_total",
                "Requests handled, by model (bounded: unknown models beyond a limit are"
                " 'other') and result.",
                ["model", "result"],
                registry=r,
            ),
            model=self.models,
        )
        self.cache_match = LoopHistogram(
            "epp_cache_match_ratio",
            "Cache match ratio of the chosen pod.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.best_possible_match = LoopHistogram(
            "epp_best_cache_match_ratio",
            "Best cache match among all known pods: tells 'no reuse possible' from 'reuse lost'.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.composite = LoopHistogram(
            "epp_composite_score",
            "Composite score of the chosen pod.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.latency_us = LoopHistogram(
            "epp_scoring_latency_us",
            "Parse + hash + lookup + score + pick, in microseconds.",
            buckets=LATENCY_US_BUCKETS,
            registry=r,
        )
        self.candidates = LoopHistogram(
            "epp_candidate_pods",
            "Pods left after filtering.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.adapter_loads = BoundedMetric(
            LoopCounter(
                "epp_adapter_loads_triggered_total",
                "Requests sent to a pod without their LoRA adapter loaded (adapter bounded"
                " like model).",
                ["adapter"],
                registry=r,
            ),
            adapter=self.adapters,
        )
        self.fallback_served = LoopCounter(
            "epp_fallback_served_total",
            "Requests a fallback endpoint served (primary failed).",
            registry=r,
        )
        self.prefix_nodes = Gauge(
            "epp_prefix_tree_nodes", "Distinct prefixes in the index.", registry=r
        )
        self.streams_failed = LoopCounter(
            "epp_stream_errors_total",
            "ext_proc streams that ended in an internal error.",
            registry=r,
        )

        self.scrape_failures = LoopCounter(
            "epp_scrape_failures_total",
            "Failed scrapes of pod metrics pages, by reason: timeout, connection,"
            " http-status, bad-page, too-large, internal, other.",
            ["reason"],
            registry=r,
        )
        self.max_queue = Gauge(
            "epp_max_queue",
            "scheduling.max_queue: the queue depth at which a pod is saturated.",
            registry=r,
        )
        self.health_threshold = Gauge(
            "epp_health_exclusion_threshold",
            "scheduling.health_threshold: pods whose health falls below are excluded.",
            registry=r,
        )
        self.build_info = Gauge(
            "epp_build_info",
            "The EPP's version and Python (value 1).",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(epp.__version__, platform.python_version()).set(1)
        # Answers the EPP gives itself (counted and logged by the ext_proc server).
        self.answers = Answers(r)
        self.stale = StaleCacheTracker(r)
        # The reference EPP's series (llm_d_epp_*, inference_*), what upstream dashboards read.
        self.upstream = UpstreamMetrics(r, self.models, client_label_limit)

        # Sampling starts with `loop_lag.start()` on the running loop (EppService.start).
        self.loop_lag = LoopLagMonitor(r)
        # Exceptions in background work (maintenance loop, queue release passes), survived.
        self.background = BackgroundErrors(r)
        # Tasks alive on the loop: flat under steady load, or something leaks (epp bench soak).
        self.asyncio_tasks = register_task_gauge(r)

    def set_limits(self, *, max_queue: int, health_threshold: float) -> None:
        """The configured limits the alert rules compare with (deploy/prometheus)."""
        self.max_queue.set(max_queue)
        self.health_threshold.set(health_threshold)
        self.upstream.watch(max_queue=max_queue)

    def watch_floor(self, stats: FloorStats) -> None:
        """Export the floor under health exclusion (EndpointStore.floor_stats)."""
        self.registry.register(_FloorCollector(stats))

    def watch_discovery(self, state: Callable[[], DiscoveryState | None]) -> None:
        """Export discovery's state (`EppService.discovery`), read at each scrape."""
        self.registry.register(DiscoveryCollector(state))

    def watch_kv_events(
        self,
        stats: KvEventStats,
        subscribers: Callable[[], Mapping[str, KvEventSubscriber]],
        predictions_capped: Callable[[], int] = lambda: 0,
    ) -> None:
        """Export precise mode's counts and subscriber states, read at each scrape."""
        self.registry.register(KvEventsCollector(stats, subscribers, predictions_capped))

    def on_endpoint_change(self, event: str, endpoint: Endpoint) -> None:
        """An endpoint store event (the router forwards them): count failed scrapes, check
        predicted cache hits against a new page, start a restarted pod's check afresh,
        forget a removed pod."""
        if event == "updated":
            if endpoint.consecutive_failures:
                # The store emits one `updated` per failed scrape, with the count raised.
                reason = scrape_failure_reason(endpoint.last_error)
                self.scrape_failures.labels(reason).inc()
            else:
                self.stale.scraped(endpoint)
            if trace_enabled():  # every page of every pod: TRACE only
                _trace_report(endpoint)
        elif event == "reset":
            self.stale.restarted(endpoint)  # the pod's server restarted (the store saw it)
        elif event == "removed":
            self.stale.removed(endpoint)

    def watch(
        self, endpoints: Callable[[], Iterable[Endpoint]], index_blocks: Callable[[str], int]
    ) -> None:
        self._endpoints = endpoints
        self.registry.register(_PodCollector(endpoints, index_blocks))
        self.upstream.watch(endpoints=endpoints)

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
        """The whole page, collected and encoded on the calling thread."""
        return generate_latest(self.registry)

    def collect_now(self) -> CollectedFamilies:
        """Every family's samples as of now. Call on the loop: the collectors iterate state
        the loop owns and resizes."""
        return CollectedFamilies(list(self.registry.collect()))

    async def render(self) -> bytes:
        """The page for /metrics: collected on the loop, encoded in a worker thread."""
        return await asyncio.to_thread(self.collect_now().encode)
