"""Envoy configurations for the local stack: one fronted by the EPP, baselines without it.

Generated from code rather than templated text so that ports, body mode and the pod list
are typed parameters, and so the committed examples in `deploy/envoy/` can be checked
against this module by a test (they are its output for the default ports).

`epp envoy-config --mode epp --epp-port 9002 --listen-port 8080` prints one.

Envoy dials the EPP as the EPP serves by default: TLS (server.secure_serving) without
verifying its certificate, which is self-signed unless server.tls gives one; that is how
Envoy AI Gateway and kgateway dial an EPP. `--epp-ca-file` verifies it (and its name,
`--epp-sni`); `--epp-plaintext` dials an EPP started with `--plaintext`.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from epp.addresses import AddressError, format_host_port, is_ip_address, parse_host_port

DESTINATION_HEADER = "x-gateway-destination-endpoint"
ROUTE_TOKEN_HEADER = "x-epp-route-token"
REQUEST_ID_RESPONSE_HEADER = "x-epp-request-id"
# Headers only the EPP may set: removed from every client request before any filter runs,
# so a client can neither pick its pod when the EPP is bypassed (fail-open) nor complete
# someone else's decision. A priority header the EPP trusts belongs here too (--strip-header).
STRIPPED_HEADERS = (DESTINATION_HEADER, ROUTE_TOKEN_HEADER)
# The InferenceObjective a request names (epp.datalayer.discovery.models), which sets its
# priority: removed too unless the clients are trusted to choose it (--keep-objective-headers).
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
# The observer filter tells the EPP its streams apart with this gRPC metadata.
OBSERVER_METADATA = ("x-epp-stream", "observer")
_EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
Mode = Literal["epp", "round_robin", "least_request"]
PodCluster = Literal["override_host", "original_dst"]

# A hung pod fails its attempt after this long without a byte (see render).
UPSTREAM_IDLE_TIMEOUT_S = 120.0
# A buffered request body must fit in the listener's buffer, or Envoy answers 413.
BUFFER_LIMIT_BYTES = 32 * 1024 * 1024
# Envoy's circuit breakers default to 1,024 connections, pending requests and requests,
# and 3 retries, per cluster across all workers. Past those, a request fails at once while
# the EPP and the pods are idle: every streaming generation holds an observer stream to the
# EPP and a connection to its pod for its whole length, so near 1,024 generations the
# observer streams fail open silently (the EPP never hears of those ends), then routing
# streams overflow into 500s and pod requests into 503s (tests/e2e/test_circuit_breakers_e2e.py).
# They are lifted to the most a threshold holds, not sized for the fleet, because no size
# derived from the fleet is right: the EPP cluster carries one observer stream per request
# in flight plus one routing stream per request being routed or waiting in admission
# (flow_control.max_requests), which depends on client concurrency and generation length,
# not on pods x max_num_seqs; the pods' threshold is per cluster, not per pod, so it cannot
# express a pod's concurrency, and the pod count changes under a rendered config (with
# ORIGINAL_DST it is not even known). An undersized threshold fails requests the pods could
# serve; the limits that know the pods' room are the EPP's (scheduling.max_queue,
# flow_control) and the pods' own queues. Envoy's own resources are bounded by its file
# descriptor limit. Measured: 10,000 concurrent streams through one Envoy with these
# (docs/benchmarks/streams.md). GIE's standalone chart raises them to 40,000.
CIRCUIT_BREAKER_MAX = 2**32 - 1
_TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _circuit_breakers() -> dict[str, Any]:
    limit = CIRCUIT_BREAKER_MAX
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                "max_retries": limit,
            }
        ]
    }


def _lb_endpoints(addresses: Sequence[str]) -> list[dict[str, Any]]:
    """`host:port` strings as Envoy endpoints (an IPv6 host without its brackets)."""
    parsed = [parse_host_port(address) for address in addresses]
    return [{"endpoint": {"address": _socket(a.host, a.port)}} for a in parsed]


def _static_cluster(name: str, addresses: Sequence[str], lb_policy: str, http2: bool) -> dict:
    endpoints = _lb_endpoints(addresses)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": lb_policy,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


@dataclass(frozen=True)
class EppTls:
    """Envoy verifies the EPP's certificate (the EPP's `server.tls` files): `ca_file`
    signed it, and it must name `server_name` (a DNS name, also sent as SNI, or an IP);
    `cert_file`/`key_file` are Envoy's client certificate when the EPP requires one.
    Without an EppTls Envoy still dials TLS, verifying nothing (see render)."""

    ca_file: str
    server_name: str
    cert_file: str | None = None
    key_file: str | None = None


def _unverified_epp_transport_socket() -> dict[str, Any]:
    """TLS that accepts any certificate: the EPP's self-signed default, as Envoy AI
    Gateway and kgateway dial it. Encrypted, not authenticated: use EppTls where the
    network between Envoy and the EPP is not trusted. ALPN h2: gRPC servers need it, and
    Envoy's health checker offers none of its own."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {"@type": _TLS_TYPE, "common_tls_context": {"alpn_protocols": ["h2"]}},
    }


