"""EPP replicas find each other through a headless Service: in deploy/kubernetes/ and in
the chart, that Service lists every EPP pod (ready or not) on the peers port, and the
EPP's configuration names it as its peers and listens on that port. No RBAC: DNS needs
none (tests/deploy/test_rbac.py keeps the grants to the watched resources)."""

from __future__ import annotations

import pytest
import yaml

from deploy.conftest import VALUES_ALL, static_objects
from epp.config import EppConfig


def check_peers(objects: list[dict], fullname: str) -> None:
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    peers = services[f"{fullname}-peers"]["spec"]
    assert peers["clusterIP"] == "None"
    assert peers["publishNotReadyAddresses"] is True
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == fullname
    ]
    pod = deployment["spec"]["template"]
    assert peers["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "epp"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    ports = {p["name"]: p for p in peers["ports"]}
    assert ports["peers"]["targetPort"] == "peers"
    assert ports["grpc"]["targetPort"] == "grpc"

    (config_map,) = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{fullname}-config"
    ]
    config = EppConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert config.replicas.peers == [f"{fullname}-peers:{ports['peers']['port']}"]
    assert config.replicas.listen_port == container_ports["peers"] == ports["peers"]["port"]
    assert config.server.grpc_port == container_ports["grpc"] == ports["grpc"]["port"]


def test_static_manifests_wire_the_peers_service():
    check_peers(static_objects(), "epp")


@pytest.mark.parametrize(
    ("values", "sets", "fullname"),
    [
        (None, [], "epp"),
        (None, ["replicaCount=3", "ports.peers=9100", "fullnameOverride=picker"], "picker"),
        (VALUES_ALL, [], None),
    ],
    ids=["default", "scaled", "values-all"],
)
def test_chart_wires_the_peers_service(render_chart, values, sets, fullname):
    rendered = render_chart(values, set=sets) if values else render_chart(set=sets)
    if fullname is None:
        fullname = rendered.one("Deployment")["metadata"]["name"]
    check_peers(rendered.objects, fullname)


def test_extra_config_keeps_other_replicas_keys(render_chart):
    rendered = render_chart(set=["extraConfig.replicas.history=100"])
    config = yaml.safe_load(rendered.one("ConfigMap", "epp-config")["data"]["config.yaml"])
    assert config["replicas"]["history"] == 100
    assert config["replicas"]["peers"] == ["epp-peers:9003"]
