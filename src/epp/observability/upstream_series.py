"""The reference EPP's series, defined once: each with its deprecated twin under GIE's
names where the reference has one (same labels but fewer, `[Deprecated: Use ...]` help).
`UpstreamMetrics` (upstream.py) records into them."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

import epp
from epp.observability.loop_metrics import LoopCounter, LoopHistogram
from epp.observability.upstream_names import (
    GENERAL_LATENCY_BUCKETS,
    HIT_RATIO_BUCKETS,
    INPUT_TOKEN_BUCKETS,
    QUEUE_DURATION_BUCKETS,
    REQUEST_SIZE_BUCKETS,
    RESPONSE_SIZE_BUCKETS,
    SHORT_BUCKETS,
    TTFT_BUCKETS,
    legacy,
)


class _Pairs:
    """Makes a series and its deprecated twin: `(old, new)` with the reference's help texts."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def __call__(self, kind: Any, old: str, new: str, doc: str, old_labels: list[str],
                 new_labels: list[str], **kw: Any) -> tuple[Any, Any]:  # fmt: skip
        r = self._registry
        return (
            kind(old, legacy(doc, new), old_labels, registry=r, **kw),
            kind(new, doc, new_labels, registry=r, **kw),
        )


_MODEL4 = ["model_name", "target_model_name", "fairness_id", "priority"]
_MODEL2 = ["model_name", "target_model_name"]


class UpstreamSeries:
    """The metric objects, registered in `registry` in the order the page lists them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        pair = _Pairs(registry)
        self._request_metrics(pair, registry)
        self._scheduler_metrics(pair)
        self._flow_metrics(pair, registry)

    def _request_metrics(self, pair: _Pairs, r: CollectorRegistry) -> None:
        self.requests_old, self.requests = pair(
            LoopCounter, "inference_objective_request_total", "llm_d_epp_request_total",
            "Requests the EPP routed to a model server.",
            [*_MODEL2, "priority"], _MODEL4,
        )  # fmt: skip
        self.errors_old, self.errors = pair(
            LoopCounter, "inference_objective_request_error_total", "llm_d_epp_request_error_total",
            "Failed requests, by error_code: the EPP's own answers and model-server answers"
            " other than 200.",
            [*_MODEL2, "error_code"], [*_MODEL4, "error_code"],
        )  # fmt: skip
        self.duration_old, self.duration = pair(
            LoopHistogram, "inference_objective_request_duration_seconds",
            "llm_d_epp_request_duration_seconds",
            "End-to-end request latency in seconds: the EPP receiving the request to the"
            " response's end.",
            _MODEL2, _MODEL4, buckets=GENERAL_LATENCY_BUCKETS,
        )  # fmt: skip
        self.request_size_old, self.request_size = pair(
            LoopHistogram, "inference_objective_request_sizes", "llm_d_epp_request_size_bytes",
            "Request body size in bytes.", _MODEL2, _MODEL4, buckets=REQUEST_SIZE_BUCKETS,
        )  # fmt: skip
        self.response_size_old, self.response_size = pair(
            LoopHistogram, "inference_objective_response_sizes", "llm_d_epp_response_size_bytes",
            "Response body size in bytes (the model server's content-length: responses"
            " sent with one).",
            _MODEL2, _MODEL4, buckets=RESPONSE_SIZE_BUCKETS,
        )  # fmt: skip
        self.input_tokens_old, self.input_tokens = pair(
            LoopHistogram, "inference_objective_input_tokens", "llm_d_epp_request_input_tokens",
            "Prompt tokens per routed request, as the EPP counts them (its tokenizer).",
            _MODEL2, _MODEL4, buckets=INPUT_TOKEN_BUCKETS,
        )  # fmt: skip
        self.ttft = LoopHistogram(
            "llm_d_epp_request_ttft_seconds",
            "Time to first token in seconds: the EPP receiving the request to the model"
            " server's response headers (for a response that is not streamed, its whole"
            " duration on the server).",
            [*_MODEL4, "streaming"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )

    def _scheduler_metrics(self, pair: _Pairs) -> None:
        self.scheduler_old, self.scheduler = pair(
            LoopHistogram, "inference_extension_scheduler_e2e_duration_seconds",
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "Scheduling latency in seconds: filters, scorers and the pick.",
            [], [], buckets=SHORT_BUCKETS,
        )  # fmt: skip
        self.attempts_old, self.attempts = pair(
            LoopCounter, "inference_extension_scheduler_attempts_total",
            "llm_d_epp_scheduler_attempts_total",
            "Scheduling attempts by status (success, failure) and chosen endpoint.",
            ["status", "target_model_name", "pod_name", "namespace", "port"],
            ["status", "target_model_name", "endpoint_name", "namespace", "port"],
        )  # fmt: skip
        self.hit_ratio_old, self.hit_ratio = pair(
            LoopHistogram, "inference_extension_prefix_indexer_hit_ratio",
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

    def _flow_metrics(self, pair: _Pairs, r: CollectorRegistry) -> None:
        queue_labels = ["fairness_id", "priority", "inference_pool", *_MODEL2]
        self.queue_duration_old, self.queue_duration = pair(
            LoopHistogram, "inference_extension_flow_control_request_queue_duration_seconds",
            "llm_d_epp_flow_control_request_queue_duration_seconds",
            "Time requests spent in admission, from arrival to their outcome (Dispatched at"
            " once or after waiting, RejectedCapacity, EvictedTTL, EvictedContextCancelled,"
            " RejectedOther).",
            ["fairness_id", "priority", "outcome", "inference_pool", *_MODEL2],
            ["fairness_id", "priority", "outcome", "inference_pool", *_MODEL2],
            buckets=QUEUE_DURATION_BUCKETS,
        )  # fmt: skip
        self.cycle_old, self.cycle = pair(
            LoopHistogram, "inference_extension_flow_control_dispatch_cycle_duration_seconds",
            "llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
            "Time of each pass over the waiting requests that dispatches those a pod has"
            " room for.",
            [], [], buckets=SHORT_BUCKETS,
        )  # fmt: skip
        self.enqueue_old, self.enqueue = pair(
            LoopHistogram, "inference_extension_flow_control_request_enqueue_duration_seconds",
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
        self.flow_requests = LoopCounter(
            "llm_d_epp_flow_control_requests_total",
            "Requests through admission, by terminal outcome.",
            ["outcome", "priority", "inference_pool"],
            registry=r,
        )
