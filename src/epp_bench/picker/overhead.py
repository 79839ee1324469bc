"""`epp bench overhead`: what the EPP costs per request.

1. In process: the hot path for a 4,096-token chat prompt over 64 pods (parse, tokenize,
   hash, index lookup, schedule, record) and each step alone, p50 and p99 over many
   iterations, with an index already holding many prefixes for every pod.
2. Through Envoy: the same simulated pods behind (a) Envoy + ext_proc + EPP and (b) a plain
   Envoy round-robin cluster. At concurrency 1: the latency the EPP adds. At saturation:
   requests/s of each, and the EPP's CPU per decision (from /proc), hence decisions/s per
   EPP core. The pods answer at once (no simulated GPU time), so the stack, not the pods,
   is what is measured.

3. Before and after: steps 1 and the ext_proc server's CPU per request run in child
   processes against two codes, a frozen commit (`--before`, extracted as
   tools/bench/freeze_code.py does) and the work tree, alternately in one run
   (overhead_probe.py is the child). The ext_proc rows drive the real grpc.aio server with
   the messages Envoy sends for one routed request (routing stream: request headers and
   body; then the request's end, as an observer stream: request headers, response
   headers, end; or as one entry on the access-log stream, the generated configs'
   default) and read the server's CPU from /proc; a bare servicer answering the same
   messages with no work is the gRPC floor.

The machine is shared and noisy: compare the two stacks measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import aiohttp

from epp.app import connect
from epp.config import EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.envoy_config import Completions
from epp.observability.metrics import EppMetrics
from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest, parse_request
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import SchedulingRequest
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp_harness.stats import percentile

PROBE = Path(__file__).with_name("overhead_probe.py")
WORK_TREE_SRC = Path(__file__).resolve().parents[2]
REPO = WORK_TREE_SRC.parent

ZERO_TIME_PODS = (
    "--prefill-overhead-ms 0 --prefill-per-token-ms 0 --decode-per-token-ms 0 --max-num-seqs 256"
)


@dataclass(slots=True)
class StepTiming:
    step: str
    p50_us: float
    p99_us: float
    mean_us: float


def _time_step(name: str, fn: Callable[[], object], iterations: int) -> StepTiming:
    for _ in range(min(200, iterations)):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        start = clock()
        fn()
        samples.append((clock() - start) / 1000)
    return StepTiming(
        name,
        percentile(samples, 50) or 0.0,
        percentile(samples, 99) or 0.0,
        sum(samples) / len(samples),
    )


def _words(rng: random.Random, tokens: int) -> str:
    vocabulary = [f"w{n:03d}" for n in range(1000)]
    return " ".join(rng.choice(vocabulary) for _ in range(tokens * 4 // 5))


def in_process(
    pods: int = 64, prompt_tokens: int = 4096, prefixes_per_pod: int = 20, iterations: int = 2000
) -> list[StepTiming]:
    """Hot-path timings with a silent logger (INFO logging is measured separately live)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rng = random.Random(0)
    config = EppConfig.model_validate(
        {
            "endpoints": [
                {"name": f"pod-{i}", "address": f"10.0.{i // 250}.{i % 250 + 1}:8000"}
                for i in range(pods)
            ]
        }
    )
    store = EndpointStore(config.datalayer, clock=lambda: 0.0)
    store.sync(config.endpoints)
    for endpoint in store.all():
        store.scraped(
            endpoint, PodMetrics(model="m", kv_usage=rng.random() * 0.8, waiting=rng.randrange(5))
        )
    index = PrefixIndex(config.prefix.capacity_per_pod)
    tokenizer = ByteEstimateTokenizer()
    router = Router(config, store, index, Scheduler(config.scheduling), tokenizer, EppMetrics())
    connect(store, index, router, config)
    system = _words(rng, prompt_tokens)
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q?"}],
        }
    ).encode()
    # Every pod holds other prompts' blocks; one pod holds this prompt's.
    seed = chain_seed("m")
    for endpoint in store.all():
        for _ in range(prefixes_per_pod):
            other = tokenizer.encode(_words(rng, prompt_tokens // 4))
            index.record(endpoint.name, block_hashes(other, config.prefix.block_size, seed))
    request = parse_request("/v1/chat/completions", body, {})
    assert request.prompt.messages is not None
    tokens = tokenizer.encode_chat(request.prompt.messages)
    hashes = block_hashes(tokens, config.prefix.block_size, seed)
    index.record("pod-7", hashes)
    endpoints = store.all()
    scheduling_request = SchedulingRequest(
        request_id="bench",
        model="m",
        base_model="m",
        block_hashes=hashes,
        prefix_match=index.match(hashes),
    )

    def route() -> None:
        routed = router.route_now(
            IncomingRequest(path="/v1/chat/completions", body=body, request_id="bench")
        )
        router.complete(routed, 200)

    messages = request.prompt.messages
    steps = [
        ("parse JSON body", lambda: parse_request("/v1/chat/completions", body, {})),
        ("tokenize (byte estimate)", lambda: tokenizer.encode_chat(messages)),
        ("hash 256 blocks (xxh64)", lambda: block_hashes(tokens, 16, seed)),
        ("prefix index lookup", lambda: index.match(hashes)),
        (
            "filter + score + pick",
            lambda: router._scheduler.schedule(scheduling_request, endpoints),
        ),
        ("record blocks (approximate)", lambda: index.record("pod-7", hashes)),
        ("whole decision (Router.route)", route),
    ]
    timings = [_time_step(name, fn, iterations) for name, fn in steps]
    timings.append(StepTiming(f"index: {index.nodes} prefixes held", 0.0, 0.0, 0.0))
    return timings


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


@dataclass(slots=True)
class StackLoad:
    stack: str
    concurrency: int
    requests: int
    failed: int
    seconds: float
    p50_ms: float
    p99_ms: float
    requests_per_s: float
    epp_cpu_us_per_request: float | None = None
    decisions_per_epp_core_s: float | None = None


async def _drive(
    url: str, concurrency: int, requests: int, body: bytes
) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    failed = 0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal failed, next_index
            while next_index < requests:
                next_index += 1
                start = time.perf_counter()
                try:
                    async with session.post(
                        url, data=body, headers={"content-type": "application/json"}
                    ) as response:
                        await response.read()
                        if response.status != 200:
                            failed += 1
                except aiohttp.ClientError:
                    failed += 1
                latencies.append(time.perf_counter() - start)

        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 600)
        return latencies, failed, time.perf_counter() - started


@contextlib.contextmanager
def _children_import(code: Path | None) -> Iterator[None]:
    """Within the block, child processes import `epp` from `code` first; None: as they
    would anyway."""
    if code is None:
        yield
        return
    from epp_bench.live.frozen_code import children_import_from

    with children_import_from(str(code)):
        yield


def through_envoy(
    pods: int,
    requests: int,
    saturation_concurrency: int,
    before: Path | None = None,
    rounds: int = 3,
) -> list[StackLoad]:
    """Every stack started at once, warmed up, then driven in turn, round after round
    (each stack's rows: the median of each figure over the rounds), so that no stack is
    measured in a quieter or busier minute than another."""
    from epp_harness.stack import LocalStack

    body = json.dumps(
        {"model": "sim-llama-8b", "prompt": _words(random.Random(1), 512), "max_tokens": 1}
    ).encode()
    # The EPP learns of each request's end from Envoy's access log (the default) or from
    # the observer filter, one more ext_proc stream per request; the before code's row uses
    # the observer, which every earlier EPP serves.
    stacks: list[tuple[Literal["round_robin", "epp"], str, Path | None, Completions]] = [
        ("round_robin", "Envoy round robin", None, "access_log"),
        ("epp", "Envoy + EPP", None, "access_log"),
        ("epp", "Envoy + EPP (observer filter)", None, "observer"),
    ]
    if before is not None:
        stacks.append(("epp", "Envoy + EPP (before, observer filter)", before, "observer"))
    loads: dict[tuple[str, int], list[StackLoad]] = {}
    with contextlib.ExitStack() as running:
        started = []
        for mode, label, code, completions in stacks:
            # The EPP logs at warning here: the INFO decision line costs CPU, and this
            # measures the picker; the INFO cost is in the in-process "whole decision" row.
            with _children_import(code):
                stack = running.enter_context(
                    LocalStack(
                        pods=pods,
                        mode=mode,
                        sim_args=shlex.split(ZERO_TIME_PODS),
                        log_level="warning",
                        completions=completions,
                    )
                )
            url = f"{stack.envoy_url}/v1/completions"
            # Warm-up, unmeasured: connections, Envoy's streams to the EPP and the EPP's
            # first decisions.
            asyncio.run(_drive(url, 8, min(200, requests), body))
            started.append((label, stack, url))
        for round_ in range(rounds):
            for label, stack, url in started:
                for concurrency, count in ((1, requests), (saturation_concurrency, requests * 4)):
                    load = _stack_load(label, stack.pids.get("epp"), url, concurrency, count, body)
                    loads.setdefault((label, concurrency), []).append(load)
            print(
                f"  through Envoy: round {round_ + 1} of {rounds} done", file=sys.stderr, flush=True
            )
    return [_median_load(rows) for rows in loads.values()]


def _stack_load(
    label: str, epp_pid: int | None, url: str, concurrency: int, count: int, body: bytes
) -> StackLoad:
    cpu_before = _cpu_seconds(epp_pid) if epp_pid else None
    latencies, failed, seconds = asyncio.run(_drive(url, concurrency, count, body))
    load = StackLoad(
        stack=label,
        concurrency=concurrency,
        requests=count,
        failed=failed,
        seconds=seconds,
        p50_ms=(percentile(latencies, 50) or 0.0) * 1000,
        p99_ms=(percentile(latencies, 99) or 0.0) * 1000,
        requests_per_s=count / seconds,
    )
    if epp_pid and cpu_before is not None:
        cpu = _cpu_seconds(epp_pid) - cpu_before
        load.epp_cpu_us_per_request = cpu / count * 1e6
        load.decisions_per_epp_core_s = count / cpu if cpu > 0 else None
    return load


def _median_load(rows: list[StackLoad]) -> StackLoad:
    """One stack's row: the median over its rounds of each figure (failures summed)."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    first = rows[0]
    return StackLoad(
        stack=first.stack,
        concurrency=first.concurrency,
        requests=sum(r.requests for r in rows),
        failed=sum(r.failed for r in rows),
        seconds=sum(r.seconds for r in rows),
        p50_ms=statistics.median(r.p50_ms for r in rows),
        p99_ms=statistics.median(r.p99_ms for r in rows),
        requests_per_s=statistics.median(r.requests_per_s for r in rows),
        epp_cpu_us_per_request=median([r.epp_cpu_us_per_request for r in rows]),
        decisions_per_epp_core_s=median([r.decisions_per_epp_core_s for r in rows]),
    )


@dataclass(slots=True)
class ScrapeCost:
    pods: int
    interval_ms: float
    page_bytes: int
    seconds: float
    scrapes: int
    epp_cpu_cores: float  # CPU seconds of the EPP per wall second, while idle but scraping

    @property
    def cpu_us_per_scrape(self) -> float:
        return self.epp_cpu_cores * self.seconds / max(1, self.scrapes) * 1e6


FIXTURE_PAGE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "vllm-0.33-metrics.txt"


def scraping(pods: int, seconds: float, interval_ms: float = 50.0) -> ScrapeCost:
    """The EPP (a real `epp serve` process) scraping `pods` endpoints that serve a real
    vLLM 0.33 page, with no traffic: its CPU use is the cost of keeping metrics fresh."""
    import subprocess
    import tempfile
    import threading

    import yaml
    from aiohttp import web

    from epp_harness.stack import free_ports

    page = FIXTURE_PAGE.read_bytes() if FIXTURE_PAGE.exists() else b"vllm:num_requests_waiting 0\n"
    served = 0
    ports = free_ports(pods + 2)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def metrics(_: web.Request) -> web.Response:
        nonlocal served
        served += 1
        return web.Response(body=page, content_type="text/plain")

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports[:pods]:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = loop.run_until_complete(serve())
    thread = threading.Thread(target=lambda: (ready.set(), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait()
    with tempfile.TemporaryDirectory() as tmp:
        endpoints = {
            "endpoints": [
                {"name": f"pod-{i}", "address": f"127.0.0.1:{p}"}
                for i, p in enumerate(ports[:pods])
            ]
        }
        # Idle pods are scraped at the same interval: the page's cost per scrape is measured,
        # not the slower idle pacing (datalayer.scrape_idle_interval_s).
        interval_s = interval_ms / 1000
        config = {
            "datalayer": {"scrape_interval_s": interval_s, "scrape_idle_interval_s": interval_s}
        }
        (Path(tmp) / "endpoints.yaml").write_text(yaml.safe_dump(endpoints))
        (Path(tmp) / "epp.yaml").write_text(yaml.safe_dump(config))
        grpc_port, metrics_port = ports[pods:]
        process = subprocess.Popen(
            [sys.executable, "-m", "epp", "serve", "--config", f"{tmp}/epp.yaml", "--endpoints", f"{tmp}/endpoints.yaml",
             "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port), "--metrics-host", "127.0.0.1",
             "--metrics-port", str(metrics_port), "--grpc-health-port", "0", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            time.sleep(2.0)  # start-up and first scrapes
            cpu_before, served_before, started = _cpu_seconds(process.pid), served, time.monotonic()
            time.sleep(seconds)
            cpu = _cpu_seconds(process.pid) - cpu_before
            elapsed = time.monotonic() - started
            scrapes = served - served_before
        finally:
            process.terminate()
            process.wait(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.run_until_complete(runner.cleanup())
    loop.close()
    return ScrapeCost(pods, interval_ms, len(page), elapsed, scrapes, cpu / elapsed)


def frozen_src(revision: str) -> Path:
    """A commit's `src/`, extracted once under the bench directory (freeze_code.py)."""
    from epp_bench.live.bench_dir import BenchDir, default_bench_dir
    from epp_bench.live.frozen_code import freeze

    _, path = freeze(REPO, BenchDir(default_bench_dir()).code_root, revision)
    return path


def _probe_env(code: Path) -> dict[str, str]:
    # The child imports `epp` from `code` first (before the editable install).
    return {**os.environ, "PYTHONPATH": str(code)}


def probe_steps(
    code: Path,
    mode: str = "steps",
    pods: int = 64,
    prompt_tokens: int = 4096,
    iterations: int = 2000,
    log_level: str = "warning",
) -> list[StepTiming]:
    """overhead_probe.py's step timings (thread CPU) for the code under `code`."""
    done = subprocess.run(
        [sys.executable, "-P", str(PROBE), mode, "--pods", str(pods), "--prompt-tokens",
         str(prompt_tokens), "--iterations", str(iterations), "--log-level", log_level],
        env=_probe_env(code), capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"overhead_probe.py {mode} ({code}): {done.stderr.strip()[-2000:]}")
    return [StepTiming(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def _median_steps(rounds: list[list[StepTiming]]) -> list[StepTiming]:
    """Per step, the median over rounds of p50, p99 and mean."""
    out = []
    for i, first in enumerate(rounds[0]):
        rows = [r[i] for r in rounds]
        out.append(
            StepTiming(
                first.step,
                statistics.median(r.p50_us for r in rows),
                statistics.median(r.p99_us for r in rows),
                statistics.median(r.mean_us for r in rows),
            )
        )
    return out


def compared_steps(
    codes: dict[str, Path], rounds: int, pods: int, prompt_tokens: int, iterations: int
) -> dict[str, list[StepTiming]]:
    """Each code's steps, the codes alternating round by round; the INFO decision line
    priced by a run at INFO (its metrics-and-log part minus the same at WARNING)."""
    runs: dict[str, list[list[StepTiming]]] = {label: [] for label in codes}
    for _ in range(rounds):
        for label, code in codes.items():
            steps = probe_steps(code, "steps", pods, prompt_tokens, iterations)
            info = probe_steps(code, "parts", pods, prompt_tokens, iterations, "info")
            quiet = next(s for s in steps if s.step.startswith("decision's metrics"))
            line = max(0.0, info[0].mean_us - quiet.mean_us)
            steps.append(StepTiming("INFO decision line (at --log-level info)", line, line, line))
            runs[label].append(steps)
    return {label: _median_steps(r) for label, r in runs.items()}


@dataclass(slots=True)
class ExtProcCost:
    server: str
    requests: int
    cpu_us_per_request: float  # median over rounds
    rounds_us: list[float]


async def drive_ext_proc(
    port: int,
    requests: int,
    body: bytes,
    concurrency: int = 1,
    completions: Completions = "observer",
) -> int:
    """What Envoy sends the EPP for `requests` routed requests (module docstring, 3);
    returns how many were routed (a destination header came back). Each request's end is
    reported as Envoy reports it: an observer stream, or one entry on the access-log
    stream (one message an entry: Envoy batches entries only under load)."""
    import grpc
    from envoy.config.core.v3.address_pb2 import Address, SocketAddress
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
    from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from google.protobuf.struct_pb2 import Struct
    from google.protobuf.wrappers_pb2 import UInt32Value

    from epp_bench.picker.overhead_probe import envoy_headers

    def header_map(values: list[tuple[str, str]]) -> HeaderMap:
        return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values])

    attributes = Struct()
    attributes.update({"upstream.address": "10.0.0.8:8000"})
    routed = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        access_log = (
            als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
            if completions == "access_log"
            else None
        )

        async def logged(token: str) -> None:
            assert access_log is not None
            message = als_pb2.StreamAccessLogsMessage()
            entry = message.http_logs.log_entry.add()
            entry.request.request_headers["x-epp-route-token"] = token
            entry.response.response_code.CopyFrom(UInt32Value(value=200))
            entry.response.response_body_bytes = 512
            entry.common_properties.upstream_remote_address.CopyFrom(
                Address(socket_address=SocketAddress(address="10.0.0.8", port_value=8000))
            )
            await access_log.write(message)

        async def one(i: int) -> None:
            nonlocal routed
            headers = envoy_headers(len(body), f"req-{i}")
            first = pb.ProcessingRequest(
                request_headers=pb.HttpHeaders(headers=header_map(headers))
            )
            first.protocol_config.request_body_mode = (
                ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
            )
            first.protocol_config.response_body_mode = ProcessingMode.BodySendMode.NONE
            call = stub.Process()
            await call.write(first)
            await call.write(
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
            )
            await call.done_writing()
            token = ""
            async for reply in call:
                if reply.HasField("request_headers"):
                    routed += 1
                    for option in reply.request_headers.response.header_mutation.set_headers:
                        if option.header.key == "x-epp-route-token":
                            token = option.header.raw_value.decode()
            if access_log is not None:
                await logged(token)
                return
            observer = stub.Process(metadata=(("x-epp-stream", "observer"),))
            seen = [*headers, ("x-epp-route-token", token)]
            await observer.write(
                pb.ProcessingRequest(
                    request_headers=pb.HttpHeaders(headers=header_map(seen)),
                    observability_mode=True,
                )
            )
            answered = pb.ProcessingRequest(
                response_headers=pb.HttpHeaders(
                    headers=header_map([(":status", "200"), ("content-length", "512")])
                ),
                observability_mode=True,
            )
            answered.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
            await observer.write(answered)
            await observer.done_writing()
            async for _ in observer:
                pass

        next_index = 0

        async def worker() -> None:
            nonlocal next_index
            while next_index < requests:
                next_index += 1
                await one(next_index)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if access_log is not None:
            await access_log.done_writing()
            await access_log
    return routed


def ext_proc_cost(
    codes: dict[str, Path | None],
    requests: int,
    rounds: int,
    pods: int = 64,
    prompt_tokens: int = 4096,
    concurrency: int = 1,
    completions: dict[str, Completions] | None = None,
) -> list[ExtProcCost]:
    """Each server's CPU per routed request (its process's utime + stime over `requests`),
    the servers driven alternately, round by round. A code of None: the bare gRPC floor
    (served by the work tree's probe). `completions`: how each server is told of the
    request's end (default: the observer stream, which every EPP serves)."""
    ends = completions or {}
    from epp_bench.picker.overhead_probe import chat_body

    body = chat_body(prompt_tokens)
    servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    samples: dict[str, list[float]] = {label: [] for label in codes}
    try:
        for label, code in codes.items():
            command = [sys.executable, "-P", str(PROBE), "serve", "--pods", str(pods),
                       "--prompt-tokens", str(prompt_tokens)]  # fmt: skip
            if code is None:
                command.append("--bare")
            process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=_probe_env(code or WORK_TREE_SRC),
            )  # fmt: skip
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"overhead_probe.py serve ({label}) did not start")
            servers[label] = (process, json.loads(line)["port"])
            warm_up = drive_ext_proc(
                servers[label][1], min(200, requests), body, concurrency,
                ends.get(label, "observer"),
            )  # fmt: skip
            asyncio.run(warm_up)
        for _ in range(rounds):
            for label, (process, port) in servers.items():
                before = _cpu_seconds(process.pid)
                drive = drive_ext_proc(
                    port, requests, body, concurrency, ends.get(label, "observer")
                )
                routed = asyncio.run(drive)
                if routed != requests:
                    raise RuntimeError(f"{label}: {requests - routed} requests not routed")
                samples[label].append((_cpu_seconds(process.pid) - before) / requests * 1e6)
    finally:
        for process, _ in servers.values():
            if process.stdin is not None:
                process.stdin.close()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    return [
        ExtProcCost(label, requests, statistics.median(values), values)
        for label, values in samples.items()
    ]


