"""Prometheus metrics of admission (flow control), on the EPP's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_size = Gauge(
            "epp_flow_control_queue_size",
            "Requests waiting in the EPP for a pod with room.",
            registry=registry,
        )
        self.queue_bytes = Gauge(
            "epp_flow_control_queue_bytes",
            "Body bytes of the requests waiting in the EPP.",
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "epp_flow_control_wait_seconds",
            "Time requests waited in the EPP before dispatch or refusal.",
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        # Outcomes: dispatched (after waiting), rejected-saturated (sheddable, or queue
        # full), rejected-ttl-expired, cancelled (client gone while waiting), failed.
        self.outcomes = Counter(
            "epp_flow_control_requests_total",
            "Requests that met a saturated pool, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.saturated = Gauge(
            "epp_flow_control_pool_saturated",
            "1 while requests are waiting for capacity.",
            registry=registry,
        )
