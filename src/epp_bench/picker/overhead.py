"""`epp bench overhead`: what the EPP costs per request.

1. In process: the hot path for a 4,096-token chat prompt over 64 pods (parse, tokenize,
   hash, index lookup, schedule, record) and each step alone, p50 and p99 over many
   iterations, with an index already holding many prefixes for every pod.
2. Through Envoy: the same simulated pods behind (a) Envoy + ext_proc + EPP and (b) a plain
   Envoy round-robin cluster. At concurrency 1: the latency the EPP adds. At saturation:
   requests/s of each, and the EPP's CPU per decision (from /proc), hence decisions/s per
   EPP core. The pods answer at once (no simulated GPU time), so the stack, not the pods,
   is what is measured.

The machine is shared and noisy: compare the two stacks measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from epp.app import connect
from epp.config import EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest, parse_request
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.scheduling.types import SchedulingRequest
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp_harness.stats import percentile

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


def through_envoy(pods: int, requests: int, saturation_concurrency: int) -> list[StackLoad]:
    from epp_harness.stack import LocalStack

    body = json.dumps(
        {"model": "sim-llama-8b", "prompt": _words(random.Random(1), 512), "max_tokens": 1}
    ).encode()
    results: list[StackLoad] = []
    for mode, label in (("round_robin", "Envoy round robin"), ("epp", "Envoy + EPP")):
        # The EPP logs at warning here: the INFO decision line costs CPU, and this measures
        # the picker; the INFO cost is in the in-process table's "whole decision" row.
        with LocalStack(
            pods=pods, mode=mode, sim_args=shlex.split(ZERO_TIME_PODS), log_level="warning"
        ) as stack:
            url = f"{stack.envoy_url}/v1/completions"
            for concurrency, count in ((1, requests), (saturation_concurrency, requests * 4)):
                epp_pid = stack.pids.get("epp")
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
                results.append(load)
                print(f"  {label}, concurrency {concurrency}: done", file=sys.stderr, flush=True)
    return results


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
        config = {"datalayer": {"scrape_interval_s": interval_ms / 1000}}
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


def _markdown(
    steps: list[StepTiming], loads: list[StackLoad], command: str, scrape: ScrapeCost | None = None
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
    if loads:
        lines += [
            "",
            "## Through Envoy (pods answer at once; 512-token prompt, 1 output token)",
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
        rr1, epp1 = by_key.get(("Envoy round robin", 1)), by_key.get(("Envoy + EPP", 1))
        if rr1 and epp1:
            lines += [
                "",
                f"Added by the EPP at concurrency 1: p50 {epp1.p50_ms - rr1.p50_ms:+.2f} ms, "
                f"p99 {epp1.p99_ms - rr1.p99_ms:+.2f} ms.",
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
    args = parser.parse_args(argv)
    command = "epp bench overhead " + shlex.join(argv)
    steps = in_process(args.pods, args.prompt_tokens, iterations=args.iterations)
    loads = (
        []
        if args.no_live
        else through_envoy(args.live_pods, args.live_requests, args.saturation_concurrency)
    )
    scrape = scraping(args.scrape_pods, args.scrape_seconds) if args.scrape_pods > 0 else None
    report = _markdown(steps, loads, command.strip(), scrape)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(report)
        args.out.with_suffix(".json").write_text(
            json.dumps(
                {
                    "steps": [asdict(s) for s in steps],
                    "loads": [asdict(r) for r in loads],
                    "scrape": asdict(scrape) if scrape else None,
                },
                indent=1,
            )
        )
    return 0
