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
label tuple); per-pod and per-open-request series are computed at scrape time
(upstream_scrape.py). The reference's names and buckets: upstream_names.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from epp.datalayer.endpoint import Endpoint
from epp.observability.labels import BoundedLabel
from epp.observability.upstream_names import (
    DEFAULT_FAIRNESS_ID,
    DISPATCHED,
    EVICTED_CANCELLED,
    EVICTED_TTL,
    FAIRNESS_HEADERS,
    MODEL_SERVER_ERROR,
    NOT_YET_FINALIZED,
    PREFIX_PLUGIN,
    REJECTED_CAPACITY,
    REJECTED_OTHER,
    STATIC_POOL,
    error_code,
    port_label,
)
from epp.observability.upstream_scrape import UpstreamScrape
from epp.observability.upstream_series import UpstreamSeries

__all__ = [
    "DISPATCHED",
    "EVICTED_CANCELLED",
    "EVICTED_TTL",
    "NOT_YET_FINALIZED",
    "REJECTED_CAPACITY",
    "REJECTED_OTHER",
    "RequestLabels",
    "UpstreamMetrics",
    "error_code",
    "port_label",
]

_TAG = "upstream_labels"


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


class UpstreamMetrics(UpstreamSeries):
    """Records the EPP's events into the reference's series (defined in UpstreamSeries)."""

    def __init__(self, registry: CollectorRegistry, models: BoundedLabel, limit: int) -> None:
        self.models = models
        self.fairness = BoundedLabel(limit)
        self.pool = STATIC_POOL
        self.namespace = ""
        self.flow_enabled = True
        self._series: dict[tuple[str, str, str, str], _Series] = {}
        self._errors: dict[tuple[tuple[str, str, str, str], str], tuple[Any, Any]] = {}
        super().__init__(registry)
        self._scrape = UpstreamScrape(self)
        registry.register(self._scrape)
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
        scrape = self._scrape
        if endpoints is not None:
            scrape.endpoints = endpoints
        if open_requests is not None:
            scrape.open_requests = open_requests
        if prefix_size is not None:
            scrape.prefix_size = prefix_size
        if max_queue is not None:
            scrape.max_queue = float(max(1, max_queue))

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
        self._count_attempt(labels.target_model_name if labels is not None else "", endpoint)
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
        self._scrape.running_keys.add(s.key)

    def _count_attempt(self, target: str, endpoint: Endpoint) -> None:
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
        """The scrape-time series (registered apart: upstream_scrape.py)."""
        return self._scrape.collect()
