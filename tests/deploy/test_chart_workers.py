"""The chart with `workers` (server.workers): every worker's /metrics port is a named
container port, a Service port and a ServiceMonitor endpoint, on the port the product
itself picks for that worker.

The expected ports come from epp.serving.workers.metrics_ports applied to the EppConfig
`epp serve` builds from the rendered Deployment (its real argument parsing and config
file), so the chart's copy of the rule (epp.metricsPorts in _helpers.tpl) cannot drift
from the product's.
"""

from __future__ import annotations

import pytest

from deploy.conftest import RenderError
from deploy.test_chart_drop_in import checked, effective_config, render_with
from epp.serving.workers import WorkersError, metrics_ports

# Kubernetes container port names: IANA service names, at most 15 characters.
MAX_PORT_NAME = 15


def metrics_container_ports(rendered) -> dict[str, int]:
    container = rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {
        p["name"]: p["containerPort"] for p in container["ports"] if p["name"].startswith("metrics")
    }


def scraped_ports(rendered) -> list[int]:
    """The container ports the ServiceMonitor reaches: endpoint -> Service port name ->
    its targetPort (a container port name) -> the container port."""
    by_name = {
        p["name"]: p["containerPort"]
        for p in rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    service = rendered.one("Service", "epp")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    monitor = rendered.one("ServiceMonitor")
    found = []
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"
        service_port = service_ports[endpoint["port"]]
        target = by_name[service_port["targetPort"]]
        assert service_port["port"] == target, "Service port and container port differ"
        found.append(target)
    return found


def test_one_worker_renders_as_without_the_value(render_chart, tmp_path):
    """workers: 1 (the default) is the chart as before workers existed: one metrics port
    named `metrics`, one Service port `http-metrics`, one ServiceMonitor endpoint, no
    server.workers in the config file."""
    default = render_chart(set=["metrics.serviceMonitor.enabled=true"])
    one = render_chart(set=["metrics.serviceMonitor.enabled=true", "workers=1"])
    for rendered in (default, one):
        assert metrics_container_ports(rendered) == {"metrics": 9090}
        assert [p["name"] for p in rendered.one("Service", "epp")["spec"]["ports"]] == [
            "grpc-ext-proc",
            "http-metrics",
        ]
        assert [e["port"] for e in rendered.one("ServiceMonitor")["spec"]["endpoints"]] == [
            "http-metrics"
        ]
        assert scraped_ports(rendered) == [9090]
        config = effective_config(rendered, tmp_path, "default")
        assert config.server.workers == 1
        assert metrics_ports(config) == [9090]
    assert one.text == default.text
    assert "Metrics:      http://epp.default.svc.cluster.local:9090/metrics\n" in one.notes


@pytest.mark.parametrize(
    "values",
    [
        {"workers": 3},
        {"workers": 2, "ports": {"metrics": 9001}},
        {"workers": 3, "extraConfig": {"server": {"debug_port": None}}},
        {"workers": 3, "extraConfig": {"server": {"debug_port": 9092}}},
        {"workers": 3, "extraConfig": {"replicas": {"listen_port": 9092}}},
        {"workers": 64},
    ],
    ids=["three", "below-grpc", "no-debug", "debug-moved", "peers-port-moved", "most"],
)
def test_every_worker_port_is_named_served_and_scraped_where_the_product_listens(
    render_chart, tmp_path, values
):
    rendered = render_with(
        render_chart, {**values, "metrics": {"serviceMonitor": {"enabled": True}}}
    )
    checked(rendered, external_gateways={"default/inference-gateway"})
    config = effective_config(rendered, tmp_path, "default")
    workers = values["workers"]
    assert config.server.workers == workers, "the pod does not run the workers asked for"
    expected = metrics_ports(config)
    assert len(expected) == workers
    ports = metrics_container_ports(rendered)
    names = ["metrics"] + [f"metrics-{i}" for i in range(1, workers)]
    assert list(ports) == names
    assert all(len(name) <= MAX_PORT_NAME for name in ports)
    assert list(ports.values()) == expected, "a container port is not where its worker listens"
    assert scraped_ports(rendered) == expected, "not every worker's /metrics is scraped"
    assert f"workers 1.. on ports {', '.join(map(str, expected[1:]))})" in rendered.notes


def test_ports_past_65535_are_refused_by_chart_and_product(render_chart, tmp_path):
    with pytest.raises(RenderError, match="past port 65535"):
        render_chart(set=["workers=2", "ports.metrics=65535"])
    config = effective_config(render_chart(), tmp_path, "default")
    config = config.model_copy(
        update={"server": config.server.model_copy(update={"workers": 2, "metrics_port": 65535})}
    )
    with pytest.raises(WorkersError, match="past port 65535"):
        metrics_ports(config)


def test_workers_with_several_replicas_is_refused(render_chart):
    with pytest.raises(RenderError, match="workers > 1 with replicaCount > 1 is not supported"):
        render_chart(set=["workers=2", "replicaCount=2"])
    render_chart(set=["workers=1", "replicaCount=2"])
    render_chart(set=["workers=2", "replicaCount=1"])
