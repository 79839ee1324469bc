"""The clusters of the pods: static (baselines), override_host (the EPP's list of known
pods) or ORIGINAL_DST (any address the EPP names); and the shared cluster pieces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.addresses import parse_host_port
from epp.envoy_config.names import DESTINATION_HEADER

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
# descriptor limit: one Envoy carries 10,000 concurrent streams with these
# (docs/benchmarks/streams.md). GIE's standalone chart raises them to 40,000.
CIRCUIT_BREAKER_MAX = 2**32 - 1


def socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def circuit_breakers() -> dict[str, Any]:
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
    return [{"endpoint": {"address": socket_address(a.host, a.port)}} for a in parsed]


def static_cluster(name: str, addresses: Sequence[str], lb_policy: str, http2: bool) -> dict:
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


def _outlier_detection() -> dict[str, Any]:
    """Eject a pod after consecutive 5xx / gateway failures (connect failure, reset, timeout).

    The override_host policy still honours the EPP's choice of an ejected pod as primary
    (Envoy 1.40), so this does not fight the EPP; what it adds is Envoy's own view for its
    retries and for fail-open balancing while the EPP catches up."""
    return {
        "consecutive_5xx": 5,
        "consecutive_gateway_failure": 3,
        "interval": "5s",
        "base_ejection_time": "15s",
        "max_ejection_percent": 50,
    }


_OVERRIDE_HOST_TYPE = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
_ROUND_ROBIN_TYPE = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)


def override_host_cluster(pods: Sequence[str]) -> dict[str, Any]:
    """Known pods, routed to the address the EPP names; the rest of its list on retry.

    Envoy's override_host policy reads the EPP's comma list (primary, then fallbacks) from
    the envoy.lb metadata (a client cannot forge it), then from the header. An address
    that is not a member of the cluster is never dialled: a stray value cannot send traffic
    outside the pool. (ORIGINAL_DST answers 503 to a comma list on Envoy 1.40.)
    """
    cluster = static_cluster("pods", pods, "ROUND_ROBIN", False)
    del cluster["lb_policy"]
    source_path = [{"key": DESTINATION_HEADER}]
    round_robin = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": {"@type": _ROUND_ROBIN_TYPE},
        }
    }
    override_host = {
        "@type": _OVERRIDE_HOST_TYPE,
        "override_host_sources": [
            {"metadata": {"key": "envoy.lb", "path": source_path}},
            {"header": DESTINATION_HEADER},
        ],
        # Used only when no override is present (EPP bypassed, fail-open).
        "fallback_policy": {"policies": [round_robin]},
    }
    cluster["load_balancing_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": override_host,
                }
            }
        ]
    }
    cluster["outlier_detection"] = _outlier_detection()
    return cluster


def original_dst_cluster() -> dict[str, Any]:
    """Any address the EPP names (pods not known to Envoy); one address, no fallbacks."""
    return {
        "name": "pods",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "1s",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
