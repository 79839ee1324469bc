"""The reference EPP's series, beside ours: what the upstream dashboards and alerts query.

The llm-d router (v0.10.0, the reference EPP) exports `llm_d_epp_*` and, for each series
that had one, its deprecated twin under GIE's names (`inference_objective_*`,
`inference_pool_*`, `inference_extension_*`), which GIE's dashboard and alert rules
(tools/dashboards, tools/alerts) query. This module exports both, with the reference's
names, label names and buckets (pkg/epp/metrics/metrics.go, llm_d_router_metrics.go),
recorded from the EPP's own events; docs/metrics.md ("Upstream-compatible series") says
which `epp_*` series each mirrors and where the meaning differs.

Label values from client input are bounded (labels.py): `model_name` and
`target_model_name` share the bound of our `model` label; `fairness_id` (a request
header) has its own. Every other label value comes from the configuration or the pods.

Per-request work is a few child-metric updates on cached children (one `_Series` per
label tuple); per-pod and per-open-request series are computed at scrape time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import epp
from epp.addresses import AddressError, parse_host_port
from epp.datalayer.endpoint import Endpoint
from epp.observability.labels import BoundedLabel

# -- buckets: the reference's, value for value ------------------------------------------
GENERAL_LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
    8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200,
    1800, 2700, 3600,
)  # fmt: skip
REQUEST_SIZE_BUCKETS = (
    64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
    131072, 262144, 524288, 1048576, 2097152, 4194304, 8388608,
    16777216, 33554432, 67108864, 134217728, 268435456, 536870912, 1073741824,
)  # fmt: skip
RESPONSE_SIZE_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
)  # fmt: skip
INPUT_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
    131072, 262144, 524288, 1048576,
)  # fmt: skip
TTFT_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
    8, 10, 15, 20, 30, 45, 60, 120,
)  # fmt: skip
SHORT_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
QUEUE_DURATION_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)  # fmt: skip
HIT_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

# The reference's request headers naming the fairness flow (new name, then the GIE one),
# and the flow of requests that name none.
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
DEFAULT_FAIRNESS_ID = "default-flow"
# The reference's plugin that feeds the prefix-indexer and in-flight series: ours are
# the EPP's own prefix index and load accounting, named so here.
PREFIX_PLUGIN = ("prefix-index", "prefix-cache-scorer")
INFLIGHT_PRODUCER = "epp"
STATIC_POOL = "static"
_TAG = "upstream_labels"

# error_code values (the reference's pkg/common/error): by the HTTP status the EPP answered
# with, and ModelServerError for a pod's answer other than 200 (the reference's rule).
ERROR_CODES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    412: "PreconditionFailed",
    413: "BadRequest",
    429: "ResourceExhausted",
    500: "Internal",
    503: "ServiceUnavailable",
}
MODEL_SERVER_ERROR = "ModelServerError"
UNKNOWN_ERROR = "Unknown"

# Flow-control outcomes, the reference's names (flowcontrol/types QueueOutcome).
DISPATCHED = "Dispatched"
NOT_YET_FINALIZED = "NotYetFinalized"
REJECTED_CAPACITY = "RejectedCapacity"
REJECTED_OTHER = "RejectedOther"
EVICTED_TTL = "EvictedTTL"
EVICTED_CANCELLED = "EvictedContextCancelled"


def error_code(status: int) -> str:
    """The reference's error_code for an answer the EPP gave itself with this status."""
    return ERROR_CODES.get(status, UNKNOWN_ERROR)


@dataclass(slots=True)
class RequestLabels:
    """One request's upstream labels (bounded) and what its end needs to know."""

    model_name: str
    target_model_name: str
    fairness_id: str
    priority: str
    received: float  # time.perf_counter() when the EPP got the request
    streaming: bool
    series: _Series | None = None  # once routed
    endpoint: str = ""  # the chosen pod, once routed
    uncached_tokens: int = 0

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.model_name, self.target_model_name, self.fairness_id, self.priority)