SPLIT_PARTS = (
    ("protobuf (parse + serialize)", ("protobuf: parse", "protobuf: serialize")),
    ("ext_proc machine (and building its replies)", ("ext_proc machine",)),
    ("observer stream", ("observer stream",)),
    ("parse", ("parse JSON body",)),
    ("tokenize", ("tokenize",)),
    ("hash", ("hash blocks",)),
    ("lookup", ("prefix index lookup",)),
    ("score (filter + score + pick)", ("filter + score + pick",)),
    ("record", ("record blocks",)),
    ("metrics (and log calls) of the decision", ("decision's metrics",)),
    ("completion (accounting, metrics)", ("completion",)),
)


def split_rows(
    steps: list[StepTiming], total_us: float, floor_us: float
) -> list[tuple[str, float]]:
    """The server's CPU per request split: the gRPC floor, each measured part (means),
    the rest of the decision (whole decision minus its measured parts) and the rest of
    the server (asyncio tasks and generators around the messages)."""
    mean = {s.step: s.mean_us for s in steps}

    def part(prefixes: tuple[str, ...]) -> float:
        return sum(v for k, v in mean.items() if k.startswith(prefixes))

    rows = [("gRPC floor (grpc.aio, same messages, no work)", floor_us)]
    rows += [(name, part(prefixes)) for name, prefixes in SPLIT_PARTS]
    whole = part(("whole decision",))  # route_now + complete, as the step times it
    inside = part(("parse JSON", "tokenize", "hash blocks", "prefix index", "filter +",
                   "record blocks", "decision's metrics", "completion"))  # fmt: skip
    rows.append(
        ("rest of the decision (preparation, dispatch, accounting)", max(0.0, whole - inside))
    )
    measured = sum(v for _, v in rows[1:])
    rows.append(
        (
            "rest of the server (tasks, generators, streams)",
            max(0.0, total_us - floor_us - measured),
        )
    )
    return rows


