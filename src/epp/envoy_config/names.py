"""Names and limits every part of the rendered Envoy configuration shares."""

from __future__ import annotations

from typing import Literal

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
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
TLS_TYPE = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"

BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
Mode = Literal["epp", "round_robin", "least_request"]
PodCluster = Literal["override_host", "original_dst"]
# How the EPP learns that a request ended (envoy_config/access_log.py, filters.observer_filter).
Completions = Literal["access_log", "observer"]

# A hung pod fails its attempt after this long without a byte (see listener.render).
UPSTREAM_IDLE_TIMEOUT_S = 120.0
# A buffered request body must fit in the listener's buffer, or Envoy answers 413.
BUFFER_LIMIT_BYTES = 32 * 1024 * 1024
