"""Response ends from Envoy's gRPC access log (epp/extproc/access_log.py): what an entry
says becomes the completion the observer stream would have reported, and the real server
takes the access-log stream beside ext_proc."""

from __future__ import annotations

import asyncio
import time

import grpc
from envoy.config.core.v3.address_pb2 import Address, SocketAddress
from envoy.data.accesslog.v3 import accesslog_pb2 as entries
from envoy.service.accesslog.v3 import als_pb2 as pb
from envoy.service.accesslog.v3 import als_pb2_grpc as pb_grpc
from extproc.fakes import FakeRouter
from google.protobuf.duration_pb2 import Duration
from google.protobuf.wrappers_pb2 import UInt32Value

from epp.config import ServerConfig
from epp.extproc.access_log import completion, completions
from epp.extproc.server import ExternalProcessor, HealthState, build_grpc_server
from epp.observability.metrics import EppMetrics


def entry(
    token: str | None = "tok-1",
    code: int | None = 200,
    upstream: tuple[str, int] | None = ("10.0.0.7", 8000),
    first_ms: int | None = 40,
    last_ms: int | None = 1040,
    body_bytes: int = 512,
) -> entries.HTTPAccessLogEntry:
    e = entries.HTTPAccessLogEntry()
    if token is not None:
        e.request.request_headers["x-epp-route-token"] = token
    e.request.request_headers["x-other"] = "kept out"
    if code is not None:
        e.response.response_code.CopyFrom(UInt32Value(value=code))
    e.response.response_body_bytes = body_bytes
    common = e.common_properties
    if upstream is not None:
        host, port = upstream
        common.upstream_remote_address.CopyFrom(
            Address(socket_address=SocketAddress(address=host, port_value=port))
        )
    if first_ms is not None:
        common.time_to_first_upstream_rx_byte.CopyFrom(Duration(nanos=first_ms * 1_000_000))
    if last_ms is not None:
        common.time_to_last_downstream_tx_byte.CopyFrom(
            Duration(seconds=last_ms // 1000, nanos=(last_ms % 1000) * 1_000_000)
        )
    return e


def test_the_first_byte_is_placed_from_the_streams_whole_duration_when_logged():
    """A client that reset the stream has no last byte sent; the entry's duration (start
    to end, set on every final entry) places the first byte all the same."""
    e = entry(first_ms=40, last_ms=None)
    e.common_properties.duration.CopyFrom(Duration(seconds=2, nanos=40_000_000))
    done = completion(e, received_at=100.0)
    assert done is not None and abs(done.first_byte_at - 98.0) < 1e-9  # type: ignore[operator]


def test_an_entry_becomes_the_completion_the_observer_would_report():
    done = completion(entry(), received_at=100.0)
    assert done is not None
    assert (done.token, done.status, done.served_address, done.response_bytes) == (
        "tok-1", 200, "10.0.0.7:8000", 512,
    )  # fmt: skip
    # The first byte came 1.0 s before the last (the entry arrives at the end).
    assert done.first_byte_at is not None and abs(done.first_byte_at - 99.0) < 1e-9


def test_what_an_entry_may_lack():
    # Not routed by the EPP (no token): not ours.
    assert completion(entry(token=None), 1.0) is None
    assert completion(entry(token=""), 1.0) is None
    # No response at all (client gone, reset): no status, no bytes, no first byte.
    bare = completion(entry(code=None, first_ms=None, body_bytes=0), 1.0)
    assert bare is not None and (bare.status, bare.response_bytes, bare.first_byte_at) == (
        None, None, None,
    )  # fmt: skip
    assert completion(entry(code=0), 1.0).status is None  # type: ignore[union-attr]
    # No upstream: Envoy answered itself (no healthy host, an ext_proc failure after the
    # destination was applied): no pod's status, nothing counted against the pick.
    local = completion(entry(upstream=None, code=503), 1.0)
    assert local is not None and (local.served_address, local.status) == (None, None)
    assert local.response_bytes is None
    # An IPv6 upstream is bracketed as pods are.
    v6 = completion(entry(upstream=("fd00::7", 8000)), 1.0)
    assert v6 is not None and v6.served_address == "[fd00::7]:8000"


def test_only_the_entry_of_the_requests_end_completes_it():
    """A logger configured to log more (a request's start, periodic entries while it
    streams, an upstream attempt's end) sends entries before the request ends: only the
    end (DownstreamEnd, or an unset type from an Envoy that does not set it) counts."""
    kinds = entries.AccessLogType
    for kind in ("NotSet", "DownstreamEnd"):
        e = entry()
        e.common_properties.access_log_type = kinds.Value(kind)
        assert completion(e, 1.0) is not None, kind
    for kind in ("DownstreamStart", "DownstreamPeriodic", "UpstreamPoolReady", "UpstreamEnd"):
        e = entry()
        e.common_properties.access_log_type = kinds.Value(kind)
        assert completion(e, 1.0) is None, kind
    periodic = entry()
    periodic.common_properties.intermediate_log_entry = True  # the older marker
    assert completion(periodic, 1.0) is None


def test_a_message_of_several_entries_and_a_tcp_message():
    message = pb.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend([entry("a"), entry(None), entry("b", code=503)])
    found = completions(message)
    assert [(c.token, c.status) for c in found] == [("a", 200), ("b", 503)]
    tcp = pb.StreamAccessLogsMessage()
    tcp.tcp_logs.log_entry.add()
    assert completions(tcp) == []


def test_the_server_takes_the_access_log_stream_beside_ext_proc():
    """Envoy's logger opens one long stream: entries of several messages are completed in
    order, a completion that fails in the router does not end the stream, and the stream's
    end is OK."""

    async def scenario() -> FakeRouter:
        router = FakeRouter()
        config = ServerConfig(grpc_host="127.0.0.1", grpc_port=0, secure_serving=False)
        server, port = build_grpc_server(
            ExternalProcessor(router, config, EppMetrics()), HealthState(), config
        )
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.AccessLogServiceStub(channel)
                first = pb.StreamAccessLogsMessage()
                first.identifier.log_name = "epp-completions"
                first.http_logs.log_entry.extend([entry("a"), entry("b", code=404)])
                broken = pb.StreamAccessLogsMessage()  # a completion the router refuses
                broken.http_logs.log_entry.extend([entry("explode")])
                last = pb.StreamAccessLogsMessage()
                last.http_logs.log_entry.extend([entry("c", upstream=("10.0.0.9", 8001))])
                answer = await stub.StreamAccessLogs(iter([first, broken, last]))
                assert isinstance(answer, pb.StreamAccessLogsResponse)
        finally:
            await server.stop(None)
        return router

    original = FakeRouter.complete

    def complete(self, token, status, *rest):
        if token == "explode":
            raise RuntimeError("bookkeeping failed")
        return original(self, token, status, *rest)

    FakeRouter.complete = complete  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        router = asyncio.run(scenario())
    finally:
        FakeRouter.complete = original  # type: ignore[method-assign]
    assert time.perf_counter() - started < 30
    assert router.completed == [
        ("a", 200, "10.0.0.7:8000"),
        ("b", 404, "10.0.0.7:8000"),
        ("c", 200, "10.0.0.9:8001"),
    ]