def _epp_transport_socket(tls: EppTls) -> dict[str, Any]:
    try:
        ipaddress.ip_address(tls.server_name)
        san_type, sni = "IP_ADDRESS", None  # SNI carries host names only
    except ValueError:
        san_type, sni = "DNS", tls.server_name
    common: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        # Without a SAN matcher Envoy checks only the chain, not whose certificate it is.
        "validation_context": {
            "trusted_ca": {"filename": tls.ca_file},
            "match_typed_subject_alt_names": [
                {"san_type": san_type, "matcher": {"exact": tls.server_name}}
            ],
        },
    }
    if tls.cert_file is not None and tls.key_file is not None:
        common["tls_certificates"] = [
            {
                "certificate_chain": {"filename": tls.cert_file},
                "private_key": {"filename": tls.key_file},
            }
        ]
    context: dict[str, Any] = {"@type": _TLS_TYPE, "common_tls_context": common}
    if sni is not None:
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


# Several EPP replicas (--epp-address, twice or more; README "High availability"): how fast
# Envoy stops sending routing streams to a replica that died or drains.
EPP_HEALTH_INTERVAL_S = 0.5
EPP_HEALTH_TIMEOUT_S = 0.25


def _epp_replicas_cluster(addresses: Sequence[str]) -> dict[str, Any]:
    """The EPP replicas as one cluster, each replica taken out as soon as it cannot route.

    - gRPC health checks of the `readiness` service every 0.5 s (also with no traffic):
      one failure takes a replica out (a SIGKILLed one refuses the connection, a draining
      one answers NOT_SERVING), one success brings it back;
    - the routing filter retries a stream that cannot start on another replica, and
      outlier detection ejects a replica on its first connect failure or reset, before
      the next health check: least request would otherwise keep choosing the dead
      replica (it has no open streams) until then;
    - no panic mode: Envoy's default balances over every replica, the dead included, once
      half of them are unhealthy (1 of 2 is enough), which would send a dead replica half
      the routing streams;
    - least request: a slow replica collects open streams and gets fewer new ones. Round
      robin alternates the two streams of each request, routing and observer, between
      two replicas: with sequential requests one replica routed all of them (121 of 121,
      twice; least request split them 65/56 and 58/63). A separate cluster for the
      observer streams made no measurable difference to the split, so there is one.
    A name among `addresses` (a Kubernetes headless Service) makes the cluster STRICT_DNS:
    every address it resolves to is a replica."""
    cluster = _static_cluster("epp", addresses, "LEAST_REQUEST", True)
    if not all(is_ip_address(parse_host_port(address).host) for address in addresses):
        cluster["type"] = "STRICT_DNS"
        cluster["dns_refresh_rate"] = "5s"
        cluster["respect_dns_ttl"] = True
    cluster["health_checks"] = [
        {
            "timeout": f"{EPP_HEALTH_TIMEOUT_S}s",
            "interval": f"{EPP_HEALTH_INTERVAL_S}s",
            "no_traffic_interval": f"{EPP_HEALTH_INTERVAL_S}s",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": "readiness"},
        }
    ]
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0.0}}
    cluster["outlier_detection"] = {
        # Enforcement of this one defaults to 0%: without it nothing is ejected.
        "consecutive_gateway_failure": 1,
        "enforcing_consecutive_gateway_failure": 100,
        "consecutive_5xx": 1000,  # an EPP answers errors in-band: only its absence ejects
        "interval": "1s",
        "base_ejection_time": "2s",
        "max_ejection_percent": 50,  # of two replicas, one stays whatever happens
    }
    # The streams a dead replica refused are retried on another: Envoy's default of 3
    # retries in flight per cluster failed the rest (measured: 6 and 8 failed requests
    # per SIGKILL at 8 clients, against none with this and the ejection above). The
    # circuit breakers (render) lift max_retries with the rest.
    return cluster


