"""`render`: the Envoy bootstrap for one listener in front of the pods, fronted by the EPP
(mode `epp`) or balanced by Envoy alone (the `round_robin` / `least_request` baselines)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from epp.envoy_config.access_log import access_log_cluster, epp_access_log
from epp.envoy_config.epp_cluster import EppTls, epp_cluster
from epp.envoy_config.filters import (
    early_header_removal,
    ext_proc_filter,
    observer_filter,
    router_filter,
)
from epp.envoy_config.names import (
    BUFFER_LIMIT_BYTES,
    OBJECTIVE_HEADERS,
    REQUEST_ID_RESPONSE_HEADER,
    STRIPPED_HEADERS,
    UPSTREAM_IDLE_TIMEOUT_S,
    BodyMode,
    Completions,
    Mode,
    PodCluster,
)
from epp.envoy_config.pod_clusters import (
    circuit_breakers,
    original_dst_cluster,
    override_host_cluster,
    socket_address,
    static_cluster,
)

_HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)


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
    completions: Completions = "access_log",
) -> str:
    """The Envoy bootstrap YAML for one listener in front of the pods.

    The EPP is dialled over TLS: verified against `epp_tls` when given, else unverified
    (the EPP's self-signed default); `epp_plaintext` for an EPP serving plaintext. The EPP
    learns how requests ended from Envoy's gRPC access log (`completions`), or from the
    observer filter."""
    if epp_plaintext and epp_tls is not None:
        raise ValueError("epp_plaintext and epp_tls exclude each other")
    route: dict[str, Any] = {"cluster": "pods", "timeout": f"{request_timeout_s}s"}
    if mode == "epp":
        if epp_port is None and not epp_addresses:
            raise ValueError("mode 'epp' needs epp_port or epp_addresses")
        http_filters = [
            ext_proc_filter(body_mode, message_timeout_s, fail_open, bool(epp_addresses))
        ]
        if completions == "observer":
            http_filters.append(observer_filter())
        route["retry_policy"] = _pod_retry_policy(pod_cluster, upstream_idle_timeout_s)
        epp = epp_cluster(
            epp_host=epp_host,
            epp_port=epp_port,
            epp_addresses=epp_addresses,
            epp_tls=epp_tls,
            epp_plaintext=epp_plaintext,
        )
        clusters = [_pods_for_the_epp(pod_cluster, pods), epp]
        if completions == "access_log":
            clusters.append(access_log_cluster(epp))
    else:
        if not pods:
            raise ValueError(f"mode {mode!r} needs the pod addresses")
        lb = "ROUND_ROBIN" if mode == "round_robin" else "LEAST_REQUEST"
        http_filters, clusters = [], [static_cluster("pods", pods, lb, False)]
    for cluster in clusters:
        cluster["circuit_breakers"] = circuit_breakers()
    http_filters.append(router_filter())
    idle_s = _stream_idle_s(route, request_timeout_s, upstream_idle_timeout_s)
    hcm = _connection_manager(route, http_filters, idle_s)
    if mode == "epp" and completions == "access_log":
        hcm["access_log"] = [epp_access_log()]
    if mode == "epp":
        stripped = [*STRIPPED_HEADERS, *(() if keep_objective_headers else OBJECTIVE_HEADERS)]
        stripped += [h.lower() for h in strip_headers if h.lower() not in stripped]
        _add_epp_headers(hcm, stripped)
    return yaml.safe_dump(_bootstrap(host, admin_port, listen_port, hcm, clusters), sort_keys=False)


def _pod_retry_policy(pod_cluster: PodCluster, upstream_idle_timeout_s: float) -> dict[str, Any]:
    """A pod that accepted the request but sends nothing (hung) fails this attempt after
    the idle timeout instead of holding the client for the whole request timeout. Idle
    means no byte at all: a non-streamed answer sends nothing until it is done, so this
    must exceed the longest non-streamed generation. With override_host, a refused
    connection or a hung pod moves on to the next address of the EPP's list
    (scheduling.fallbacks > 0); ORIGINAL_DST reads one address, so a retry would dial the
    same pod again."""
    retry_on = "connect-failure,refused-stream,reset-before-request"
    if pod_cluster == "override_host":
        retry_on += ",gateway-error"
    return {
        "retry_on": retry_on,
        "num_retries": 3 if pod_cluster == "override_host" else 0,
        "per_try_idle_timeout": f"{upstream_idle_timeout_s}s",
    }


def _pods_for_the_epp(pod_cluster: PodCluster, pods: Sequence[str]) -> dict[str, Any]:
    if pod_cluster == "override_host":
        if not pods:
            raise ValueError("pod_cluster 'override_host' needs the pod addresses")
        return override_host_cluster(pods)
    return original_dst_cluster()


def _stream_idle_s(
    route: dict[str, Any], request_timeout_s: float, upstream_idle_timeout_s: float
) -> float:
    """The stream's idle timeout outlasts every attempt's own, or no retry could happen."""
    if "retry_policy" not in route:
        return request_timeout_s
    attempts = route["retry_policy"]["num_retries"] + 1
    return min(request_timeout_s, upstream_idle_timeout_s * attempts + 5.0)


def _connection_manager(
    route: dict[str, Any], http_filters: list[dict[str, Any]], stream_idle_s: float
) -> dict[str, Any]:
    return {
        "@type": _HCM_TYPE,
        "stat_prefix": "llm",
        # No byte either way for this long ends the request. It also bounds the one hang
        # fail-open cannot cure: in FULL_DUPLEX_STREAMED the body is already inside the
        # ext_proc filter when an EPP stops answering, and on Envoy 1.40 neither
        # message_timeout nor the gRPC timeout ends such a request.
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


def _add_epp_headers(hcm: dict[str, Any], stripped: Sequence[str]) -> None:
    """Strip what only the EPP may set; echo the id the EPP logs each decision under
    (Envoy's x-request-id). The routing stream has ended by the time the response comes,
    so Envoy echoes it itself."""
    hcm["early_header_mutation_extensions"] = early_header_removal(stripped)
    virtual_host = hcm["route_config"]["virtual_hosts"][0]
    virtual_host["response_headers_to_add"] = [
        {
            "header": {"key": REQUEST_ID_RESPONSE_HEADER, "value": "%REQ(x-request-id)%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]


def _bootstrap(
    host: str, admin_port: int, listen_port: int, hcm: dict[str, Any], clusters: list[dict]
) -> dict[str, Any]:
    hcm_filter = {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
    return {
        "admin": {"address": socket_address(host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "llm",
                    "address": socket_address(host, listen_port),
                    "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
                    "filter_chains": [{"filters": [hcm_filter]}],
                }
            ],
            "clusters": clusters,
        },
    }
