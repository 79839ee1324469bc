"""The cluster of the EPP: one address or several replicas, and how Envoy dials it (TLS
verified against a CA, TLS unverified as the EPP's self-signed default, or plaintext)."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epp.addresses import format_host_port, is_ip_address, parse_host_port
from epp.envoy_config.names import TLS_TYPE
from epp.envoy_config.pod_clusters import static_cluster

# Several EPP replicas (--epp-address, twice or more; README "High availability"): how fast
# Envoy stops sending routing streams to a replica that died or drains.
EPP_HEALTH_INTERVAL_S = 0.5
EPP_HEALTH_TIMEOUT_S = 0.25


@dataclass(frozen=True)
class EppTls:
    """Envoy verifies the EPP's certificate (the EPP's `server.tls` files): `ca_file`
    signed it, and it must name `server_name` (a DNS name, also sent as SNI, or an IP);
    `cert_file`/`key_file` are Envoy's client certificate when the EPP requires one.
    Without an EppTls Envoy still dials TLS, verifying nothing (see epp_cluster)."""

    ca_file: str
    server_name: str
    cert_file: str | None = None
    key_file: str | None = None


def epp_cluster(
    *,
    epp_host: str,
    epp_port: int | None,
    epp_addresses: Sequence[str],
    epp_tls: EppTls | None,
    epp_plaintext: bool,
) -> dict[str, Any]:
    """The `epp` cluster: the replicas of `epp_addresses`, else `epp_host:epp_port`,
    dialled over TLS verified by `epp_tls`, else unverified TLS, else (`epp_plaintext`)
    plaintext."""
    if epp_addresses:
        cluster = _replicas_cluster(epp_addresses)
    else:
        assert epp_port is not None  # render checks it
        cluster = static_cluster("epp", [format_host_port(epp_host, epp_port)], "ROUND_ROBIN", True)
    if epp_tls is not None:
        cluster["transport_socket"] = _verified_transport_socket(epp_tls)
    elif not epp_plaintext:
        cluster["transport_socket"] = _unverified_transport_socket()
    return cluster


def _unverified_transport_socket() -> dict[str, Any]:
    """TLS that accepts any certificate: the EPP's self-signed default, as Envoy AI
    Gateway and kgateway dial it. Encrypted, not authenticated: use EppTls where the
    network between Envoy and the EPP is not trusted. ALPN h2: gRPC servers need it, and
    Envoy's health checker offers none of its own."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {"@type": TLS_TYPE, "common_tls_context": {"alpn_protocols": ["h2"]}},
    }


def _verified_transport_socket(tls: EppTls) -> dict[str, Any]:
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
    context: dict[str, Any] = {"@type": TLS_TYPE, "common_tls_context": common}
    if sni is not None:
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _replicas_cluster(addresses: Sequence[str]) -> dict[str, Any]:
    """The EPP replicas as one cluster, each replica taken out as soon as it cannot route.

    - gRPC health checks of the `readiness` service every 0.5 s (also with no traffic):
      one failure takes a replica out (a SIGKILLed one refuses the connection, a draining
      one answers NOT_SERVING), one success brings it back;
    - the routing filter retries a stream that cannot start on another replica, and
      outlier detection ejects a replica on its first connect failure or reset, ahead of
      the next health check: least request would otherwise keep choosing the dead
      replica (it has no open streams) until then;
    - no panic mode: Envoy's default balances over every replica, the dead included, once
      half of them are unhealthy (1 of 2 is enough), which would send a dead replica half
      the routing streams;
    - least request: a slow replica collects open streams and gets fewer new ones. With
      the observer filter, round robin alternates the two streams of each request,
      routing and observer, between two replicas: with sequential requests one replica
      routes all of them (121 of 121 in two runs; least request splits them 65/56 and
      58/63). A separate cluster for the observer streams does not change the split, so
      there is one. The access log has its own copy of this cluster
      (envoy_config/access_log.py): its long-lived stream is not an open request here.
    A name among `addresses` (a Kubernetes headless Service) makes the cluster STRICT_DNS:
    every address it resolves to is a replica."""
    cluster = static_cluster("epp", addresses, "LEAST_REQUEST", True)
    if not all(is_ip_address(parse_host_port(address).host) for address in addresses):
        cluster["type"] = "STRICT_DNS"
        cluster["dns_refresh_rate"] = "5s"
        cluster["respect_dns_ttl"] = True
    cluster["health_checks"] = [
        {
            "timeout": f"{EPP_HEALTH_TIMEOUT_S}s",
            "interval": f"{EPP_HEALTH_INTERVAL_S}s",
            "no_traffic_interval": f"{EPP_HEALTH_INTERVAL_S}s",
            # Two missed checks, not one: a replica that answers one check late (a GC
            # pause, a throttled CPU) would otherwise leave with the others gone, and with
            # no healthy replica Envoy fails every request closed. A killed replica is
            # ejected at once by outlier detection (its connection is refused); a draining
            # one leaves within two intervals.
            "unhealthy_threshold": 2,
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
    # The streams a dead replica refused are retried on another. Every client's stream
    # retries at once when a replica dies, so Envoy's default of 3 retries in flight per
    # cluster fails the rest (several requests per SIGKILL at 8 clients); with the
    # ejection above and the circuit breakers (pod_clusters) lifting max_retries with the
    # rest, none fail.
    return cluster
