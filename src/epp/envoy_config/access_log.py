"""The gRPC access log that tells the EPP how each routed request ended (the default).

Envoy writes an entry when a request is done (response finished, client gone or reset) and
sends it to the EPP's AccessLogService (epp/extproc/access_log.py) over one long-lived
stream per Envoy worker: several entries a message under load, where the observer filter
(filters.observer_filter, `--completions observer`) costs one ext_proc stream per request,
about half of the gRPC work the EPP does per request (docs/benchmarks/overhead.md).

- The entry carries the route token because the logger is told to log that request
  header (the routing reply set it; a client's own is removed before any filter runs).
- An entry waits at most BUFFER_FLUSH_S in Envoy before it is sent: the EPP counts the
  request as in flight until then, so this is kept short (the observer's stream ended
  ~10 ms after the request: its `deferred_close_timeout`).
- BUFFER_BYTES is both when Envoy sends early and how much it keeps while the stream is
  backed up (an EPP busy elsewhere reads late): past it, entries are dropped
  (`logs_dropped`). Envoy's default, 16 KiB, is ~30-50 entries, a few milliseconds at
  thousands of completions a second; 1 MiB holds a few thousand, and the flush interval
  still sends them every 5 ms.
- The logger sends to CLUSTER, a copy of the EPP cluster (the same replicas, TLS, health
  checks and outlier detection) with connection pools of its own. Invariant: nothing the
  logger does touches a routing stream. When a replica dies the logger re-dials it at
  every flush until it is ejected; on a shared pool those failed connection attempts
  would fail the routing streams queued on it (fail-closed 500s right after a replica's
  SIGKILL, tests/replicas/test_envoy_replicas.py), and its long-lived stream would count
  as an open request of one routing replica under least request. A lost stream is
  reopened by Envoy; the entries of a stream that is down are dropped: those requests
  end by the EPP's page reconciliation or TTL, as with a lost observer stream.
"""

from __future__ import annotations

import copy
from typing import Any

from epp.envoy_config.names import ROUTE_TOKEN_HEADER

ACCESS_LOG_TYPE = (
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
)
BUFFER_FLUSH_S = 0.005
BUFFER_BYTES = 1024 * 1024
LOG_NAME = "epp-completions"
CLUSTER = "epp-completions"


def epp_access_log() -> dict[str, Any]:
    """The HTTP connection manager's access log entry that reports to the EPP."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": ACCESS_LOG_TYPE,
            "common_config": {
                "log_name": LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": CLUSTER}},
                "buffer_flush_interval": f"{BUFFER_FLUSH_S}s",
                "buffer_size_bytes": BUFFER_BYTES,
            },
            "additional_request_headers_to_log": [ROUTE_TOKEN_HEADER],
        },
    }


def access_log_cluster(epp: dict[str, Any]) -> dict[str, Any]:
    """The logger's own copy of the EPP cluster `epp` (see the module docstring)."""
    cluster = copy.deepcopy(epp)
    cluster["name"] = CLUSTER
    if "load_assignment" in cluster:
        cluster["load_assignment"]["cluster_name"] = CLUSTER
    return cluster
