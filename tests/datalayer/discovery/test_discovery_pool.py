"""Pool + pods -> endpoints, table-driven: readiness, terminating, IPs, selector, ranks."""

from __future__ import annotations

from typing import Any

import pytest
from kube_standin import pod, pool

from epp.datalayer.discovery.pool import (
    InvalidPool,
    endpoints_for_pool,
    parse_pool,
    pod_serves,
)

VLLM = {"app": "vllm"}


@pytest.mark.parametrize(
    ("case", "obj", "serves"),
    [
        ("ready with an IP", pod("a", VLLM, "10.0.0.1"), True),
        ("not ready", pod("a", VLLM, "10.0.0.1", ready=False), False),
        ("no IP yet", pod("a", VLLM, None), False),
        ("terminating", pod("a", VLLM, "10.0.0.1", terminating=True), False),
        ("no conditions", {"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1"}}, False),
        ("no status", {"metadata": {"name": "a"}}, False),
        (
            "Ready Unknown",
            {
                "metadata": {"name": "a"},
                "status": {
                    "podIP": "1.2.3.4",
                    "conditions": [{"type": "Ready", "status": "Unknown"}],
                },
            },
            False,
        ),
    ],
)
def test_pod_serves(case: str, obj: dict[str, Any], serves: bool) -> None:
    assert pod_serves(obj) is serves, case


@pytest.mark.parametrize(
    ("case", "ports", "pods", "expected"),
    [
        (
            "one port: named after the pod, sorted by name",
            [8000],
            [pod("b", VLLM, "10.0.0.2"), pod("a", VLLM, "10.0.0.1")],
            [("a", "10.0.0.1:8000"), ("b", "10.0.0.2:8000")],
        ),
        (
            "several ports: one endpoint per rank",
            [8000, 8001],
            [pod("a", VLLM, "10.0.0.1")],
            [("a-rank-0", "10.0.0.1:8000"), ("a-rank-1", "10.0.0.1:8001")],
        ),
        (
            "only Ready, non-terminating pods with an IP that match the selector",
            [8000],
            [
                pod("ready", VLLM, "10.0.0.1"),
                pod("unready", VLLM, "10.0.0.2", ready=False),
                pod("terminating", VLLM, "10.0.0.3", terminating=True),
                pod("no-ip", VLLM, None),
                pod("other-app", {"app": "other"}, "10.0.0.5"),
                pod("no-labels", {}, "10.0.0.6"),
            ],
            [("ready", "10.0.0.1:8000")],
        ),
        (
            "extra labels on the pod are fine",
            [8000],
            [pod("a", {**VLLM, "zone": "b"}, "10.0.0.1")],
            [("a", "10.0.0.1:8000")],
        ),
        (
            "IPv6 addresses are bracketed",
            [8000],
            [pod("a", VLLM, "fd00::1")],
            [("a", "[fd00::1]:8000")],
        ),
        (
            "a second pod on the same IP:port (host network) is skipped",
            [8000],
            [pod("a", VLLM, "10.0.0.1"), pod("b", VLLM, "10.0.0.1")],
            [("a", "10.0.0.1:8000")],
        ),
        ("no pods", [8000], [], []),
    ],
)
def test_endpoints_for_pool(
    case: str, ports: list[int], pods: list[dict[str, Any]], expected: list[tuple[str, str]]
) -> None:
    spec = parse_pool(pool("p", VLLM, ports))
    endpoints = endpoints_for_pool(spec, pods)
    assert [(e.name, e.address) for e in endpoints] == expected, case


def test_endpoint_fields_come_from_the_pod() -> None:
    spec = parse_pool(pool("p", VLLM, [8000, 9000]))
    [first, second] = endpoints_for_pool(spec, [pod("a", {**VLLM, "tier": "gpu"}, "10.0.0.1")])
    assert first.metrics_url == "http://10.0.0.1:8000/metrics"
    assert second.metrics_url == "http://10.0.0.1:9000/metrics"
    assert first.labels == {"app": "vllm", "tier": "gpu"}
    assert first.model is None  # learned from the pod's metrics


def test_parse_pool_reads_selector_ports_and_picker_ref() -> None:
    ref = {"name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"}
    spec = parse_pool(pool("p", {"b": "2", "a": "1"}, [8000, 8001], endpointPickerRef=ref))
    assert spec.name == "p"
    assert spec.label_selector == "a=1,b=2"
    assert spec.target_ports == (8000, 8001)
    assert spec.endpoint_picker_ref == ref
    assert parse_pool(pool("p", VLLM, [8000])).endpoint_picker_ref is None  # optional in v1


@pytest.mark.parametrize(
    ("case", "obj"),
    [
        ("no ports", pool("p", VLLM, [])),
        ("nine ports", pool("p", VLLM, range(8000, 8009))),
        ("port 0", pool("p", VLLM, [0])),
        ("port too high", pool("p", VLLM, [70000])),
        ("a port twice", pool("p", VLLM, [8000, 8000])),
        (
            "port not a number",
            {
                **pool("p", VLLM, []),
                "spec": {**pool("p", VLLM, [])["spec"], "targetPorts": [{"number": "8000"}]},
            },
        ),
        ("empty selector: would select every pod", pool("p", {}, [8000])),
        ("no spec", {"metadata": {"name": "p"}}),
        (
            "matchExpressions",
            {
                "metadata": {"name": "p"},
                "spec": {
                    "selector": {"matchLabels": VLLM, "matchExpressions": [{"key": "x"}]},
                    "targetPorts": [{"number": 8000}],
                },
            },
        ),
    ],
)
def test_parse_pool_rejects(case: str, obj: dict[str, Any]) -> None:
    with pytest.raises(InvalidPool):
        parse_pool(obj)


def test_eight_ports_is_the_limit() -> None:
    assert len(parse_pool(pool("p", VLLM, range(8000, 8008))).target_ports) == 8
