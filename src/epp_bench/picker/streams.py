"""`epp bench streams`: thousands of streaming generations held open at once through the
real stack (Envoy + `epp serve` + slow simulated pods on loopback).

Each request is a streamed completion that lasts longer than it takes to open all of
them, so every one of them is in flight at the same time: one downstream connection, one
pod connection and one observer stream to the EPP each. What the run shows: how many were
measurably in flight at once (Envoy's `cluster.pods.upstream_rq_active`, the EPP's
in-flight gauges, the client's own count), the 5xx and other failures, the EPP's and
Envoy's RSS and CPU, and that the EPP's in-flight counts return to zero at the end.

Limits raised for it: RLIMIT_NOFILE of this process (its children inherit it) up to what
the streams need (the hard limit too when running as root); Envoy's circuit breakers are
the ones `epp envoy-config` renders (lifted, see epp.envoy_config); nothing else of
Envoy's needed raising (it has no overload manager configured, so no connection cap).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from epp_harness.sse import read_stream
from epp_harness.stack import DEFAULT_MODEL, LocalStack

DEFAULT_STREAMS = 10_000
# The EPP's in-flight counts, per pod: ours and the upstream name (docs/metrics.md).
IN_FLIGHT_SERIES = ("epp_pod_in_flight_requests", "llm_d_epp_inflight_requests")
# One count per request whose end the observer filter reported.
COMPLETIONS_SERIES = "llm_d_epp_request_duration_seconds"
ENVOY_STATS_FILTER = "upstream_rq_active|overflow|downstream_rq_5xx|ext_proc|upstream_cx_active"


def slow_pod_args(streams_per_pod: int, decode_ms: float) -> list[str]:
    """A pod that runs every stream it gets at once (no queue, no KV pressure), each token
    `decode_ms` apart whatever the batch (the streams must outlast the ramp)."""
    return [
        "--max-num-seqs", str(streams_per_pod),
        "--max-waiting", str(streams_per_pod),
        "--num-gpu-blocks", str(max(4096, streams_per_pod * 8)),
        "--batch-slowdown", "0",
        "--prefill-per-token-ms", "0.01",
        "--decode-per-token-ms", str(decode_ms),
        "--log-level", "warning",
    ]  # fmt: skip


def epp_config(streams_per_pod: int) -> str:
    # The pods run this many at once (their max_num_seqs): the EPP then counts none of the
    # streams it dispatched as queued, so nothing waits in admission.
    return f"scheduling: {{running_slots: {streams_per_pod}}}\n"


def raise_fd_limit(needed: int) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE (soft, and hard when allowed) to at least `needed` if possible;
    children started afterwards inherit it. Returns the (soft, hard) now in force."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        try:
            ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            ceiling = needed
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, ceiling),) * 2)
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    else:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def parse_envoy_stats(text: str) -> dict[str, int]:
    """Envoy's /stats text ("name: value" lines), counters and gauges only."""
    stats: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().lstrip("-").isdigit():
            stats[name.strip()] = int(value)
    return stats


@dataclass(slots=True)
class EppCounts:
    in_flight: dict[str, float]  # series name -> sum over pods
    completions: float  # requests whose end the observer reported


def parse_epp_counts(text: str) -> EppCounts:
    in_flight = dict.fromkeys(IN_FLIGHT_SERIES, 0.0)
    completions = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in in_flight:
                in_flight[sample.name] += sample.value
            elif sample.name == f"{COMPLETIONS_SERIES}_count" and sample.labels.get("model_name"):
                completions += sample.value  # requests naming no model are not ours
    return EppCounts(in_flight, completions)


async def envoy_stats(session: aiohttp.ClientSession, admin_url: str) -> dict[str, int]:
    url = f"{admin_url}/stats?filter={ENVOY_STATS_FILTER}"
    async with session.get(url) as response:
        return parse_envoy_stats(await response.text())


async def epp_counts(session: aiohttp.ClientSession, metrics_url: str) -> EppCounts:
    async with session.get(metrics_url) as response:
        return parse_epp_counts(await response.text())


