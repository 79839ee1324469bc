"""Client-controlled label values are bounded: series count and /metrics size stay small."""

from __future__ import annotations

from dataclasses import dataclass

from epp.observability.labels import OTHER, BoundedLabel
from epp.observability.metrics import EppMetrics


def _series(metrics: EppMetrics, family: str) -> list[dict[str, str]]:
    return [
        sample.labels
        for metric in metrics.registry.collect()
        if metric.name == family
        for sample in metric.samples
        if sample.name == f"{family}_total"
    ]


def test_ten_thousand_model_names_make_a_bounded_number_of_series():
    metrics = EppMetrics()
    for i in range(10_000):
        metrics.decisions.labels(f"model-{i}", "routed").inc()
    series = _series(metrics, "epp_routing_decisions")
    assert len(series) <= 101  # 100 first-come names + "other"
    assert sum(1 for s in series if s["model"] == OTHER) == 1
    assert len(metrics.exposition()) < 64 * 1024


def test_adapter_loads_are_bounded_too():
    metrics = EppMetrics(client_label_limit=5)
    for i in range(1000):
        metrics.adapter_loads.labels(f"lora-{i}").inc()
        metrics.adapter_loads.labels(adapter=f"lora-x{i}").inc()
    assert len(_series(metrics, "epp_adapter_loads_triggered")) == 6
    assert metrics.adapter_label("lora-0") == "lora-0"
    assert metrics.adapter_label("lora-999") == OTHER


@dataclass
class _Pod:
    name: str
    model: str | None
    adapters: frozenset[str] = frozenset()
    queue_depth: int = 0
    health: float = 1.0
    kv_usage: float = 0.0
    in_flight: int = 0
    consecutive_failures: int = 0
    excluded: bool = False
    unhealthy: bool = False
    panic: bool = False


def test_names_known_from_config_or_pods_keep_their_series_after_the_limit():
    metrics = EppMetrics(client_label_limit=2)
    pods = [_Pod("p0", "llama", frozenset({"sql-lora"}))]
    metrics.watch(lambda: pods, lambda _name: 0)
    metrics.allow_labels(models=["configured"], adapters=["cfg-lora"])
    for name in ("a", "b", "c"):
        metrics.model_label(name)
    assert metrics.model_label("c") == OTHER
    assert metrics.model_label("llama") == "llama"  # reported by a pod
    assert metrics.model_label("configured") == "configured"
    assert metrics.adapter_label("sql-lora") == "sql-lora"
    assert metrics.adapter_label("cfg-lora") == "cfg-lora"
    assert metrics.models.first_come == 2
    assert metrics.model_label(None) == "" and metrics.model_label("") == ""


def test_values_that_would_bloat_or_break_the_page_are_other():
    clock = [0.0]
    label = BoundedLabel(10, clock=lambda: clock[0])
    assert label("x" * 10_000) == OTHER
    assert label("bad\ud800") == OTHER
    assert label("é") == "é"
    metrics = EppMetrics()
    metrics.decisions.labels("bad\udfff", "routed").inc()
    assert b"other" in metrics.exposition()  # the page still renders


def test_pod_reported_names_are_reread_at_most_once_per_refresh():
    calls = []
    clock = [0.0]

    def known():
        calls.append(clock[0])
        return ["m"]

    label = BoundedLabel(0, known=known, clock=lambda: clock[0])
    for _ in range(100):
        assert label("unknown") == OTHER
    assert len(calls) == 1
    clock[0] = 5.0
    label("unknown")
    assert len(calls) == 2
