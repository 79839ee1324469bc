"""The reference EPP's names for its series: buckets, label values, error codes and
flow-control outcomes, value for value (pkg/epp/metrics/metrics.go,
llm_d_router_metrics.go, pkg/common/error, flowcontrol/types)."""

from __future__ import annotations

from epp.addresses import AddressError, parse_host_port

# -- buckets: the reference's, value for value ------------------------------------------
GENERAL_LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
    8, 10, 15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200,
    1800, 2700, 3600,
)  # fmt: skip
REQUEST_SIZE_BUCKETS = (
    64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
    131072, 262144, 524288, 1048576, 2097152, 4194304, 8388608,
    16777216, 33554432, 67108864, 134217728, 268435456, 536870912, 1073741824,
)  # fmt: skip
RESPONSE_SIZE_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
)  # fmt: skip
INPUT_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
    131072, 262144, 524288, 1048576,
)  # fmt: skip
TTFT_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6,
    8, 10, 15, 20, 30, 45, 60, 120,
)  # fmt: skip
SHORT_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
QUEUE_DURATION_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)  # fmt: skip
HIT_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

# The reference's request headers naming the fairness flow (new name, then the GIE one),
# and the flow of requests that name none.
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
DEFAULT_FAIRNESS_ID = "default-flow"
# The reference's plugin that feeds the prefix-indexer and in-flight series: ours are
# the EPP's own prefix index and load accounting, named so here.
PREFIX_PLUGIN = ("prefix-index", "prefix-cache-scorer")
INFLIGHT_PRODUCER = "epp"
STATIC_POOL = "static"

# error_code values (the reference's pkg/common/error): by the HTTP status the EPP answered
# with, and ModelServerError for a pod's answer other than 200 (the reference's rule).
ERROR_CODES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    412: "PreconditionFailed",
    413: "BadRequest",
    429: "ResourceExhausted",
    500: "Internal",
    503: "ServiceUnavailable",
}
MODEL_SERVER_ERROR = "ModelServerError"
UNKNOWN_ERROR = "Unknown"

# Flow-control outcomes, the reference's names (flowcontrol/types QueueOutcome).
DISPATCHED = "Dispatched"
NOT_YET_FINALIZED = "NotYetFinalized"
REJECTED_CAPACITY = "RejectedCapacity"
REJECTED_OTHER = "RejectedOther"
EVICTED_TTL = "EvictedTTL"
EVICTED_CANCELLED = "EvictedContextCancelled"


def error_code(status: int) -> str:
    """The reference's error_code for an answer the EPP gave itself with this status."""
    return ERROR_CODES.get(status, UNKNOWN_ERROR)


def legacy(doc: str, current: str) -> str:
    """The help text of a deprecated twin, as the reference writes it."""
    return f"[Deprecated: Use {current}] {doc}"


def port_label(address: str) -> str:
    """The `port` label of an endpoint's `host:port` ("" if it has none: a label must not
    fail a request)."""
    try:
        return str(parse_host_port(address).port)
    except AddressError:
        return ""
