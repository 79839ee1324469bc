"""The upstream series computed at scrape time: per pod (averages, spread, queues, ready
endpoints), per open request (running, in flight per endpoint), pool saturation and the
prefix index's size. Read from what the EPP watches, never updated per request."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datalayer.endpoint import Endpoint
from epp.observability.upstream_names import INFLIGHT_PRODUCER, PREFIX_PLUGIN, legacy

if TYPE_CHECKING:
    from epp.observability.upstream import RequestLabels, UpstreamMetrics

Key4 = tuple[str, str, str, str]


class UpstreamScrape(Collector):
    """Registered once per `UpstreamMetrics`; `watch` there sets the sources."""

    def __init__(self, upstream: UpstreamMetrics) -> None:
        self._upstream = upstream  # its pool and namespace labels (configure)
        self.endpoints: Callable[[], Iterable[Endpoint]] = tuple
        self.open_requests: Callable[[], Iterable[RequestLabels]] = tuple
        self.prefix_size: Callable[[], int] = lambda: 0
        self.max_queue = 1.0
        # Label tuples with a series: kept at 0 once idle while their pod is known.
        self.running_keys: set[Key4] = set()
        self.inflight_keys: set[Key4] = set()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # read at scrape time only

    def collect(self) -> Iterator[Metric]:
        endpoints = list(self.endpoints())
        pool = self._upstream.pool
        yield from self._pool_families(endpoints)
        saturation = [
            "inference_extension_flow_control_pool_saturation",
            "llm_d_epp_flow_control_pool_saturation",
        ]
        routable = [e for e in endpoints if not e.excluded]
        # The pool gates (requests wait) when its least loaded routable pod is at
        # scheduling.max_queue: 1.0 is that point; an empty pool reads 1.0 as upstream.
        value = min(e.queue_depth for e in routable) / self.max_queue if routable else 1.0
        for name, doc in zip(saturation, _SATURATION_DOCS, strict=True):
            family = GaugeMetricFamily(name, doc, labels=["inference_pool"])
            family.add_metric([pool], value)
            yield family
        yield from self._open_families()
        size = float(self.prefix_size())
        old = GaugeMetricFamily(
            "inference_extension_prefix_indexer_size",
            legacy("Entries in the prefix index.", "llm_d_epp_prefix_indexer_size"),
            value=size,
        )
        yield old
        new = GaugeMetricFamily(
            "llm_d_epp_prefix_indexer_size",
            "Entries in the prefix index.",
            labels=["plugin_name", "plugin_type"],
        )
        new.add_metric(list(PREFIX_PLUGIN), size)
        yield new

    def _pool_families(self, endpoints: list[Endpoint]) -> Iterator[Metric]:
        pool = self._upstream.pool
        pages = [e.metrics for e in endpoints]
        kv = [p.kv_usage if p else 0.0 for p in pages]
        queue = [p.waiting if p else 0.0 for p in pages]
        running = [p.running if p else 0.0 for p in pages]
        for stat, values in (("kv_cache_utilization", kv), ("queue_size", queue),
                             ("running_requests", running)):  # fmt: skip
            mean = sum(values) / len(values) if values else 0.0
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else 0.0
            doc = _POOL_DOCS[stat]
            for name, d, value in (
                (f"inference_pool_average_{stat}", legacy(doc, f"llm_d_epp_average_{stat}"), mean),
                (f"llm_d_epp_average_{stat}", doc, mean),
                (f"llm_d_epp_std_dev_{stat}", "Standard deviation of: " + doc, std),
            ):
                family = GaugeMetricFamily(name, d, labels=["name"])
                family.add_metric([pool], value)
                yield family
        ready_doc = "Endpoints of the pool the EPP knows (discovered ready)."
        for name, doc in (
            ("inference_pool_ready_pods", legacy(ready_doc, "llm_d_epp_ready_endpoints")),
            ("llm_d_epp_ready_endpoints", ready_doc),
        ):
            family = GaugeMetricFamily(name, doc, labels=["name"])
            family.add_metric([pool], float(len(endpoints)))
            yield family
        per_doc = "Requests waiting in each model server's queue (its own gauge)."
        old = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            per_doc,
            labels=["name", "model_server_pod"],
        )
        new = GaugeMetricFamily(
            "llm_d_epp_per_endpoint_queue_size",
            per_doc,
            labels=["name", "model_server_endpoint"],
        )
        for endpoint, waiting in zip(endpoints, queue, strict=True):
            old.add_metric([pool, endpoint.name], waiting)
            new.add_metric([pool, endpoint.name], waiting)
        yield old
        yield new

    def _count_open(self) -> tuple[dict[Key4, int], dict[Key4, list[int]]]:
        """Open requests per label tuple (running) and per (endpoint, namespace, fairness,
        priority): [requests, uncached tokens] (in flight)."""
        running: dict[Key4, int] = dict.fromkeys(self.running_keys, 0)
        inflight: dict[Key4, list[int]] = {k: [0, 0] for k in self.inflight_keys}
        for labels in self.open_requests():
            key4 = labels.key
            running[key4] = running.get(key4, 0) + 1
            key = (labels.endpoint, self._upstream.namespace, labels.fairness_id, labels.priority)
            counts = inflight.setdefault(key, [0, 0])
            counts[0] += 1
            counts[1] += labels.uncached_tokens
        # Series of pods still known stay at 0 once idle; a removed pod's go.
        known = {e.name for e in self.endpoints()}
        self.inflight_keys = {k for k in inflight if k[0] in known}
        self.running_keys = set(running)
        return running, inflight

    def _open_families(self) -> Iterator[Metric]:
        running, inflight = self._count_open()
        doc = "Requests routed and not yet ended."
        old = GaugeMetricFamily(
            "inference_objective_running_requests",
            legacy(doc, "llm_d_epp_request_running"),
            labels=["model_name"],
        )
        by_model: dict[str, int] = {}
        for key, n in running.items():
            by_model[key[0]] = by_model.get(key[0], 0) + n
        for model, n in sorted(by_model.items()):
            old.add_metric([model], float(n))
        yield old
        new = GaugeMetricFamily(
            "llm_d_epp_request_running",
            doc,
            labels=["model_name", "target_model_name", "fairness_id", "priority"],
        )
        for key, n in sorted(running.items()):
            new.add_metric(list(key), float(n))
        yield new
        labels_ = ["endpoint_name", "namespace", "producer_name", "fairness_id", "priority"]
        requests = GaugeMetricFamily(
            "llm_d_epp_inflight_requests",
            "Requests this EPP routed to each endpoint and not yet ended.",
            labels=labels_,
        )
        tokens = GaugeMetricFamily(
            "llm_d_epp_inflight_tokens",
            "Uncached prompt tokens of the requests in flight on each endpoint.",
            labels=labels_,
        )
        for key in sorted(self.inflight_keys):
            pod, namespace, fairness, priority = key
            n, t = inflight[key]
            row = [pod, namespace, INFLIGHT_PRODUCER, fairness, priority]
            requests.add_metric(row, float(n))
            tokens.add_metric(row, float(t))
        yield requests
        yield tokens


_POOL_DOCS = {
    "kv_cache_utilization": "KV-cache utilization of the pool's model servers (their gauge).",
    "queue_size": "Requests waiting in the pool's model servers' queues (their gauge).",
    "running_requests": "Requests running on the pool's model servers (their gauge).",
}
_SATURATION_DOCS = (
    legacy(
        "Pool saturation: the least loaded routable pod's queue over scheduling.max_queue"
        " (1.0: requests wait in the EPP); 1.0 for an empty pool.",
        "llm_d_epp_flow_control_pool_saturation",
    ),
    "Pool saturation: the least loaded routable pod's queue over scheduling.max_queue"
    " (1.0: requests wait in the EPP); 1.0 for an empty pool.",
)
