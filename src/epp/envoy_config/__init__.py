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

# Modules: `listener` (render: the listener, route and connection manager), `filters`
# (routing ext_proc, observer, header stripping), `pod_clusters` and `epp_cluster` (the
# two upstreams), `names` (shared headers and limits), `cli` (the command line).

from epp.envoy_config.cli import main
from epp.envoy_config.epp_cluster import EPP_HEALTH_INTERVAL_S, EPP_HEALTH_TIMEOUT_S, EppTls
from epp.envoy_config.listener import render
from epp.envoy_config.names import (
    BUFFER_LIMIT_BYTES,
    DESTINATION_HEADER,
    OBJECTIVE_HEADERS,
    OBSERVER_METADATA,
    REQUEST_ID_RESPONSE_HEADER,
    ROUTE_TOKEN_HEADER,
    STRIPPED_HEADERS,
    UPSTREAM_IDLE_TIMEOUT_S,
    BodyMode,
    Completions,
    Mode,
    PodCluster,
)
from epp.envoy_config.pod_clusters import CIRCUIT_BREAKER_MAX

__all__ = [
    "BUFFER_LIMIT_BYTES",
    "CIRCUIT_BREAKER_MAX",
    "DESTINATION_HEADER",
    "EPP_HEALTH_INTERVAL_S",
    "EPP_HEALTH_TIMEOUT_S",
    "OBJECTIVE_HEADERS",
    "OBSERVER_METADATA",
    "REQUEST_ID_RESPONSE_HEADER",
    "ROUTE_TOKEN_HEADER",
    "STRIPPED_HEADERS",
    "UPSTREAM_IDLE_TIMEOUT_S",
    "BodyMode",
    "Completions",
    "EppTls",
    "Mode",
    "PodCluster",
    "main",
    "render",
]
