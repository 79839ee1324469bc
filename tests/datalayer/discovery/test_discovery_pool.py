"""Pool + pods -> endpoints, table-driven: readiness, terminating, IPs, selector, ranks;
every field of the upstream pools (GIE v1.6.0's conformance pools, the v1alpha2 pool of
GIE v0.5.0's manifests), admitted through their upstream CRDs first."""

from __future__ import annotations

from typing import Any

import pytest
from kube_standin import admitted, pod, pool, upstream_objects

from epp.datalayer.discovery.pool import (
    EndpointPickerRef,
    InvalidPool,
    MetricsLocation,
    endpoints_for_pool,
    parse_alpha_pool,
    parse_label_selector,
    parse_pool,
    pod_serves,
    standalone_pool,
)

CONFORMANCE = "gie-v1.6.0/conformance/base.yaml"


def conformance_pool(name: str) -> dict[str, Any]:
    """One of GIE v1.6.0's conformance InferencePools, as the API server stores it."""
    (obj,) = [
        p for p in upstream_objects(CONFORMANCE, "InferencePool") if p["metadata"]["name"] == name
    ]
    return admitted(obj)


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


def test_metrics_url_from_the_model_server_metrics_flags() -> None:
    # upstream's --model-server-metrics-scheme/-port/-path; port 0: each rank's own port.
    spec = parse_pool(pool("p", VLLM, [8000, 9000]))
    pods = [pod("a", VLLM, "10.0.0.1"), pod("b", VLLM, "fd00::2")]
    triton = MetricsLocation("http", 8002, "/metrics")
    assert [e.metrics_url for e in endpoints_for_pool(spec, pods, triton)] == [
        "http://10.0.0.1:8002/metrics",
        "http://10.0.0.1:8002/metrics",
        "http://[fd00::2]:8002/metrics",
        "http://[fd00::2]:8002/metrics",
    ]
    trtllm = MetricsLocation("https", 0, "/prometheus/metrics")
    [first, second] = endpoints_for_pool(spec, pods[:1], trtllm)
    assert first.metrics_url == "https://10.0.0.1:8000/prometheus/metrics"
    assert second.metrics_url == "https://10.0.0.1:9000/prometheus/metrics"
    assert first.address == "10.0.0.1:8000"  # what Envoy dials is unchanged


def test_parse_pool_reads_selector_ports_and_picker_ref() -> None:
    ref = {"name": "epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    obj = admitted(pool("p", {"b": "2", "a": "1"}, [8000, 8001], endpointPickerRef=ref))
    spec = parse_pool(obj)
    assert spec.name == "p"
    assert spec.label_selector == "a=1,b=2"
    assert spec.target_ports == (8000, 8001)
    assert spec.endpoint_picker_ref == EndpointPickerRef("epp", "Service", "", 9002, "FailOpen")
    assert spec.app_protocol == "http"  # the CRD's default
    assert parse_pool(admitted(pool("p", VLLM, [8000]))).endpoint_picker_ref is None  # optional


@pytest.mark.parametrize(
    ("name", "selector", "ports", "app_protocol", "picker"),
    [
        (
            "primary-inference-pool",
            "app=primary-inference-model-server",
            (3000,),
            "http",  # omitted: the CRD's default, HTTP/1.1
            EndpointPickerRef("primary-endpoint-picker-svc", "Service", "", 9002, "FailClose"),
        ),
        (
            "secondary-inference-pool",
            "app=secondary-inference-model-server",
            (3000,),
            "http",
            EndpointPickerRef("secondary-endpoint-picker-svc", "Service", "", 9002, "FailOpen"),
        ),
        (
            "appprotocol-h2c-inference-pool",
            "app=appprotocol-inference-model-server",
            (3001,),
            "kubernetes.io/h2c",
            EndpointPickerRef(
                "appprotocol-h2c-endpoint-picker-svc", "Service", "", 9002, "FailClose"
            ),
        ),
        (
            "dp-inference-pool",
            "app=dp-inference-model-server",
            (3000, 3002, 3004),
            "http",
            EndpointPickerRef("dp-endpoint-picker-svc", "Service", "", 9002, "FailClose"),
        ),
    ],
)
def test_the_conformance_pools_every_field(
    name: str, selector: str, ports: tuple[int, ...], app_protocol: str, picker: EndpointPickerRef
) -> None:
    spec = parse_pool(conformance_pool(name))
    assert (spec.name, spec.label_selector, spec.target_ports) == (name, selector, ports)
    assert spec.app_protocol == app_protocol
    assert spec.endpoint_picker_ref == picker
    # Both appProtocols are cleartext: the pods' scheme and their metrics URL are http.
    assert spec.scheme == "http"
    [first, *_] = endpoints_for_pool(spec, [pod("m", dict(spec.selector), "10.0.0.7")])
    assert first.metrics_url == f"http://10.0.0.7:{ports[0]}/metrics"


def test_an_app_protocol_the_crd_does_not_define_makes_the_pool_invalid() -> None:
    obj = conformance_pool("appprotocol-h2c-inference-pool")
    obj["spec"]["appProtocol"] = "kubernetes.io/wss"
    with pytest.raises(InvalidPool, match="appProtocol"):
        parse_pool(obj)


def test_the_v1alpha2_pool_of_gie_v0_5_0() -> None:
    (obj,) = upstream_objects("gie-v0.5.0/manifests/inferencepool-resources.yaml", "InferencePool")
    spec = parse_alpha_pool(admitted(obj))  # against GIE v1.4.0's v1alpha2 CRD
    assert spec.name == "vllm-llama3-8b-instruct"
    assert spec.label_selector == "app=vllm-llama3-8b-instruct"
    assert spec.target_ports == (8000,)
    assert spec.app_protocol == "http"
    assert spec.endpoint_picker_ref == EndpointPickerRef(
        "vllm-llama3-8b-instruct-epp", "Service", "", None, "FailClose"
    )
    assert [
        (e.name, e.address)
        for e in endpoints_for_pool(spec, [pod("a", dict(spec.selector), "10.0.0.1")])
    ] == [("a", "10.0.0.1:8000")]
    with pytest.raises(InvalidPool):
        parse_alpha_pool(
            {"metadata": {"name": "p"}, "spec": {"selector": {}, "targetPortNumber": 8000}}
        )
    with pytest.raises(InvalidPool):
        parse_alpha_pool({"metadata": {"name": "p"}, "spec": {"selector": VLLM}})


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


@pytest.mark.parametrize(
    ("text", "pairs"),
    [
        ("app=x", (("app", "x"),)),
        ("tier=gpu, app==x", (("app", "x"), ("tier", "gpu"))),
        ("app=x,app=x", (("app", "x"),)),
    ],
)
def test_label_selector(text: str, pairs: tuple[tuple[str, str], ...]) -> None:
    assert parse_label_selector(text) == pairs


@pytest.mark.parametrize(
    "text", ["app", "app!=x", "app in (x,y)", "app=x,app=y", "=x", "app=x,", "a b=x"]
)
def test_label_selector_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="label selector"):
        parse_label_selector(text)


def test_standalone_pool() -> None:
    spec = standalone_pool("standalone", "app=vllm", [8000, 8001])
    assert (spec.label_selector, spec.target_ports) == ("app=vllm", (8000, 8001))
    assert spec.endpoint_picker_ref is None and spec.app_protocol == "http"
    for ports in ([], [8000, 8000], list(range(8000, 8009)), [0]):
        with pytest.raises(InvalidPool):
            standalone_pool("standalone", "app=vllm", ports)
