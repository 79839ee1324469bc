"""The HTTP filters in front of the router: the routing ext_proc filter (asks the EPP for
the destination), the observer (tells the EPP how each request ended), and the early
header mutation that strips what only the EPP may set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epp.envoy_config.names import (
    EXT_PROC_TYPE,
    OBSERVER_METADATA,
    ROUTE_TOKEN_HEADER,
    BodyMode,
)

_PREVIOUS_HOSTS_TYPE = (
    "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
)
_HEADER_MUTATION_TYPE = (
    "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3."
    "HeaderMutation"
)


def ext_proc_filter(
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
        # ahead of the client's trailers, and a body-less request ended by trailers sends
        # no body message at all; only the trailers message lets the EPP answer it (with
        # SKIP it would reach a pod Envoy picks, without the EPP's decision).
        "request_trailer_mode": "SEND",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    grpc_service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"}
    if replicas:
        grpc_service["retry_policy"] = _replica_retry_policy()
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": EXT_PROC_TYPE,
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


def _replica_retry_policy() -> dict[str, Any]:
    """A stream that cannot start on one replica (refused, reset with no answer yet)
    starts on another, never the same one twice."""
    return {
        "retry_on": "connect-failure,refused-stream,reset,unavailable",
        "num_retries": 2,
        "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _PREVIOUS_HOSTS_TYPE},
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }


def observer_filter() -> dict:
    """The second filter: tells the EPP how each routed request ended.

    Observability mode (Envoy never waits for an answer) and fail-open (its loss never
    fails a request). The request headers carry the route token the routing reply set, and
    open the stream at once, so a request that never gets a response is reported too.
    The response headers carry the status and, as attributes, the upstream that served.
    Envoy 1.40 sends no trailers message when the upstream sends none, so the end of this
    stream is the end of the response (trailers stay SEND for upstreams that do send
    them)."""
    return {
        "name": "epp-observer",
        "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "epp"},
                "initial_metadata": [{"key": OBSERVER_METADATA[0], "value": OBSERVER_METADATA[1]}],
            },
            "failure_mode_allow": True,
            "observability_mode": True,
            # Envoy closes its side this long after the request ends (~0.3 s by default);
            # until then the EPP counts the request as in flight, which skews the very
            # next decision for a back-to-back conversation.
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


def router_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }


def early_header_removal(names: Sequence[str]) -> list[dict[str, Any]]:
    """HCM early header mutation: runs ahead of route selection and every HTTP filter."""
    return [
        {
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _HEADER_MUTATION_TYPE,
                "mutations": [{"remove": name} for name in names],
            },
        }
    ]