# py-spy frames ("function (path:line)"), classified from the leaf up: the first rule a
# frame matches names the sample's part. Idle samples (the loop waiting in epoll, the
# probe's stdin reader) are dropped.
PROFILE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics", ("prometheus_client/", "(epp/observability/metrics", "(epp/observability/upstream",
                 "(epp/observability/stale", "(epp/observability/labels")),
    ("log", ("structlog/", "(epp/observability/logs", "(logging/")),
    ("protobuf (building replies, reading fields)", ("(epp/extproc/messages", "google/protobuf")),
    ("observer stream and completion", ("(epp/extproc/observer", "Router.complete ", "Accounting.complete ",
                                        "ExternalProcessor._observe ", "ExternalProcessor._complete ")),
    ("hash", ("(epp/prefix/hashing",)),
    ("tokenize", ("(epp/tokenization", "(epp/prefix/blocks")),
    ("parse", ("(epp/request/",)),
    ("record", ("(epp/prefix/approximate", "PrefixIndex.record ")),
    ("lookup", ("(epp/prefix/",)),
    ("score (filter + score + pick)", ("(epp/scheduling/",)),
    ("ext_proc machine", ("(epp/extproc/machine",)),
    ("rest of the decision (preparation, dispatch, accounting)", ("(epp/routing/", "(epp/datalayer/")),
)  # fmt: skip
GRPC_PART = "gRPC + asyncio (grpc.aio reads/writes, the loop, the server's stream glue)"


