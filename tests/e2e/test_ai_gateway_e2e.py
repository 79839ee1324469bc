"""A real Envoy configured the way Envoy AI Gateway v1.1 configures an InferencePool's EPP,
in front of `epp serve` with its DEFAULT transport (TLS, a self-signed certificate made at
start) and simulated vLLM pods.

The Envoy config is built here from what envoyproxy/ai-gateway v1.1.0 generates (the
mirror's internal/extensionserver/, read at tag v1.1.0):

- inferencepool.go `buildExtProcClusterForInferencePoolEndpointPicker`: the EPP cluster
  `envoy.clusters.endpointpicker_<pool>_<ns>_ext_proc`, STRICT_DNS, LEAST_REQUEST,
  connect_timeout 10s, HTTP/2, and an UpstreamTlsContext whose CommonTlsContext has an
  empty validation context ("Ensure Envoy accepts untrusted certificates"): TLS, nothing
  verified, no ALPN configured, no SNI;
- inferencepool.go `buildHTTPFilterForInferencePool`: the ext_proc filter
  `envoy.filters.http.ext_proc/endpointpicker/<pool>_<ns>_ext_proc`, envoy_grpc with
  authority `<svc>.<ns>.svc:<port>`, processing mode SEND for request and response
  headers and trailers, both bodies FULL_DUPLEX_STREAMED (annotation
  `aigateway.envoyproxy.io/processing-body-mode: buffered`: both BUFFERED),
  allow_mode_override false, message_timeout 300s, failure_mode_allow false (fail closed),
  no metadata_options (so the EPP's envoy.lb metadata is dropped and the header routes);
- post_translate_modify.go `patchListenerWithInferencePoolFilters`: the filter is put in
  the HCM just before the router;
- post_cluster_modify.go `handleInferencePoolCluster`: the pool's cluster is ORIGINAL_DST,
  CLUSTER_PROVIDED, connect_timeout 10s, reading the x-gateway-destination-endpoint
  header; post_route_modify.go: the route has auto_host_rewrite false.

What cannot run here: Envoy Gateway and its extension server (no API server), so the
config is written by this test rather than generated, and the EPP Service's DNS name is
127.0.0.1 (the cluster stays STRICT_DNS). AI Gateway's own ext_proc filter (token
accounting, model routing) is left out: it does not touch the EPP.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from e2e.harness import chat_body, http, rig, wait_for

from epp_harness.stack import HOST, free_ports

pytestmark = pytest.mark.e2e

POOL, NAMESPACE, EPP_SERVICE = "vllm-llama3-8b-instruct", "default", "vllm-llama3-8b-instruct-epp"
EPP_CLUSTER = f"envoy.clusters.endpointpicker_{POOL}_{NAMESPACE}_ext_proc"
EPP_FILTER = f"envoy.filters.http.ext_proc/endpointpicker/{POOL}_{NAMESPACE}_ext_proc"
POOL_CLUSTER = f"httproute/{NAMESPACE}/{POOL}-route/rule/0"
DESTINATION_HEADER = "x-gateway-destination-endpoint"  # internalapi.EndpointPickerHeaderKey
TLS_CONTEXT = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def ai_gateway_envoy(
    listen_port: int, admin_port: int, epp_port: int, *, tls: bool = True, body: str = "duplex"
) -> str:
    """The bootstrap: one listener, the EPP's ext_proc filter, the pool's ORIGINAL_DST
    cluster and the EPP cluster, as AI Gateway v1.1.0 builds them (module docstring).
    `tls` False takes the EPP cluster's transport socket away (a plaintext gateway)."""
    body_mode = "BUFFERED" if body == "buffered" else "FULL_DUPLEX_STREAMED"
    epp_cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "connect_timeout": "10s",
        "type": "STRICT_DNS",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "health_status": "HEALTHY",
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": HOST,  # <svc>.<ns>.svc in a cluster
                                        "protocol": "TCP",
                                        "port_value": epp_port,
                                    }
                                }
                            },
                        }
                    ]
                }
            ],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }
    if tls:
        # tlsv3.UpstreamTlsContext{CommonTlsContext: {ValidationContextType:
        # &CommonTlsContext_ValidationContext{}}}: an empty validation context.
        epp_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": TLS_CONTEXT,
                "common_tls_context": {"validation_context": {}},
            },
        }
    ext_proc = {
        "name": EPP_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {
                    "cluster_name": EPP_CLUSTER,
                    "authority": f"{EPP_SERVICE}.{NAMESPACE}.svc:{epp_port}",
                }
            },
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": body_mode,
                "request_trailer_mode": "SEND",
                "response_body_mode": body_mode,
                "response_header_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "allow_mode_override": False,
            "message_timeout": "300s",
            "failure_mode_allow": False,
        },
    }
    pool_cluster = {
        "name": POOL_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "10s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": POOL_CLUSTER, "auto_host_rewrite": False, "timeout": "60s"},
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "name": "gateway",
            "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [route]}],
        },
        "http_filters": [
            ext_proc,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    bootstrap = {
        "admin": {"address": {"socket_address": {"address": HOST, "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": HOST, "port_value": listen_port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [pool_cluster, epp_cluster],
        },
    }
    return yaml.safe_dump(bootstrap, sort_keys=False)


def envoy_stat(admin_port: int, name: str) -> int:
    _, _, page = http(f"http://{HOST}:{admin_port}/stats?filter=^{re.escape(name)}$", timeout=5)
    match = re.search(rf"^{re.escape(name)}: (\d+)$", page.decode(), re.M)
    return int(match.group(1)) if match else 0


def start_gateway(r, **kwargs) -> tuple[str, int]:
    """An AI-Gateway-style Envoy in front of the rig's EPP: (its URL, its admin port)."""
    listen, admin = free_ports(2)
    r.start_envoy(ai_gateway_envoy(listen, admin, r.epp_grpc_port, **kwargs), listen)
    return r.envoy_url, admin


def decisions(r) -> dict[str, str]:
    """request_id -> pod, from the EPP's decision log."""
    out = {}
    for line in (r.work / "epp.log").read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "request_routed":
            out[entry["request_id"]] = entry["pod"]
    return out


def transport_logged(r) -> dict:
    """The EPP's start-up line about its gRPC transport."""
    for line in (r.work / "epp.log").read_text().splitlines():
        if '"grpc_transport"' in line:
            return json.loads(line)
    raise AssertionError("the EPP logged no grpc_transport line")


def test_ai_gateway_envoy_routes_through_the_default_epp(tmp_path):
    """Every request through the AI Gateway-style Envoy reaches the pod the EPP chose,
    over TLS the EPP serves by default, in both of AI Gateway's body modes; a stream too."""
    with rig(tmp_path) as r:
        r.start_pods(3)
        r.start_epp()  # no transport flag, no TLS settings: the default
        started = transport_logged(r)
        assert (started["mode"], started["certificate"]) == ("tls", "self-signed")
        assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", started["sha256_fingerprint"])
        for body in ("duplex", "buffered"):
            url, admin = start_gateway(r, body=body)
            served: dict[str, str] = {}
            for i in range(6):
                request_id = f"aigw-{body}-{i}"
                status, headers, reply = http(
                    f"{url}/v1/chat/completions",
                    chat_body(f"{body} topic {i % 3}", stream=i == 5),
                    headers={"x-request-id": request_id},
                )
                assert status == 200, reply[:300]
                served[request_id] = headers["x-sim-pod"]
                if i == 5:  # the streamed answer arrived whole
                    assert reply.rstrip().endswith(b"data: [DONE]"), reply[-200:]
            # Each request went to the pod the EPP named for it (the header it set).
            wait_for(lambda s=served: s.keys() <= decisions(r).keys(), what="EPP decisions")
            chosen = decisions(r)
            assert {rid: chosen[rid] for rid in served} == served
            assert envoy_stat(admin, f"cluster.{EPP_CLUSTER}.ssl.handshake") >= 1
            assert envoy_stat(admin, f"cluster.{EPP_CLUSTER}.ssl.connection_error") == 0


def test_plaintext_gateway_with_plaintext_epp_and_each_against_the_other(tmp_path):
    """A plaintext gateway works with `epp serve --plaintext`; a plaintext gateway in
    front of the default (TLS) EPP, or a TLS gateway in front of a plaintext EPP, gets no
    decision and fails closed: an error, never a pod the EPP did not choose."""
    with rig(tmp_path) as r:
        r.start_pods(2)
        r.start_epp(args=["--plaintext"])
        assert transport_logged(r)["mode"] == "plaintext"
        plain, _ = start_gateway(r, tls=False)
        status, headers, _ = http(f"{plain}/v1/chat/completions", chat_body("plaintext"))
        assert status == 200 and headers.get("x-sim-pod")
        routed = r.epp_routed()
        tls, tls_admin = start_gateway(r, tls=True)
        status, headers, _ = http(f"{tls}/v1/chat/completions", chat_body("tls to plain"))
        assert status >= 500 and "x-sim-pod" not in headers
        assert envoy_stat(tls_admin, f"cluster.{EPP_CLUSTER}.ssl.connection_error") >= 1
        assert r.epp_routed() == routed

    (tmp_path / "tls").mkdir()
    with rig(tmp_path / "tls") as r:
        r.start_pods(2)
        r.start_epp()  # the default: TLS
        plain, _ = start_gateway(r, tls=False)
        for i in range(3):
            status, headers, _ = http(f"{plain}/v1/chat/completions", chat_body(f"plain {i}"))
            assert status >= 500 and "x-sim-pod" not in headers
        assert r.epp_routed() == 0
        tls, _ = start_gateway(r, tls=True)
        assert http(f"{tls}/v1/chat/completions", chat_body("tls"))[0] == 200