def _proc(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of one process, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm_kib = int(line.split()[1])
    return cpu_s, hwm_kib / 1024


@dataclass(slots=True)
class StreamsResult:
    streams: int
    ok: int = 0  # 200 and the stream ended with [DONE]
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # transport errors, bad streams
    client_in_flight: int = 0
    peak_client_in_flight: int = 0
    peak_envoy_pods_active: int = 0
    peak_envoy_epp_active: int = 0
    peak_epp_in_flight: dict[str, float] = field(default_factory=dict)
    ramp_s: float = 0.0
    run_s: float = 0.0
    settle_s: float | None = None  # last stream ended -> EPP in-flight back to 0
    end_in_flight: dict[str, float] = field(default_factory=dict)
    completions_observed: float = 0.0
    envoy_end: dict[str, int] = field(default_factory=dict)  # non-zero stats at the end
    cpu_s: dict[str, float] = field(default_factory=dict)
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    fd_limit: int = 0
    peak_fds: dict[str, int] = field(default_factory=dict)  # open descriptors per process

    @property
    def five_xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def to_json(self) -> dict:
        data = asdict(self)
        data["statuses"] = {str(k): v for k, v in self.statuses.items()}
        data["errors"] = dict(self.errors)
        data["five_xx"] = self.five_xx
        return data


async def _one_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    result: StreamsResult,
    all_started: asyncio.Event | None,
    started: list[int],
) -> None:
    counted = False
    try:
        async with session.post(url, json=body) as response:
            result.statuses[response.status] += 1
            if response.status != 200:
                await response.read()
                started[0] += 1
                return
            first = await response.content.readline()
            result.client_in_flight += 1
            result.peak_client_in_flight = max(
                result.peak_client_in_flight, result.client_in_flight
            )
            counted = True
            started[0] += 1
            if all_started is not None:
                if started[0] >= result.streams:
                    all_started.set()
                await all_started.wait()

            async def lines() -> AsyncIterator[bytes]:  # the first line was read above
                yield first
                async for line in response.content:
                    yield line

            stream = await read_stream(lines(), time.monotonic())
            if stream.done and stream.error is None:
                result.ok += 1
            else:
                result.errors[stream.error or "ended without [DONE]"] += 1
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.errors[type(exc).__name__] += 1
        started[0] += 1
    finally:
        if counted:
            result.client_in_flight -= 1
        if all_started is not None and started[0] >= result.streams:
            all_started.set()


class _H2Stream:
    __slots__ = ("body", "ended", "first_data", "headers")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.headers: asyncio.Future[int] = loop.create_future()  # the :status
        self.first_data: asyncio.Future[None] = loop.create_future()
        self.ended: asyncio.Future[bool] = loop.create_future()  # True: ended, False: reset
        self.body = bytearray()

    def fail(self, exc: BaseException) -> None:
        for future in (self.headers, self.first_data, self.ended):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: a stream that failed early awaits no more