def profile_split(raw: Path) -> tuple[int, list[tuple[str, int]]]:
    """A py-spy `--format raw` profile of the EPP server split by PROFILE_RULES: (busy
    samples, [(part, samples)])."""
    parts: dict[str, int] = {}
    busy = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or frames[-1].startswith("EpollSelector.select") or "Thread.run " in stack:
            continue
        samples = int(count)
        busy += samples
        part = next(
            (
                name
                for frame in reversed(frames)
                for name, keys in PROFILE_RULES
                if any(key in frame for key in keys)
            ),
            GRPC_PART,
        )
        parts[part] = parts.get(part, 0) + samples
    return busy, sorted(parts.items(), key=lambda item: -item[1])


def profile_markdown(raw: Path) -> str:
    busy, parts = profile_split(raw)
    lines = [f"| part | samples | share of the busy {busy} |", "|---|---:|---:|"]
    lines += [f"| {name} | {n} | {n / max(1, busy) * 100:.1f}% |" for name, n in parts]
    return "\n".join(lines) + "\n"


def _compared_markdown(
    compared: dict[str, list[StepTiming]], edge: list[ExtProcCost], before_name: str
) -> list[str]:
    """The before/after tables and the split of the after's CPU per request."""
    lines: list[str] = []
    after = compared.get("after", [])
    before = {s.step: s for s in compared.get("before", [])}
    if after:
        lines += [
            "",
            f"## Before ({before_name}) and after (the work tree), one run",
            "",
            "Thread CPU per call in a child process per code, the codes alternating; the "
            "median over rounds of each figure (p50, mean).",
            "",
            "| step | before p50 (us) | after p50 (us) | before mean (us) | after mean (us) | after / before (mean) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for s in after:
            b = before.get(s.step)
            if b is None:
                lines.append(f"| {s.step} | | {s.p50_us:.1f} | | {s.mean_us:.1f} | |")
                continue
            ratio = f"{s.mean_us / b.mean_us:.2f}" if b.mean_us > 0 else ""
            lines.append(
                f"| {s.step} | {b.p50_us:.1f} | {s.p50_us:.1f} | {b.mean_us:.1f} | "
                f"{s.mean_us:.1f} | {ratio} |"
            )
    if edge:
        by = {e.server: e for e in edge}
        lines += [
            "",
            "## The real ext_proc gRPC server: CPU per routed request",
            "",
            "Each server in its own process (64 pods, the 4,096-token chat), driven over "
            "loopback gRPC with the messages Envoy sends for one routed request at "
            "concurrency 1; utime + stime from /proc, median over rounds (alternating).",
            "",
            "| server | requests per round | CPU per request (us), median | rounds (us) |",
            "|---|---:|---:|---|",
        ]
        for e in edge:
            rounds = ", ".join(f"{v:.0f}" for v in e.rounds_us)
            lines.append(f"| {e.server} | {e.requests} | {e.cpu_us_per_request:.0f} | {rounds} |")
        # The split of the default (access-log) arrangement, else of the only one given.
        floor = by.get("gRPC floor (bare servicer), access log") or by.get(
            "gRPC floor (bare servicer)"
        )
        total = by.get("EPP after, access log") or by.get("EPP after")
        if floor and total and after:
            lines += [
                "",
                "### Where the after's CPU per request goes",
                "",
                "The gRPC floor and the total from the table above; every other row is "
                "measured alone (the means of the table before); the two rests are what is "
                "left of the whole decision and of the server's total.",
                "",
                "| part | us per request | share |",
                "|---|---:|---:|",
            ]
            for name, value in split_rows(
                after, total.cpu_us_per_request, floor.cpu_us_per_request
            ):
                share = value / total.cpu_us_per_request * 100
                lines.append(f"| {name} | {value:.1f} | {share:.1f}% |")
    return lines


def _markdown(
    steps: list[StepTiming],
    loads: list[StackLoad],
    command: str,
    scrape: ScrapeCost | None = None,
    compared: dict[str, list[StepTiming]] | None = None,
    edge: list[ExtProcCost] | None = None,
    before_name: str = "",
) -> str:
    lines = [
        "# EPP overhead",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}. "
        "Regenerate with:",
        "",
        f"    {command}",
        "",
        "## In process: a 4,096-token chat prompt over 64 pods",
        "",
        "| step | p50 (us) | p99 (us) | mean (us) |",
        "|---|---:|---:|---:|",
    ]
    for s in steps:
        if s.p50_us == 0 and s.p99_us == 0:
            lines.append(f"| {s.step} | | | |")
        else:
            lines.append(f"| {s.step} | {s.p50_us:.1f} | {s.p99_us:.1f} | {s.mean_us:.1f} |")
    lines += _compared_markdown(compared or {}, edge or [], before_name)
    if loads:
        lines += [
            "",
            "## Through Envoy (pods answer at once; 512-token prompt, 1 output token)",
            "",
            "Every stack running at once, warmed up, driven in turn round after round "
            "(`--rounds`); each figure is the median over the rounds, requests and "
            "failures their sum.",
            "",
            "| stack | concurrency | requests | failed | p50 (ms) | p99 (ms) | req/s | EPP CPU per request (us) | decisions/s per EPP core |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in loads:
            cpu = f"{r.epp_cpu_us_per_request:.0f}" if r.epp_cpu_us_per_request else ""
            rate = f"{r.decisions_per_epp_core_s:.0f}" if r.decisions_per_epp_core_s else ""
            lines.append(
                f"| {r.stack} | {r.concurrency} | {r.requests} | {r.failed} | {r.p50_ms:.2f} | "
                f"{r.p99_ms:.2f} | {r.requests_per_s:.0f} | {cpu} | {rate} |"
            )
        by_key = {(r.stack, r.concurrency): r for r in loads}
        rr1 = by_key.get(("Envoy round robin", 1))
        for r in loads:
            if r.concurrency == 1 and r.stack.startswith("Envoy + EPP") and rr1:
                which = r.stack.removeprefix("Envoy + EPP").strip()
                lines += [
                    "",
                    f"Added by the EPP{' ' + which if which else ''} at concurrency 1: "
                    f"p50 {r.p50_ms - rr1.p50_ms:+.2f} ms, p99 {r.p99_ms - rr1.p99_ms:+.2f} ms.",
                ]
    if scrape is not None:
        expected = scrape.pods * scrape.seconds * 1000 / scrape.interval_ms
        lines += [
            "",
            f"## Keeping metrics fresh: {scrape.pods} pods scraped every {scrape.interval_ms:.0f} ms",
            "",
            f"Each pod serves a real vLLM 0.33 page ({scrape.page_bytes / 1024:.0f} KB); no traffic.",
            "",
            "| pods | scrapes/s (expected) | EPP CPU (cores) | CPU per scrape (us) | cores for 100 pods |",
            "|---:|---:|---:|---:|---:|",
            f"| {scrape.pods} | {scrape.scrapes / scrape.seconds:.0f} ({expected / scrape.seconds:.0f}) | "
            f"{scrape.epp_cpu_cores:.2f} | {scrape.cpu_us_per_scrape:.0f} | "
            f"{scrape.epp_cpu_cores * 100 / scrape.pods:.2f} |",
            "",
            "For comparison, the Go reference EPP's authors measured ~7.5 cores for 100 idle pods at "
            "the same interval.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="epp bench overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=64, help="pods in the in-process test")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--live-pods", type=int, default=2, help="pods behind Envoy")
    parser.add_argument("--live-requests", type=int, default=400, help="requests at concurrency 1")
    parser.add_argument("--saturation-concurrency", type=int, default=32)
    parser.add_argument("--no-live", action="store_true", help="skip the through-Envoy part")
    parser.add_argument("--scrape-pods", type=int, default=40, help="0 skips the scraping cost")
    parser.add_argument("--scrape-seconds", type=float, default=5.0)
    parser.add_argument(
        "--out", type=Path, help="write NAME.md and NAME.json here (e.g. docs/benchmarks/overhead)"
    )
    parser.add_argument(
        "--before",
        default="HEAD",
        help="the commit whose code is the before column (frozen as tools/bench/"
        "freeze_code.py does); 'none' skips it",
    )
    parser.add_argument("--rounds", type=int, default=3, help="before/after rounds, alternating")
    parser.add_argument(
        "--edge-requests", type=int, default=300, help="requests per round on the ext_proc server"
    )
    parser.add_argument(
        "--split-profile",
        type=Path,
        metavar="RAW",
        help="only split a py-spy --format raw profile of the EPP server (docs/benchmarks/"
        "overhead.md, Profile) into parts, and print it",
    )
    args = parser.parse_args(argv)
    if args.split_profile is not None:
        print(profile_markdown(args.split_profile))
        return 0
    command = "epp bench overhead " + shlex.join(argv)
    before = None if args.before == "none" else frozen_src(args.before)
    codes = (
        {"after": WORK_TREE_SRC} if before is None else {"before": before, "after": WORK_TREE_SRC}
    )
    compared = compared_steps(codes, args.rounds, args.pods, args.prompt_tokens, args.iterations)
    # Each request's end comes on an observer stream (what every EPP serves) or, with
    # `epp envoy-config`'s default since issue 17, as an access-log entry.
    servers: dict[str, Path | None] = {
        "gRPC floor (bare servicer), observer stream": None,
        "gRPC floor (bare servicer), access log": None,
    }
    ends: dict[str, Completions] = {"gRPC floor (bare servicer), access log": "access_log"}
    for label, code in codes.items():
        servers[f"EPP {label}, observer stream"] = code
        if label == "after":
            servers["EPP after, access log"] = code
            ends["EPP after, access log"] = "access_log"
    edge: list[ExtProcCost] = []
    if args.edge_requests > 0:
        edge = ext_proc_cost(
            servers, args.edge_requests, args.rounds, args.pods, args.prompt_tokens,
            completions=ends,
        )  # fmt: skip
    steps = compared["after"]
    loads = (
        []
        if args.no_live
        else through_envoy(
            args.live_pods, args.live_requests, args.saturation_concurrency, before, args.rounds
        )
    )
    scrape = scraping(args.scrape_pods, args.scrape_seconds) if args.scrape_pods > 0 else None
    before_name = "none" if before is None else f"{args.before} = {before.name[:12]}"
    report = _markdown(steps, loads, command.strip(), scrape, compared, edge, before_name)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(report)
        args.out.with_suffix(".json").write_text(
            json.dumps(
                {
                    "steps": [asdict(s) for s in steps],
                    "compared": {k: [asdict(s) for s in v] for k, v in compared.items()},
                    "ext_proc": [asdict(e) for e in edge],
                    "loads": [asdict(r) for r in loads],
                    "scrape": asdict(scrape) if scrape else None,
                },
                indent=1,
            )
        )
    return 0