class _Series:
    """The child metrics of one (model, target, fairness, priority) of routed requests:
    looked up once, created when the first request of the tuple is routed (a refused
    request makes no series of these)."""

    __slots__ = (
        "duration", "duration_old", "input_tokens", "input_tokens_old",
        "key", "request_size", "request_size_old", "requests", "requests_old",
        "response_size", "response_size_old", "ttft",
    )  # fmt: skip

    def __init__(self, m: UpstreamMetrics, key: tuple[str, str, str, str]) -> None:
        model, target, fairness, priority = key
        self.key = key
        self.requests_old = m.requests_old.labels(model, target, priority)
        self.requests = m.requests.labels(model, target, fairness, priority)
        self.duration_old = m.duration_old.labels(model, target)
        self.duration = m.duration.labels(*key)
        self.request_size_old = m.request_size_old.labels(model, target)
        self.request_size = m.request_size.labels(*key)
        self.response_size_old = m.response_size_old.labels(model, target)
        self.response_size = m.response_size.labels(*key)
        self.input_tokens_old = m.input_tokens_old.labels(model, target)
        self.input_tokens = m.input_tokens.labels(*key)
        self.ttft: dict[bool, Any] = {}


def _legacy(doc: str, current: str) -> str:
    return f"[Deprecated: Use {current}] {doc}"