def _outlier_detection() -> dict[str, Any]:
    """Eject a pod after consecutive 5xx / gateway failures (connect failure, reset, timeout).

    The override_host policy still honours the EPP's choice of an ejected pod as primary
    (measured on Envoy 1.40), so this does not fight the EPP; what it adds is Envoy's own
    view for its retries and for fail-open balancing while the EPP catches up."""
    return {
        "consecutive_5xx": 5,
        "consecutive_gateway_failure": 3,
        "interval": "5s",
        "base_ejection_time": "15s",
        "max_ejection_percent": 50,
    }


def _override_host_cluster(pods: Sequence[str]) -> dict[str, Any]:
    """Known pods, routed to the address the EPP names; the rest of its list on retry.

    Envoy's override_host policy reads the EPP's comma list (primary, then fallbacks) from
    the envoy.lb metadata (a client cannot forge it), then from the header. An address
    that is not a member of the cluster is never dialled: a stray value cannot send traffic
    outside the pool. Measured on Envoy 1.40: ORIGINAL_DST answers 503 to a comma list.
    """
    cluster = _static_cluster("pods", pods, "ROUND_ROBIN", False)
    del cluster["lb_policy"]
    source_path = [{"key": DESTINATION_HEADER}]
    cluster["load_balancing_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        "override_host_sources": [
                            {"metadata": {"key": "envoy.lb", "path": source_path}},
                            {"header": DESTINATION_HEADER},
                        ],
                        # Used only when no override is present (EPP bypassed, fail-open).
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.round_robin",
                                        "typed_config": {
                                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }
    cluster["outlier_detection"] = _outlier_detection()
    return cluster


def _original_dst_cluster() -> dict[str, Any]:
    """Any address the EPP names (pods not known to Envoy); one address, no fallbacks."""
    return {
        "name": "pods",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }


def _ext_proc_filter(
    body_mode: BodyMode, message_timeout_s: float, fail_open: bool, replicas: bool = False
) -> dict:
    """The routing filter: asks the EPP for the destination, then goes on without it.

    The EPP ends the stream with OK once the destination is sent, which Envoy treats as
    "processing complete": the response never waits for the EPP, and an EPP crash or
    restart costs no request already routed. So nothing on the response path is sent."""
    processing_mode = {
        "request_header_mode": "SEND",
        "request_body_mode": body_mode,
        # Duplex streaming requires trailers to be sent. Buffered: the body message comes
        # before the client's trailers, and a body-less request ended by trailers sends no
        # body message at all; only the trailers message lets the EPP answer it (with SKIP
        # it would reach a pod Envoy picks, without the EPP's decision).
        "request_trailer_mode": "SEND",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    grpc_service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"}
    if replicas:
        # A stream that cannot start on one replica (refused, reset before any answer)
        # starts on another, never the same one twice.
        grpc_service["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset,unavailable",
            "num_retries": 2,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 3,
        }
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC_TYPE,
            "grpc_service": grpc_service,
            "failure_mode_allow": fail_open,
            "message_timeout": f"{message_timeout_s}s",
            # The EPP re-arms the timer once while a request waits in its admission queue
            # (server.keepalive_extension_s, 65 s); this is the most it may ask for.
            "max_message_timeout": "300s",
            "processing_mode": processing_mode,
            "allow_mode_override": False,
            # Without this Envoy drops the envoy.lb metadata silently and routing fails.
            "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
        },
    }