class H2Connection(asyncio.Protocol):
    """One HTTP/2 cleartext (prior knowledge) connection to Envoy carrying many streams.

    Why not HTTP/1.1: each of its streams costs Envoy a downstream and an upstream socket,
    and 10,000 of each exceed an RLIMIT_NOFILE of 20,000 that only CAP_SYS_RESOURCE may
    raise. Over HTTP/2 the downstream side is a few connections; each stream still reaches
    its pod on a connection of its own (the pods speak HTTP/1.1)."""

    def __init__(self, authority: str) -> None:
        import h2.config
        import h2.connection

        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        self.authority = authority.encode()
        self.streams: dict[int, _H2Stream] = {}
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(2**30)
        self.conn.update_settings({0x4: 2**20})  # INITIAL_WINDOW_SIZE per stream
        transport.write(self.conn.data_to_send())

    def request(self, path: str, body: bytes) -> _H2Stream:
        if self.lost is not None or self.transport is None:
            raise ConnectionError(f"HTTP/2 connection lost: {self.lost}")
        stream_id = self.conn.get_next_available_stream_id()
        stream = _H2Stream(asyncio.get_running_loop())
        self.streams[stream_id] = stream
        headers = [
            (b":method", b"POST"), (b":path", path.encode()), (b":scheme", b"http"),
            (b":authority", self.authority), (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]  # fmt: skip
        self.conn.send_headers(stream_id, headers)
        self.conn.send_data(stream_id, body, end_stream=True)
        self.transport.write(self.conn.data_to_send())
        return stream

    def data_received(self, data: bytes) -> None:
        import h2.events

        for event in self.conn.receive_data(data):
            stream = self.streams.get(getattr(event, "stream_id", 0))
            if isinstance(event, h2.events.ResponseReceived) and stream is not None:
                status = dict(event.headers).get(b":status", b"0")
                stream.headers.set_result(int(status))
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if stream is not None:
                    stream.body += event.data
                    if not stream.first_data.done():
                        stream.first_data.set_result(None)
            elif isinstance(event, h2.events.StreamEnded) and stream is not None:
                self.streams.pop(event.stream_id, None)
                if not stream.first_data.done():
                    stream.first_data.set_result(None)
                stream.ended.set_result(True)
            elif isinstance(event, h2.events.StreamReset) and stream is not None:
                self.streams.pop(event.stream_id, None)
                stream.fail(ConnectionResetError(f"stream reset (error {event.error_code})"))
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.connection_lost(ConnectionError(f"GOAWAY {event.error_code}"))
        if self.transport is not None:
            self.transport.write(self.conn.data_to_send())

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("closed")
        for stream in self.streams.values():
            stream.fail(self.lost)
        self.streams.clear()


async def _one_stream_h2(
    connection: H2Connection,
    path: str,
    body: bytes,
    result: StreamsResult,
    started: list[int],
) -> None:
    counted = False
    try:
        stream = connection.request(path, body)
        status = await stream.headers
        result.statuses[status] += 1
        if status != 200:
            started[0] += 1
            await stream.ended
            return
        await stream.first_data
        result.client_in_flight += 1
        result.peak_client_in_flight = max(result.peak_client_in_flight, result.client_in_flight)
        counted = True
        started[0] += 1
        await stream.ended

        async def lines() -> AsyncIterator[bytes]:
            for line in bytes(stream.body).split(b"\n"):
                yield line

        read = await read_stream(lines(), time.monotonic())
        if read.done and read.error is None:
            result.ok += 1
        else:
            result.errors[read.error or "ended without [DONE]"] += 1
    except (ConnectionError, OSError) as exc:
        result.errors[type(exc).__name__] += 1
        if not counted:
            started[0] += 1
    finally:
        if counted:
            result.client_in_flight -= 1


async def hold_streams(
    stack: LocalStack,
    streams: int,
    *,
    rate: float,
    max_tokens: int,
    all_started: asyncio.Event | None = None,
    sample_every_s: float = 1.0,
    settle_timeout_s: float = 30.0,
    h2_connections: int = 0,
    pids: dict[str, int] | None = None,
) -> StreamsResult:
    """Open `streams` streamed completions at `rate` per second through Envoy and read them
    to the end, sampling Envoy's and the EPP's counts meanwhile; then wait (up to
    `settle_timeout_s`) for the EPP's in-flight counts to return to zero.

    With `all_started`, every stream stops reading after its first line until all have
    one (or failed): then all of them are in flight at once, whatever the timing.
    With `h2_connections`, the streams share that many HTTP/2 connections to Envoy
    (H2Connection) instead of one HTTP/1.1 connection each."""
    if h2_connections and all_started is not None:
        raise ValueError("all_started is for HTTP/1.1 streams")
    assert stack.epp_metrics_url is not None
    result = StreamsResult(streams)
    url = f"{stack.envoy_url}/v1/completions"
    body = {"model": stack.model, "prompt": "Count slowly.", "max_tokens": max_tokens}
    body |= {"stream": True, "ignore_eos": True}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60, sock_read=120)
    started = [0]
    done = asyncio.Event()

    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as probe,
    ):

        async def sample() -> None:
            while not done.is_set():
                try:
                    stats = await envoy_stats(probe, stack.envoy_admin_url)
                    counts = await epp_counts(probe, stack.epp_metrics_url or "")
                except (TimeoutError, aiohttp.ClientError):
                    stats, counts = {}, None
                result.peak_envoy_pods_active = max(
                    result.peak_envoy_pods_active, stats.get("cluster.pods.upstream_rq_active", 0)
                )
                result.peak_envoy_epp_active = max(
                    result.peak_envoy_epp_active, stats.get("cluster.epp.upstream_rq_active", 0)
                )
                for name, pid in (pids or {}).items():
                    with contextlib.suppress(OSError):
                        fds = len(os.listdir(f"/proc/{pid}/fd"))
                        result.peak_fds[name] = max(result.peak_fds.get(name, 0), fds)
                if counts is not None:
                    for name, value in counts.in_flight.items():
                        peak = result.peak_epp_in_flight.get(name, 0.0)
                        result.peak_epp_in_flight[name] = max(peak, value)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), sample_every_s)

        sampler = asyncio.create_task(sample())
        h2: list[H2Connection] = []
        host, _, port = stack.envoy_url.removeprefix("http://").rpartition(":")
        loop = asyncio.get_running_loop()
        for _ in range(h2_connections):
            _, protocol = await loop.create_connection(
                lambda: H2Connection(f"{host}:{port}"), host, int(port)
            )
            h2.append(protocol)
        payload = json.dumps(body).encode()
        begin = time.monotonic()
        tasks = []
        batch = max(1, int(rate / 50))  # one batch every 20 ms
        for index in range(0, streams, batch):
            for offset in range(min(batch, streams - index)):
                if h2:
                    connection = h2[(index + offset) % len(h2)]
                    job = _one_stream_h2(connection, "/v1/completions", payload, result, started)
                else:
                    job = _one_stream(session, url, body, result, all_started, started)
                tasks.append(asyncio.create_task(job))
            delay = begin + (index + batch) / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        result.ramp_s = time.monotonic() - begin
        await asyncio.gather(*tasks)
        ended = time.monotonic()
        for connection in h2:
            if connection.transport is not None:
                connection.transport.close()
        result.run_s = ended - begin
        done.set()
        await sampler
        deadline = ended + settle_timeout_s
        while True:
            counts = await epp_counts(probe, stack.epp_metrics_url)
            result.end_in_flight = counts.in_flight
            result.completions_observed = counts.completions
            if not any(counts.in_flight.values()):
                result.settle_s = time.monotonic() - ended
                break
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        stats = await envoy_stats(probe, stack.envoy_admin_url)
        result.envoy_end = {k: v for k, v in sorted(stats.items()) if v}
    return result