class UpstreamMetrics:
    def __init__(self, registry: CollectorRegistry, models: BoundedLabel, limit: int) -> None:
        r = registry
        self.models = models
        self.fairness = BoundedLabel(limit)
        self.pool = STATIC_POOL
        self.namespace = ""
        self.flow_enabled = True
        self._series: dict[tuple[str, str, str, str], _Series] = {}
        self._errors: dict[tuple[tuple[str, str, str, str], str], tuple[Any, Any]] = {}
        self._running_keys: set[tuple[str, str, str, str]] = set()
        self._inflight_keys: set[tuple[str, str, str, str]] = set()
        self._endpoints: Callable[[], Iterable[Endpoint]] = tuple
        self._open: Callable[[], Iterable[RequestLabels]] = tuple
        self._prefix_size: Callable[[], int] = lambda: 0
        self._max_queue = 1.0

        model4 = ["model_name", "target_model_name", "fairness_id", "priority"]
        model2 = ["model_name", "target_model_name"]

        def pair(kind: Any, old: str, new: str, doc: str, old_labels: list[str],
                 new_labels: list[str], **kw: Any) -> tuple[Any, Any]:  # fmt: skip
            return (
                kind(old, _legacy(doc, new), old_labels, registry=r, **kw),
                kind(new, doc, new_labels, registry=r, **kw),
            )

        # -- requests ------------------------------------------------------------------
        self.requests_old, self.requests = pair(
            Counter, "inference_objective_request_total", "llm_d_epp_request_total",
            "Requests the EPP routed to a model server.",
            [*model2, "priority"], model4,
        )  # fmt: skip
        self.errors_old, self.errors = pair(
            Counter, "inference_objective_request_error_total", "llm_d_epp_request_error_total",
            "Failed requests, by error_code: the EPP's own answers and model-server answers"
            " other than 200.",
            [*model2, "error_code"], [*model4, "error_code"],
        )  # fmt: skip
        self.duration_old, self.duration = pair(
            Histogram, "inference_objective_request_duration_seconds",
            "llm_d_epp_request_duration_seconds",
            "End-to-end request latency in seconds: the EPP receiving the request to the"
            " response's end.",
            model2, model4, buckets=GENERAL_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_size_old, self.request_size = pair(
            Histogram, "inference_objective_request_sizes", "llm_d_epp_request_size_bytes",
            "Request body size in bytes.", model2, model4, buckets=REQUEST_SIZE_BUCKETS,
        )  # fmt: skip
        self.response_size_old, self.response_size = pair(
            Histogram, "inference_objective_response_sizes", "llm_d_epp_response_size_bytes",
            "Response body size in bytes (the model server's content-length: responses"
            " sent with one).",
            model2, model4, buckets=RESPONSE_SIZE_BUCKETS,
        )  # fmt: skip
        self.input_tokens_old, self.input_tokens = pair(
            Histogram, "inference_objective_input_tokens", "llm_d_epp_request_input_tokens",
            "Prompt tokens per routed request, as the EPP counts them (its tokenizer).",
            model2, model4, buckets=INPUT_TOKEN_BUCKETS,
        )  # fmt: skip
        self.ttft = Histogram(
            "llm_d_epp_request_ttft_seconds",
            "Time to first token in seconds: the EPP receiving the request to the model"
            " server's response headers (for a response that is not streamed, its whole"
            " duration on the server).",
            [*model4, "streaming"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # -- scheduler ------------------------------------------------------------------
        self.scheduler_old, self.scheduler = pair(
            Histogram, "inference_extension_scheduler_e2e_duration_seconds",
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "Scheduling latency in seconds: filters, scorers and the pick.",
            [], [], buckets=SHORT_BUCKETS,
        )  # fmt: skip
        self.attempts_old, self.attempts = pair(
            Counter, "inference_extension_scheduler_attempts_total",
            "llm_d_epp_scheduler_attempts_total",
            "Scheduling attempts by status (success, failure) and chosen endpoint.",
            ["status", "target_model_name", "pod_name", "namespace", "port"],
            ["status", "target_model_name", "endpoint_name", "namespace", "port"],
        )  # fmt: skip
        self.hit_ratio_old, self.hit_ratio = pair(
            Histogram, "inference_extension_prefix_indexer_hit_ratio",
            "llm_d_epp_prefix_indexer_hit_ratio",
            "Longest prefix any endpoint holds, over the prompt's length (blocks), per lookup.",
            [], ["plugin_name", "plugin_type"], buckets=HIT_RATIO_BUCKETS,
        )  # fmt: skip
        self.info_old, self.info = pair(
            Gauge, "inference_extension_info", "llm_d_epp_info",
            "The EPP's build (value 1): build_ref is its version.",
            ["commit", "build_ref"], ["commit", "build_ref"],
        )  # fmt: skip
        self.info_old.labels("", epp.__version__).set(1)
        self.info.labels("", epp.__version__).set(1)
        # -- flow control -----------------------------------------------------------------
        queue_labels = ["fairness_id", "priority", "inference_pool", *model2]
        self.queue_duration_old, self.queue_duration = pair(
            Histogram, "inference_extension_flow_control_request_queue_duration_seconds",
            "llm_d_epp_flow_control_request_queue_duration_seconds",
            "Time requests spent in admission, from arrival to their outcome (Dispatched at"
            " once or after waiting, RejectedCapacity, EvictedTTL, EvictedContextCancelled,"
            " RejectedOther).",
            ["fairness_id", "priority", "outcome", "inference_pool", *model2],
            ["fairness_id", "priority", "outcome", "inference_pool", *model2],
            buckets=QUEUE_DURATION_BUCKETS,
        )  # fmt: skip
        self.cycle_old, self.cycle = pair(
            Histogram, "inference_extension_flow_control_dispatch_cycle_duration_seconds",
            "llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
            "Time of each pass over the waiting requests that dispatches those a pod has"
            " room for.",
            [], [], buckets=SHORT_BUCKETS,
        )  # fmt: skip
        self.enqueue_old, self.enqueue = pair(
            Histogram, "inference_extension_flow_control_request_enqueue_duration_seconds",
            "llm_d_epp_flow_control_request_enqueue_duration_seconds",
            "Time of the admission step of each request: dispatched at once (Dispatched),"
            " queued (NotYetFinalized) or refused (RejectedCapacity).",
            ["fairness_id", "priority", "outcome"], ["fairness_id", "priority", "outcome"],
            buckets=SHORT_BUCKETS,
        )  # fmt: skip
        self.queue_size_old, self.queue_size = pair(
            Gauge, "inference_extension_flow_control_queue_size",
            "llm_d_epp_flow_control_queue_size",
            "Requests waiting in the EPP for a pod with room.", queue_labels, queue_labels,
        )  # fmt: skip
        self.queue_bytes_old, self.queue_bytes = pair(
            Gauge, "inference_extension_flow_control_queue_bytes",
            "llm_d_epp_flow_control_queue_bytes",
            "Body bytes of the requests waiting in the EPP.", queue_labels, queue_labels,
        )  # fmt: skip
        self.flow_requests = Counter(
            "llm_d_epp_flow_control_requests_total",
            "Requests through admission, by terminal outcome.",
            ["outcome", "priority", "inference_pool"],
            registry=r,
        )
        r.register(_ScrapeCollector(self))
        # Children used on every routed request, looked up once.
        self._hit_ratio = self.hit_ratio.labels(*PREFIX_PLUGIN)
        self._attempts: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    # -- wiring (Router.__init__, EppMetrics.watch / set_limits) ------------------------------
    def configure(self, *, pool: str | None, namespace: str | None, flow_enabled: bool) -> None:
        self.pool = pool or STATIC_POOL
        self.namespace = namespace or ""
        self.flow_enabled = flow_enabled

    def watch(
        self,
        *,
        endpoints: Callable[[], Iterable[Endpoint]] | None = None,
        open_requests: Callable[[], Iterable[RequestLabels]] | None = None,
        prefix_size: Callable[[], int] | None = None,
        max_queue: int | None = None,
    ) -> None:
        if endpoints is not None:
            self._endpoints = endpoints
        if open_requests is not None:
            self._open = open_requests
        if prefix_size is not None:
            self._prefix_size = prefix_size
        if max_queue is not None:
            self._max_queue = float(max(1, max_queue))

    # -- per request -----------------------------------------------------------------------
    def request(
        self,
        model: str | None,
        target: str | None,
        priority: int,
        headers: Mapping[str, str],
        streaming: bool,
        received: float,
    ) -> RequestLabels:
        """A parsed request's labels (bounded here: clients choose model and fairness id)."""
        fairness = ""
        for name in FAIRNESS_HEADERS:
            fairness = headers.get(name, "")
            if fairness:
                break
        return RequestLabels(
            self.models(model),
            self.models(target if target is not None else model),
            self.fairness(fairness) if fairness else DEFAULT_FAIRNESS_ID,
            str(priority),
            received,
            streaming,
        )

    def _error(self, key: tuple[str, str, str, str], code: str) -> tuple[Any, Any]:
        pair = self._errors.get((key, code))
        if pair is None:
            model, target, fairness, priority = key
            pair = self._errors[(key, code)] = (
                self.errors_old.labels(model, target, code),
                self.errors.labels(model, target, fairness, priority, code),
            )
        return pair

    def routed(
        self,
        labels: RequestLabels | None,
        endpoint: Endpoint,
        *,
        size: int,
        prompt_tokens: int,
        uncached_tokens: int,
        schedule_s: float,
        best_match: float,
    ) -> None:
        self.scheduler_old.observe(schedule_s)
        self.scheduler.observe(schedule_s)
        self.hit_ratio_old.observe(best_match)
        self._hit_ratio.observe(best_match)
        target = labels.target_model_name if labels is not None else ""
        pair = self._attempts.get((target, endpoint.name, endpoint.address))
        if pair is None:
            port = port_label(endpoint.address)
            attempt = ("success", target, endpoint.name, self.namespace, port)
            pair = self._attempts[(target, endpoint.name, endpoint.address)] = (
                self.attempts_old.labels(*attempt),
                self.attempts.labels(*attempt),
            )
        pair[0].inc()
        pair[1].inc()
        if labels is None:
            return
        labels.endpoint = endpoint.name
        labels.uncached_tokens = uncached_tokens
        key = labels.key
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _Series(self, key)
        labels.series = s
        s.requests_old.inc()
        s.requests.inc()
        s.request_size_old.observe(size)
        s.request_size.observe(size)
        if prompt_tokens > 0:
            s.input_tokens_old.observe(prompt_tokens)
            s.input_tokens.observe(prompt_tokens)
        self._running_keys.add(s.key)

    def schedule_failed(self, labels: RequestLabels | None) -> None:
        target = labels.target_model_name if labels is not None else ""
        self.attempts_old.labels("failure", target, "", "", "").inc()
        self.attempts.labels("failure", target, "", "", "").inc()

    def completed(
        self,
        labels: RequestLabels | None,
        status: int | None,
        first_byte_at: float | None = None,
        response_bytes: int | None = None,
    ) -> None:
        """A routed request's response ended (status None: without a response)."""
        if labels is None or status is None or labels.series is None:
            return
        now = time.perf_counter()
        s = labels.series
        elapsed = max(0.0, now - labels.received)
        s.duration_old.observe(elapsed)
        s.duration.observe(elapsed)
        if first_byte_at is not None:
            ttft = s.ttft.get(labels.streaming)
            if ttft is None:
                streaming = "true" if labels.streaming else "false"
                ttft = s.ttft[labels.streaming] = self.ttft.labels(*s.key, streaming)
            ttft.observe(max(0.0, first_byte_at - labels.received))
        if response_bytes is not None:
            s.response_size_old.observe(response_bytes)
            s.response_size.observe(response_bytes)
        if status != 200:
            old, new = self._error(s.key, MODEL_SERVER_ERROR)
            old.inc()
            new.inc()

    @staticmethod
    def tag(rejected: Exception, labels: RequestLabels | None) -> None:
        """Attach a refused request's labels to its refusal, for `answered`."""
        setattr(rejected, _TAG, labels)

    def answered(self, status: int, rejected: Exception | None = None) -> None:
        """The EPP answered a request itself (every ImmediateResponse, once); `rejected`,
        the refusal, carries the request's labels when the router parsed it (`tag`)."""
        code = error_code(status)
        labels: RequestLabels | None = getattr(rejected, _TAG, None)
        if labels is None:
            self.errors_old.labels("", "", code).inc()
            self.errors.labels("", "", DEFAULT_FAIRNESS_ID, "0", code).inc()
            return
        old, new = self._error(labels.key, code)
        old.inc()
        new.inc()

    # -- flow control -------------------------------------------------------------------
    def admission(self, labels: RequestLabels | None, outcome: str, started: float) -> None:
        """The admission step of a request ended: dispatched at once, queued or refused."""
        if labels is None or not self.flow_enabled:
            return
        spent = time.perf_counter() - started
        key = (labels.fairness_id, labels.priority, outcome)
        self._child(self.enqueue_old, key).observe(spent)
        self._child(self.enqueue, key).observe(spent)
        if outcome != NOT_YET_FINALIZED:
            self.finished(labels, outcome, started)

    def finished(self, labels: RequestLabels | None, outcome: str, started: float) -> None:
        """A request's time in admission ended with its terminal outcome."""
        if labels is None or not self.flow_enabled:
            return
        spent = time.perf_counter() - started
        fairness, priority, pool = labels.fairness_id, labels.priority, self.pool
        key = (fairness, priority, outcome, pool, labels.model_name, labels.target_model_name)
        self._child(self.queue_duration_old, key).observe(spent)
        self._child(self.queue_duration, key).observe(spent)
        self._child(self.flow_requests, (outcome, priority, pool)).inc()

    def waiting(self, labels: RequestLabels | None, size: int, delta: int) -> None:
        """A request joined (+1) or left (-1) the EPP's waiting queue."""
        if labels is None:
            return
        fairness, priority, pool = labels.fairness_id, labels.priority, self.pool
        key = (fairness, priority, pool, labels.model_name, labels.target_model_name)
        for gauge in (self.queue_size_old, self.queue_size):
            self._child(gauge, key).inc(delta)
        for gauge in (self.queue_bytes_old, self.queue_bytes):
            self._child(gauge, key).inc(delta * size)

    def _child(self, metric: Any, key: tuple[str, ...]) -> Any:
        """`metric.labels(*key)`, looked up once (label values are bounded)."""
        child = self._children.get((id(metric), key))
        if child is None:
            child = self._children[(id(metric), key)] = metric.labels(*key)
        return child

    def dispatch_cycle(self, spent_s: float) -> None:
        self.cycle_old.observe(spent_s)
        self.cycle.observe(spent_s)

    # -- scrape time -------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        endpoints = list(self._endpoints())
        pool = self.pool
        yield from self._pool_families(endpoints)
        saturation = [
            "inference_extension_flow_control_pool_saturation",
            "llm_d_epp_flow_control_pool_saturation",
        ]
        routable = [e for e in endpoints if not e.excluded]
        # The pool gates (requests wait) when its least loaded routable pod is at
        # scheduling.max_queue: 1.0 is that point; an empty pool reads 1.0 as upstream.
        value = min(e.queue_depth for e in routable) / self._max_queue if routable else 1.0
        for name, doc in zip(saturation, _SATURATION_DOCS, strict=True):
            family = GaugeMetricFamily(name, doc, labels=["inference_pool"])
            family.add_metric([pool], value)
            yield family
        yield from self._open_families()
        size = float(self._prefix_size())
        old = GaugeMetricFamily(
            "inference_extension_prefix_indexer_size",
            _legacy("Entries in the prefix index.", "llm_d_epp_prefix_indexer_size"),
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
        pool = self.pool
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
                (f"inference_pool_average_{stat}", _legacy(doc, f"llm_d_epp_average_{stat}"), mean),
                (f"llm_d_epp_average_{stat}", doc, mean),
                (f"llm_d_epp_std_dev_{stat}", "Standard deviation of: " + doc, std),
            ):
                family = GaugeMetricFamily(name, d, labels=["name"])
                family.add_metric([pool], value)
                yield family
        ready_doc = "Endpoints of the pool the EPP knows (discovered ready)."
        for name, doc in (
            ("inference_pool_ready_pods", _legacy(ready_doc, "llm_d_epp_ready_endpoints")),
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

    def _open_families(self) -> Iterator[Metric]:
        running: dict[tuple[str, str, str, str], int] = dict.fromkeys(self._running_keys, 0)
        inflight: dict[tuple[str, str, str, str], list[int]] = {
            k: [0, 0] for k in self._inflight_keys
        }
        for labels in self._open():
            key4 = labels.key
            running[key4] = running.get(key4, 0) + 1
            key = (labels.endpoint, self.namespace, labels.fairness_id, labels.priority)
            counts = inflight.setdefault(key, [0, 0])
            counts[0] += 1
            counts[1] += labels.uncached_tokens
        # Series of pods still known stay at 0 once idle; a removed pod's go.
        known = {e.name for e in self._endpoints()}
        self._inflight_keys = {k for k in inflight if k[0] in known}
        self._running_keys = set(running)
        doc = "Requests routed and not yet ended."
        old = GaugeMetricFamily(
            "inference_objective_running_requests",
            _legacy(doc, "llm_d_epp_request_running"),
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
        for key in sorted(self._inflight_keys):
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
    _legacy(
        "Pool saturation: the least loaded routable pod's queue over scheduling.max_queue"
        " (1.0: requests wait in the EPP); 1.0 for an empty pool.",
        "llm_d_epp_flow_control_pool_saturation",
    ),
    "Pool saturation: the least loaded routable pod's queue over scheduling.max_queue"
    " (1.0: requests wait in the EPP); 1.0 for an empty pool.",
)


class _ScrapeCollector(Collector):
    def __init__(self, upstream: UpstreamMetrics) -> None:
        self._upstream = upstream

    def describe(self) -> Iterator[Metric]:
        return iter(())  # read at scrape time only

    def collect(self) -> Iterator[Metric]:
        return self._upstream.collect()


def port_label(address: str) -> str:
    """The `port` label of an endpoint's `host:port` ("" if it has none: a label must not
    fail a request)."""
    try:
        return str(parse_host_port(address).port)
    except AddressError:
        return ""