def _observer_filter() -> dict:
    """The second filter: tells the EPP how each routed request ended.

    Observability mode (Envoy never waits for an answer) and fail-open (its loss never
    fails a request). The request headers carry the route token the routing reply set, and
    open the stream at once, so a request that never gets a response is reported too.
    The response headers carry the status and, as attributes, the upstream that served.
    Measured on Envoy 1.40: no trailers message comes when the upstream sends none, so the
    end of this stream is the end of the response (trailers stay SEND for upstreams that
    do send them)."""
    return {
        "name": "epp-observer",
        "typed_config": {
            "@type": _EXT_PROC_TYPE,
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "epp"},
                "initial_metadata": [{"key": OBSERVER_METADATA[0], "value": OBSERVER_METADATA[1]}],
            },
            "failure_mode_allow": True,
            "observability_mode": True,
            # Envoy closes its side this long after the request ends (measured: ~0.3 s by
            # default); until then the EPP counts the request as in flight, which skews
            # the very next decision for a back-to-back conversation.
            "deferred_close_timeout": "0.01s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SEND",
            },
            "response_attributes": [
                "upstream.address",
                f"request.headers['{ROUTE_TOKEN_HEADER}']",
            ],
        },
    }


def _strip_headers(names: Sequence[str]) -> list[dict[str, Any]]:
    """HCM early header mutation: runs before route selection and every HTTP filter."""
    return [
        {
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": name} for name in names],
            },
        }
    ]