def render_markdown(result: StreamsResult, args: argparse.Namespace, command: str) -> str:
    epp_peak = ", ".join(f"`{k}` {v:,.0f}" for k, v in result.peak_epp_in_flight.items())
    end = ", ".join(f"`{k}` {v:,.0f}" for k, v in result.end_in_flight.items())
    settle = f"{result.settle_s:.2f} s" if result.settle_s is not None else "never (30 s)"
    rows = [
        ("streaming generations opened", f"{result.streams:,} ({args.rate:g}/s)"),
        ("client connections to Envoy", f"{args.h2_connections} HTTP/2" if args.h2_connections else "one HTTP/1.1 each"),
        ("answered 200 and ended with [DONE]", f"{result.ok:,}"),
        ("5xx", f"{result.five_xx:,}"),
        ("statuses", ", ".join(f"{k}: {v:,}" for k, v in sorted(result.statuses.items()))),
        ("client errors", ", ".join(f"{k}: {v}" for k, v in result.errors.items()) or "none"),
        ("peak in flight, client (first chunk read, end not yet)", f"{result.peak_client_in_flight:,}"),
        ("peak in flight, Envoy `cluster.pods.upstream_rq_active`", f"{result.peak_envoy_pods_active:,}"),
        ("peak streams to the EPP, Envoy `cluster.epp.upstream_rq_active`", f"{result.peak_envoy_epp_active:,}"),
        ("peak in flight, EPP", epp_peak),
        ("EPP in-flight at the end", f"{end} (zero {settle} after the last stream ended)"),
        ("completions the observer reported", f"{result.completions_observed:,.0f}"),
        ("time (ramp / whole run)", f"{result.ramp_s:.0f} s / {result.run_s:.0f} s"),
        ("EPP: CPU / peak RSS", f"{result.cpu_s.get('epp', 0):.1f} s / {result.peak_rss_mib.get('epp', 0):.0f} MiB"),
        ("Envoy: CPU / peak RSS", f"{result.cpu_s.get('envoy', 0):.1f} s / {result.peak_rss_mib.get('envoy', 0):.0f} MiB"),
        ("pods (sum): CPU", f"{result.cpu_s.get('pods', 0):.1f} s"),
        ("client (this process): CPU / peak RSS", f"{result.cpu_s.get('client', 0):.1f} s / {result.peak_rss_mib.get('client', 0):.0f} MiB"),
        ("RLIMIT_NOFILE; peak open fds Envoy / EPP", f"{result.fd_limit:,}; {result.peak_fds.get('envoy', 0):,} / {result.peak_fds.get('epp', 0):,}"),
    ]  # fmt: skip
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    envoy = ", ".join(f"`{k}` {v:,}" for k, v in result.envoy_end.items())
    return f"| measure | value |\n|---|---|\n{table}\n\nEnvoy's non-zero stats at the end: {envoy}\n\nCommand: `{command}`\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp bench streams", description=__doc__)
    parser.add_argument("--streams", type=int, default=DEFAULT_STREAMS)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--rate", type=float, default=100.0, help="streams opened per second")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per generation")
    parser.add_argument(
        "--decode-ms",
        type=float,
        default=10000.0,
        help="ms between two tokens of a stream (with --max-tokens: each generation's length)",
    )
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument(
        "--h2-connections",
        type=int,
        default=16,
        help="the streams share this many HTTP/2 connections to Envoy (needs the h2 "
        "package); 0: one HTTP/1.1 connection per stream (Envoy then needs two sockets a "
        "stream: more than an RLIMIT_NOFILE of 20,000 allows at 10,000 streams)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--work-dir", type=Path, help="keep the processes' logs here")
    parser.add_argument("--markdown", type=Path, help="write the figures here as a table")
    args = parser.parse_args(argv)
    per_pod = -(-args.streams // args.pods) + 16
    # Envoy: one socket per stream to its pod, and one from the client over HTTP/1.1.
    soft, _ = raise_fd_limit((1 if args.h2_connections else 2) * args.streams + 4096)
    generation_s = args.max_tokens * args.decode_ms / 1000
    ramp_s = args.streams / args.rate
    if generation_s <= ramp_s:
        print(
            f"warning: a generation ({generation_s:.0f} s) is shorter than the ramp "
            f"({ramp_s:.0f} s): not all streams will be in flight at once",
            file=sys.stderr,
        )
    command = "epp bench streams " + " ".join(argv)
    print(f"fd limit {soft}; {args.streams} streams at {args.rate:g}/s over {args.pods} pods, "
          f"each {generation_s:.0f} s long", flush=True)  # fmt: skip
    client_cpu_0 = time.process_time()
    with LocalStack(
        pods=args.pods,
        sim_args=slow_pod_args(per_pod, args.decode_ms),
        epp_config_yaml=epp_config(per_pod),
        envoy_concurrency=args.envoy_concurrency,
        log_level="warning",
        model=DEFAULT_MODEL,
        startup_timeout_s=60.0,
        work_dir=args.work_dir,
    ) as stack:
        pids = stack.pids
        result = asyncio.run(
            hold_streams(
                stack,
                args.streams,
                rate=args.rate,
                max_tokens=args.max_tokens,
                h2_connections=args.h2_connections,
                pids={"envoy": pids["envoy"], "epp": pids["epp"]},
            )
        )
        for name in ("epp", "envoy"):
            result.cpu_s[name], result.peak_rss_mib[name] = _proc(pids[name])
        result.cpu_s["pods"] = sum(_proc(pid)[0] for n, pid in pids.items() if n.startswith("pod"))
    result.cpu_s["client"] = time.process_time() - client_cpu_0
    result.peak_rss_mib["client"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result.fd_limit = soft
    text = render_markdown(result, args, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    clean = result.five_xx == 0 and result.ok == result.streams and result.settle_s is not None
    return 0 if clean else 1
