"""The /metrics page of an EppService after real decisions: the spec's names, types and
labels, the operator's additions (build info, limits, answers, scrape failures by reason,
pods, discovery), and docs/metrics.md describing exactly what the page has."""

from __future__ import annotations

import platform
import re

import pytest
from observability.pages import DOCS, page_families, service_page
from prometheus_client.parser import text_string_to_metric_families

import epp
from epp.datalayer.endpoint import Endpoint
from epp.observability.discovery import DiscoveryCollector
from epp.observability.metrics import EppMetrics, scrape_failure_reason

# The spec's metrics (seeds/000, "Prometheus Metrics"): name -> (type, labels).
SPEC = {
    "epp_routing_decisions_total": ("counter", {"model", "result"}),
    "epp_cache_match_ratio": ("histogram", set()),
    "epp_composite_score": ("histogram", set()),
    "epp_scoring_latency_us": ("histogram", set()),
    "epp_queue_depth": ("gauge", {"pod"}),
    "epp_pod_health_score": ("gauge", {"pod"}),
    "epp_candidate_pods": ("histogram", set()),
    "epp_prefix_tree_nodes": ("gauge", set()),
    "epp_stale_cache_routing_total": ("counter", set()),
    "epp_adapter_loads_triggered_total": ("counter", {"adapter"}),
}


@pytest.fixture(scope="module")
def page() -> str:
    return service_page()


def _families(page: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(page)}


def _labels(family) -> set[str]:
    keys: set[str] = set()
    for sample in family.samples:
        keys |= set(sample.labels) - {"le"}
    return keys


def test_the_spec_metrics_have_the_spec_names_types_and_labels(page: str):
    families = _families(page)
    for name, (kind, labels) in SPEC.items():
        family_name = name.removesuffix("_total")  # the parser names counters without it
        assert family_name in families, name
        family = families[family_name]
        assert family.type == kind, name
        assert _labels(family) == labels, name
        series = {s.name for s in family.samples}
        assert name in series or f"{name}_bucket" in series, name


def test_build_info_limits_and_pods(page: str):
    families = _families(page)
    (info,) = families["epp_build_info"].samples
    assert info.labels == {"version": epp.__version__, "python": platform.python_version()}
    assert info.value == 1
    assert families["epp_max_queue"].samples[0].value == 20
    assert families["epp_health_exclusion_threshold"].samples[0].value == 0.3
    assert families["epp_pods"].samples[0].value == 2
    assert families["epp_healthy_pods"].samples[0].value == 2
    assert {s.labels["pod"] for s in families["epp_pod_excluded"].samples} == {"pod-a", "pod-b"}


def test_answers_scrape_failures_and_stale_checks_are_on_the_page(page: str):
    families = _families(page)
    answers = {
        (s.labels["status"], s.labels["reason"]): s.value
        for s in families["epp_answers"].samples
        if s.name == "epp_answers_total"
    }
    assert answers == {("404", "model-not-found"): 1.0, ("400", "invalid-json"): 1.0}
    failures = [s for s in families["epp_scrape_failures"].samples if s.name.endswith("_total")]
    assert [(s.labels, s.value) for s in failures] == [({"reason": "timeout"}, 1.0)]
    # 4 requests of one prompt: the 3 after the first predicted a hit, and were checked
    # against pages whose hit counters covered them.
    checked = families["epp_stale_cache_checked"].samples[0].value
    stale = families["epp_stale_cache_routing"].samples[0].value
    assert (checked, stale) == (3.0, 0.0)


def test_discovery_state_is_exported_and_absent_without_discovery(page: str):
    families = _families(page)
    assert families["epp_discovery_info"].samples[0].labels == {"mode": "kubernetes"}
    assert families["epp_discovery_endpoints"].samples[0].value == 2
    assert families["epp_discovery_last_sync_ok"].samples[0].value == 1
    assert families["epp_discovery_relists"].samples[0].value == 1
    assert families["epp_discovery_watch_restarts"].samples[0].value == 2
    assert families["epp_discovery_resource_up"].samples[0].labels == {"resource": "pods"}
    assert list(DiscoveryCollector(lambda: None).collect()) == []
    metrics = EppMetrics()
    metrics.watch_discovery(lambda: None)
    assert b"epp_discovery" not in metrics.exposition()


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("TimeoutError: ", "timeout"),
        ("ServerTimeoutError: Timeout on reading data from socket", "timeout"),
        ("ClientConnectorError: Cannot connect to host 10.0.0.1:8000", "connection"),
        ("ServerDisconnectedError: Server disconnected", "connection"),
        ("ConnectionRefusedError: [Errno 111]", "connection"),
        ("MetricsFormatError: HTTP 503", "http-status"),
        ("MetricsFormatError: metrics page larger than 8 MiB", "too-large"),
        ("MetricsFormatError: no vLLM metrics found on the page", "bad-page"),
        ("internal: ValueError('x')", "internal"),
        ("ClientPayloadError: Response payload is not completed", "other"),
        (None, "other"),
    ],
)
def test_scrape_failure_reasons(error, reason):
    assert scrape_failure_reason(error) == reason


def test_each_failed_scrape_counts_once_and_a_good_one_not_at_all():
    metrics = EppMetrics()
    pod = Endpoint(name="p", address="10.0.0.1:8000", metrics_url="http://10.0.0.1:8000/metrics")
    for failures, error in ((1, "TimeoutError: "), (2, "MetricsFormatError: HTTP 500")):
        pod.consecutive_failures, pod.last_error = failures, error
        metrics.on_endpoint_change("updated", pod)
    pod.consecutive_failures, pod.last_error = 0, None
    metrics.on_endpoint_change("updated", pod)
    metrics.on_endpoint_change("released", pod)
    page = metrics.exposition().decode()
    assert 'epp_scrape_failures_total{reason="timeout"} 1.0' in page
    assert 'epp_scrape_failures_total{reason="http-status"} 1.0' in page
    assert page.count("epp_scrape_failures_total{") == 2


# The reference EPP's names the page also exports (observability/upstream.py).
_UPSTREAM_PREFIXES = "llm_d_epp_|inference_objective_|inference_pool_|inference_extension_"


def test_docs_describe_exactly_the_metrics_the_page_has(page: str):
    """docs/metrics.md names every family on the page (and the flow-control and loop-lag
    ones registered elsewhere), and names no `epp_` metric the EPP does not export."""
    names = re.findall(rf"`((?:{_UPSTREAM_PREFIXES}|epp_)[a-z0-9_]+)", DOCS.read_text())
    documented = {n for n in names if n[-1] != "_"}
    exported = set()
    for family, kind in page_families(page).items():
        exported.add(family)
        if kind == "histogram":
            exported |= {family + "_bucket", family + "_count", family + "_sum"}
    missing = sorted(f for f in page_families(page) if f not in documented)
    assert not missing, f"not in docs/metrics.md: {missing}"
    # Upstream names may be documented as not exported (with the reason); ours may not.
    unknown = sorted(d for d in documented if d not in exported and d.startswith("epp_"))
    assert not unknown, f"docs/metrics.md names metrics the EPP does not export: {unknown}"