def render(
    *,
    mode: Mode,
    listen_port: int,
    admin_port: int,
    epp_port: int | None = None,
    pods: Sequence[str] = (),
    body_mode: BodyMode = "FULL_DUPLEX_STREAMED",
    host: str = "127.0.0.1",
    epp_host: str = "127.0.0.1",
    message_timeout_s: float = 5.0,
    fail_open: bool = False,
    request_timeout_s: float = 600.0,
    upstream_idle_timeout_s: float = UPSTREAM_IDLE_TIMEOUT_S,
    pod_cluster: PodCluster = "override_host",
    strip_headers: Sequence[str] = (),
    keep_objective_headers: bool = False,
    epp_tls: EppTls | None = None,
    epp_addresses: Sequence[str] = (),
    epp_plaintext: bool = False,
) -> str:
    """The Envoy bootstrap YAML for one listener in front of the pods.

    The EPP is dialled over TLS: verified against `epp_tls` when given, else unverified
    (the EPP's self-signed default); `epp_plaintext` for an EPP serving plaintext."""
    if epp_plaintext and epp_tls is not None:
        raise ValueError("epp_plaintext and epp_tls exclude each other")
    http_filters: list[dict[str, Any]] = []
    clusters: list[dict[str, Any]] = []
    route: dict[str, Any] = {"cluster": "pods", "timeout": f"{request_timeout_s}s"}
    stripped = [*STRIPPED_HEADERS, *(() if keep_objective_headers else OBJECTIVE_HEADERS)]
    stripped += [h.lower() for h in strip_headers if h.lower() not in stripped]
    if mode == "epp":
        if epp_port is None and not epp_addresses:
            raise ValueError("mode 'epp' needs epp_port or epp_addresses")
        replicas = bool(epp_addresses)
        http_filters.append(_ext_proc_filter(body_mode, message_timeout_s, fail_open, replicas))
        http_filters.append(_observer_filter())
        # A pod that accepted the request but sends nothing (hung) fails this attempt after
        # the idle timeout instead of holding the client for the whole request timeout.
        # Idle means no byte at all: a non-streamed answer sends nothing until it is done,
        # so this must exceed the longest non-streamed generation.
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": 0,
            "per_try_idle_timeout": f"{upstream_idle_timeout_s}s",
        }
        if pod_cluster == "override_host":
            if not pods:
                raise ValueError("pod_cluster 'override_host' needs the pod addresses")
            clusters.append(_override_host_cluster(pods))
            # A refused connection or a hung pod moves on to the next address of the
            # EPP's list (scheduling.fallbacks > 0).
            route["retry_policy"]["retry_on"] += ",gateway-error"
            route["retry_policy"]["num_retries"] = 3
        else:
            # ORIGINAL_DST reads one address; a retry would dial the same pod again.
            clusters.append(_original_dst_cluster())
        if replicas:
            clusters.append(_epp_replicas_cluster(epp_addresses))
        else:
            assert epp_port is not None  # checked above
            epp = format_host_port(epp_host, epp_port)
            clusters.append(_static_cluster("epp", [epp], "ROUND_ROBIN", True))
        if epp_tls is not None:
            clusters[-1]["transport_socket"] = _epp_transport_socket(epp_tls)
        elif not epp_plaintext:
            clusters[-1]["transport_socket"] = _unverified_epp_transport_socket()
    else:
        if not pods:
            raise ValueError(f"mode {mode!r} needs the pod addresses")
        lb = "ROUND_ROBIN" if mode == "round_robin" else "LEAST_REQUEST"
        clusters.append(_static_cluster("pods", pods, lb, False))
    for cluster in clusters:
        cluster["circuit_breakers"] = _circuit_breakers()
    stream_idle_s = request_timeout_s
    if "retry_policy" in route:
        attempts = route["retry_policy"]["num_retries"] + 1
        stream_idle_s = min(request_timeout_s, upstream_idle_timeout_s * attempts + 5.0)
    http_filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        }
    )
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "llm",
        # No byte either way for this long ends the request. It also bounds the one hang
        # fail-open cannot cure: in FULL_DUPLEX_STREAMED the body is already inside the
        # ext_proc filter when an EPP stops answering (measured on Envoy 1.40: neither
        # message_timeout nor the gRPC timeout ends such a request).
        # It must outlast every attempt's own idle timeout, or no retry could happen.
        "stream_idle_timeout": f"{stream_idle_s}s",
        "route_config": {
            "name": "llm",
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": route},
                    ],
                }
            ],
        },
        "http_filters": http_filters,
    }
    if mode == "epp":
        hcm["early_header_mutation_extensions"] = _strip_headers(stripped)
        # The id the EPP logs each decision under is Envoy's x-request-id. The routing
        # stream has ended by the time the response comes, so Envoy echoes it itself.
        virtual_host = hcm["route_config"]["virtual_hosts"][0]
        virtual_host["response_headers_to_add"] = [
            {
                "header": {"key": REQUEST_ID_RESPONSE_HEADER, "value": "%REQ(x-request-id)%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    bootstrap = {
        "admin": {"address": _socket(host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "llm",
                    "address": _socket(host, listen_port),
                    "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
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
            "clusters": clusters,
        },
    }
    return yaml.safe_dump(bootstrap, sort_keys=False)


def _address_arg(text: str) -> str:
    """A `host:port` flag, refused by argparse with the parser's one-line reason."""
    try:
        parse_host_port(text)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp envoy-config", description=__doc__)
    parser.add_argument("--mode", choices=["epp", "round_robin", "least_request"], default="epp")
    parser.add_argument("--listen-port", type=int, default=8080)
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--epp-port", type=int, default=9002)
    parser.add_argument("--epp-host", default="127.0.0.1")
    parser.add_argument("--host", default="127.0.0.1", help="address Envoy listens on")
    parser.add_argument(
        "--pod", action="append", default=[], type=_address_arg, help="ip:port (baselines)"
    )
    parser.add_argument(
        "--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED"
    )
    parser.add_argument(
        "--fail-open",
        action="store_true",
        help="if the EPP cannot be reached, Envoy routes by itself (override_host: round "
        "robin; original_dst: 503). See the README's failure modes.",
    )
    parser.add_argument(
        "--upstream-idle-timeout",
        type=float,
        default=UPSTREAM_IDLE_TIMEOUT_S,
        help="seconds without a byte from the pod before the attempt fails (a hung pod); "
        "must exceed the longest non-streamed generation",
    )
    parser.add_argument(
        "--strip-header",
        action="append",
        default=[],
        help="also remove this client header before the EPP sees it (e.g. the "
        "flow_control.priority_header the EPP trusts)",
    )
    parser.add_argument(
        "--keep-objective-headers",
        action="store_true",
        help="let clients name their InferenceObjective (x-llm-d-inference-objective, "
        "x-gateway-inference-objective), which sets their priority. Default: removed, as "
        "for untrusted traffic",
    )
    parser.add_argument(
        "--pod-cluster",
        choices=["override_host", "original_dst"],
        default="override_host",
        help="override_host: the pods are listed (--pod), fallbacks work; "
        "original_dst: any ip:port the EPP names, primary only",
    )
    parser.add_argument(
        "--epp-address",
        action="append",
        default=[],
        type=_address_arg,
        metavar="HOST:PORT",
        help="an EPP replica (repeat for several; a DNS name stands for every address it "
        "resolves to, e.g. a headless Service): health-checked, least request, retried on "
        "another replica when a stream cannot start. Replaces --epp-host/--epp-port.",
    )
    parser.add_argument(
        "--epp-plaintext",
        action="store_true",
        help="dial the EPP without TLS (an EPP started with --plaintext or "
        "server.secure_serving: false). Default: TLS, the certificate not verified "
        "unless --epp-ca-file is given",
    )
    parser.add_argument(
        "--epp-ca-file",
        "--epp-tls-ca",
        dest="epp_tls_ca",
        metavar="PATH",
        help="verify the EPP's certificate against this CA file (the EPP's server.tls)",
    )
    parser.add_argument(
        "--epp-sni",
        "--epp-tls-server-name",
        dest="epp_tls_server_name",
        metavar="NAME",
        help="with --epp-ca-file: the name the EPP's certificate must carry, sent as SNI "
        "when it is a host name (default: --epp-host)",
    )
    parser.add_argument("--epp-tls-cert", help="Envoy's client certificate (EPP with mTLS)")
    parser.add_argument("--epp-tls-key", help="the key of --epp-tls-cert")
    args = parser.parse_args(argv)
    if (args.epp_tls_cert is None) != (args.epp_tls_key is None):
        parser.error("--epp-tls-cert and --epp-tls-key go together")
    if args.epp_tls_ca is None and (args.epp_tls_cert or args.epp_tls_server_name):
        parser.error("--epp-sni and --epp-tls-cert/--epp-tls-key need --epp-ca-file")
    if args.epp_plaintext and args.epp_tls_ca is not None:
        parser.error("--epp-plaintext and --epp-ca-file exclude each other")
    epp_tls = None
    if args.epp_tls_ca is not None:
        epp_tls = EppTls(
            args.epp_tls_ca,
            args.epp_tls_server_name or args.epp_host,
            args.epp_tls_cert,
            args.epp_tls_key,
        )
    print(
        render(
            mode=args.mode,
            listen_port=args.listen_port,
            admin_port=args.admin_port,
            epp_port=args.epp_port if args.mode == "epp" else None,
            pods=args.pod,
            body_mode=args.body_mode,
            host=args.host,
            epp_host=args.epp_host,
            fail_open=args.fail_open,
            upstream_idle_timeout_s=args.upstream_idle_timeout,
            pod_cluster=args.pod_cluster,
            strip_headers=args.strip_header,
            keep_objective_headers=args.keep_objective_headers,
            epp_tls=epp_tls,
            epp_addresses=args.epp_address,
            epp_plaintext=args.epp_plaintext,
        ),
        end="",
    )
    return 0
