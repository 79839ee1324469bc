"""TLS between a real Envoy and the real EPP (`epp serve` with server.tls, mutual TLS):
Envoy's ext_proc cluster has an UpstreamTlsContext (epp.envoy_config.EppTls) with its
own client certificate. Certificates come from tests/certs.py.

Requests routed through a TLS Envoy reach the pods with the EPP's decision; an Envoy
without a client certificate, or one that does not trust the EPP's CA, gets no decision
(fail closed: an error, never a pod the EPP did not choose). Rotation is tested against
the gRPC server directly (tests/extproc/test_tls.py): Envoy keeps its connection to the
EPP open, so a new certificate would meet Envoy only at its next connection."""

from __future__ import annotations

import json
import re

import pytest
from certs import CertAuthority, needs_openssl
from e2e.harness import chat_body, http, rig, wait_for
from helpers import served_certificate

from epp.envoy_config import EppTls, render
from epp_harness.stack import HOST, free_ports

pytestmark = [pytest.mark.e2e, needs_openssl]


def envoy_stat(admin_port: int, name: str) -> int:
    _, _, page = http(f"http://{HOST}:{admin_port}/stats?filter=^{re.escape(name)}$", timeout=5)
    match = re.search(rf"^{re.escape(name)}: (\d+)$", page.decode(), re.M)
    return int(match.group(1)) if match else 0


def test_envoy_calls_the_epp_over_mutual_tls(tmp_path):
    ca = CertAuthority(tmp_path / "ca", "epp-ca")
    server, envoy_client = ca.issue("epp"), ca.issue("envoy")
    stranger = CertAuthority(tmp_path / "other", "other-ca")
    with rig(tmp_path) as r:
        r.start_pods(2)
        tls = {
            "cert_file": str(server.cert),
            "key_file": str(server.key),
            "client_ca_file": str(ca.cert),
            "reload_check_s": 1.0,
        }
        r.start_epp({"server": {"tls": tls}})

        def envoy(epp_tls: EppTls) -> tuple[str, int]:
            listen, admin = free_ports(2)
            config = render(
                mode="epp", listen_port=listen, admin_port=admin, epp_port=r.epp_grpc_port,
                pods=r.pods, body_mode="BUFFERED", epp_tls=epp_tls,
            )  # fmt: skip
            r.start_envoy(config, listen)
            return r.envoy_url, admin

        good, good_admin = envoy(
            EppTls(str(ca.cert), HOST, str(envoy_client.cert), str(envoy_client.key))
        )
        routed = r.epp_routed()
        for i in range(4):
            status, headers, _ = http(f"{good}/v1/chat/completions", chat_body(f"topic {i}"))
            assert status == 200
            assert headers.get("x-epp-request-id")
        wait_for(lambda: r.epp_routed() >= routed + 4, timeout=5, what="the EPP's decisions")
        assert envoy_stat(good_admin, "cluster.epp.ssl.handshake") >= 1

        # No client certificate: the EPP refuses the handshake, Envoy gets no decision.
        no_cert, no_cert_admin = envoy(EppTls(str(ca.cert), HOST))
        before = r.epp_routed()
        status, _, _ = http(f"{no_cert}/v1/chat/completions", chat_body("refused"))
        assert status >= 500
        # A gateway that does not trust the EPP's CA refuses the EPP (the SAN matches).
        distrust, distrust_admin = envoy(
            EppTls(str(stranger.cert), HOST, str(envoy_client.cert), str(envoy_client.key))
        )
        status, _, _ = http(f"{distrust}/v1/chat/completions", chat_body("distrusted"))
        assert status >= 500
        assert envoy_stat(distrust_admin, "cluster.epp.ssl.fail_verify_error") >= 1
        # And a certificate for another name is refused by the SAN check.
        wrong_name, wrong_name_admin = envoy(
            EppTls(str(ca.cert), "10.0.0.1", str(envoy_client.cert), str(envoy_client.key))
        )
        status, _, _ = http(f"{wrong_name}/v1/chat/completions", chat_body("wrong name"))
        assert status >= 500
        assert envoy_stat(wrong_name_admin, "cluster.epp.ssl.fail_verify_san") >= 1
        assert r.epp_routed() == before
        assert envoy_stat(no_cert_admin, "cluster.epp.ssl.handshake") == 0
        # The good gateway still routes.
        assert http(f"{good}/v1/chat/completions", chat_body("again"))[0] == 200
        started = [
            json.loads(line)
            for line in (tmp_path / "epp.log").read_text().splitlines()
            if '"grpc_transport"' in line
        ]
        assert [(e["mode"], e["subject"], e["issuer"]) for e in started] == [
            ("mtls", "CN=epp", "CN=epp-ca")
        ]


def test_envoy_can_pin_the_default_epps_self_signed_certificate(tmp_path):
    """The default EPP (no TLS settings): Envoy with --epp-ca-file set to the certificate
    the EPP generated and --epp-sni localhost (a name it carries) verifies it and routes;
    the same Envoy pinned to another certificate gets no decision."""
    with rig(tmp_path) as r:
        r.start_pods(2)
        r.start_epp()
        pem, _ = served_certificate(HOST, r.epp_grpc_port)
        (tmp_path / "served.crt").write_bytes(pem)
        listen, admin = free_ports(2)
        r.start_envoy(
            render(
                mode="epp", listen_port=listen, admin_port=admin, epp_port=r.epp_grpc_port,
                pods=r.pods, epp_tls=EppTls(str(tmp_path / "served.crt"), "localhost"),
            ),
            listen,
        )  # fmt: skip
        assert http(f"{r.envoy_url}/v1/chat/completions", chat_body("pinned"))[0] == 200
        assert envoy_stat(admin, "cluster.epp.ssl.handshake") >= 1
        other = CertAuthority(tmp_path / "other", "other-ca")
        listen, admin = free_ports(2)
        r.start_envoy(
            render(
                mode="epp", listen_port=listen, admin_port=admin, epp_port=r.epp_grpc_port,
                pods=r.pods, epp_tls=EppTls(str(other.cert), "localhost"),
            ),
            listen,
        )  # fmt: skip
        assert http(f"{r.envoy_url}/v1/chat/completions", chat_body("other"))[0] >= 500
        assert envoy_stat(admin, "cluster.epp.ssl.fail_verify_error") >= 1
