"""Response ends from Envoy's gRPC access log: the cheaper way to learn how requests ended.

The observer filter (observer.py) opens one ext_proc stream per request, about half of
the gRPC work the EPP does per request (docs/benchmarks/overhead.md). Envoy's HTTP gRPC
access logger instead sends every finished request's entry over one long-lived stream per
Envoy worker, several entries a message under load (`epp envoy-config` configures it:
envoy_config/access_log.py). An entry is written when the request is done (response
finished, client gone or reset), and carries what the observer read:

- the route token, as the request header the routing reply set (logged because the
  logger is told to: `additional_request_headers_to_log`);
- the status (`response_code`; absent or 0 when no response started);
- the upstream that served (`upstream_remote_address`: the fallback when Envoy retried);
- the response's bytes, and when its first byte came (`time_to_first_upstream_rx_byte`,
  from the request's start, turned into this process's clock below).

An entry without a route token (a request the EPP did not route) is skipped. The token
is read from the request headers as Envoy holds them when it logs: a route that removed
`x-epp-route-token` (`request_headers_to_remove`) would hide it; the generated configs do
not. Sans-I/O:
`completions` turns one message into the completions to report; `AccessLogReceiver` is the
gRPC service that hands them on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog
from envoy.data.accesslog.v3 import accesslog_pb2 as entries_pb
from envoy.service.accesslog.v3 import als_pb2 as pb
from envoy.service.accesslog.v3 import als_pb2_grpc as pb_grpc

from epp.addresses import format_host_port
from epp.extproc.messages import ROUTE_TOKEN_HEADER
from epp.extproc.observer import Completion

log = structlog.get_logger("epp.extproc")


def _seconds(duration: object) -> float | None:
    """A protobuf Duration field as seconds (None when unset)."""
    seconds = getattr(duration, "seconds", 0) + getattr(duration, "nanos", 0) / 1e9
    return seconds if seconds > 0 else None


# The entries that mark a request's end: DownstreamEnd, or NotSet from an Envoy that does
# not fill the type in. A logger asked for more (HCM `flush_access_log_on_new_request`,
# `access_log_flush_interval`, a router's upstream log) also writes DownstreamStart,
# DownstreamPeriodic or Upstream* entries while the request runs: not its end.
_END_TYPES = frozenset({entries_pb.AccessLogType.NotSet, entries_pb.AccessLogType.DownstreamEnd})


def completion(entry: entries_pb.HTTPAccessLogEntry, received_at: float) -> Completion | None:
    """One finished request's completion (None: not routed by the EPP, or an entry written
    while the request still runs). `received_at` is time.perf_counter() when the entry
    arrived: the final entry is written at the request's end."""
    token = entry.request.request_headers.get(ROUTE_TOKEN_HEADER)
    if not token:
        return None
    common = entry.common_properties
    if common.intermediate_log_entry or common.access_log_type not in _END_TYPES:
        return None
    served = None
    if common.upstream_remote_address.HasField("socket_address"):
        socket = common.upstream_remote_address.socket_address
        served = format_host_port(socket.address, socket.port_value) if socket.address else None
    # A status only when a pod was reached: Envoy's own answer before any upstream (no
    # healthy host, an ext_proc failure after the destination was applied) is not the
    # pod's, and must not count against it (the observer never saw such answers either).
    code = 0
    if served is not None and entry.response.HasField("response_code"):
        code = entry.response.response_code.value
    first_byte_at = None
    first = _seconds(common.time_to_first_upstream_rx_byte)
    # From the stream's start to its end (set on every final entry, a client's reset
    # included), else to the last byte sent: how long before the entry's arrival the
    # first byte came (the arrival is up to the 5 ms flush later than the end).
    end = _seconds(common.duration) or _seconds(common.time_to_last_downstream_tx_byte)
    if first is not None and end is not None and end >= first:
        first_byte_at = received_at - (end - first)
    return Completion(
        token, code or None, served, first_byte_at,
        entry.response.response_body_bytes if code else None,
    )  # fmt: skip


def completions(message: pb.StreamAccessLogsMessage) -> list[Completion]:
    """The completions of one access-log message (HTTP entries; TCP entries are not ours)."""
    if not message.HasField("http_logs"):
        return []
    now = time.perf_counter()
    found = (completion(entry, now) for entry in message.http_logs.log_entry)
    return [c for c in found if c is not None]


class AccessLogReceiver(pb_grpc.AccessLogServiceServicer):
    """Envoy's access-log streams: each entry's completion goes to `complete` (the same
    call the observer streams make: ExternalProcessor.complete)."""

    def __init__(self, complete: Callable[[Completion], None]) -> None:
        self._complete = complete

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[pb.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> pb.StreamAccessLogsResponse:
        async for message in request_iterator:
            try:
                found = completions(message)
            except Exception:  # one malformed message never ends Envoy's stream
                log.exception("access_log_unreadable")
                continue
            for done in found:
                self._complete(done)
        return pb.StreamAccessLogsResponse()
