"""`epp bench loop`: what background work on the routing loop costs routing decisions.

Everything the EPP does runs on one asyncio loop. This benchmark routes real decisions
(`Router.route_now` + `complete`, the components `EppService` builds and wires) open-loop
at `--rate` per second over a fleet of `--fleet` pods, and measures each decision's
latency from its scheduled start (so time spent waiting for the loop counts), while one
kind of background work runs, either on the loop (as the product does it) or off it:

- `kv`: a KV-event storm. A publisher process runs `--kv-publishers` (default: one per
  followed pod) vLLM-layout publishers (`vllm_sim.kv_publisher`, real ZMQ PUB), each
  sending BlockStored batches of `--blocks` blocks `--batches` times a second, to
  `--kv-pods` followed pods. On the loop: the product's `PreciseMode` (one
  `KvEventSubscriber` per pod) with `SubscriberSettings.receive_in_thread` False:
  receive, decode and apply on the loop. Off (the default): every pod's live socket is
  read and decoded by one shared thread (kv_subscriber/hub.py); the loop applies (the
  index has one owner: the loop) and keeps the sequence bookkeeping.
- `relist`: a Kubernetes relist of `--fleet` pods every `--relist-ms`. A thread parses
  the list body (`json.loads`, as `Reflector._list` does in its thread), then
  `endpoints_for_pool` and `EndpointStore.sync` (20 pods flap between lists). On the
  loop: both on the loop (as `KubernetesDiscovery._drain` does). Off: `endpoints_for_pool`
  in the thread, only `sync` on the loop (the store owns Endpoint state).
- `pages`: a client thread fetches `/metrics` and `/debug/endpoints` over HTTP every
  `--pages-ms`. On the loop: both rendered on the loop. Off: each in a worker thread.
- `metrics`: the client fetches `/metrics` alone: on the loop; `off` as the service
  serves it (collected on the loop, encoded in a worker thread); `thread` all of it in
  a worker thread (for comparison: not safe in the product).
- `frozen` arms: `off` with the heap collected and frozen (gc.freeze) at the phase's
  start, as `epp serve` does once started.

Phases are interleaved (idle, then each load on and off) and repeated `--repeats` times,
side by side in one run: the machine is shared, so only figures of one run compare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from epp.app import EppService
from epp.config import EndpointConfig, EppConfig
from epp.datalayer.discovery.pool import MetricsLocation, endpoints_for_pool, standalone_pool
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.kv_subscriber import LABEL_ENDPOINT, LABEL_REPLAY
from epp.datalayer.metrics_parser import PodMetrics
from epp.request import IncomingRequest
from epp_harness.stats import percentile

SELECTOR = "app=vllm"
FLAPPING = 20  # pods Ready in one relist, not in the next


@dataclass(slots=True)
class Settings:
    fleet: int = 1000
    rate: float = 50.0
    phase_s: float = 3.0
    repeats: int = 3
    kv_pods: int = 64
    kv_publishers: int = 0  # 0: one per followed pod; else pods share them round-robin
    batches: float = 20.0  # per pod per second
    blocks: int = 32  # per batch
    relist_ms: float = 500.0
    pages_ms: float = 250.0
    prompt_tokens: int = 1024


@dataclass(slots=True)
class PhaseResult:
    load: str
    where: str  # "-" (idle), "on", "off"
    repeat: int
    decisions: int
    p50_us: float
    p99_us: float
    max_us: float
    work: dict[str, float] = field(default_factory=dict)


# --- the fleet and the router ------------------------------------------------------------


def _pod_ip(i: int) -> str:
    return f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}"


def fleet_config(settings: Settings, kv_ports: list[int]) -> EppConfig:
    endpoints = []
    for i in range(settings.fleet):
        labels = {"app": "vllm"}
        if i < len(kv_ports):
            labels[LABEL_ENDPOINT] = f"tcp://127.0.0.1:{kv_ports[i]}"
            labels[LABEL_REPLAY] = ""
        endpoints.append(
            {
                "name": f"pod-{i:04d}",
                "address": f"{_pod_ip(i)}:8000",
                "model": "m",
                "labels": labels,
            }
        )
    return EppConfig.model_validate(
        {
            "endpoints": endpoints,
            "server": {"metrics_host": "127.0.0.1", "metrics_port": 0, "debug_port": 0},
            "kv_events": {"mode": "approximate"},  # the service's own PreciseMode follows none
            "log_level": "warning",
        }
    )


def build_service(config: EppConfig, seed: int = 0) -> EppService:
    """The service's components, built and wired as `epp serve` does; every pod scraped once."""
    service = EppService(config)
    service.store.sync(config.endpoints)
    rng = random.Random(seed)
    for endpoint in service.store.all():
        metrics = PodMetrics(model="m", kv_usage=rng.random() * 0.8, waiting=rng.randrange(5))
        service.store.scraped(endpoint, metrics)
    return service


def request_bodies(settings: Settings, count: int = 64, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    words = [f"w{n:03d}" for n in range(1000)]
    systems = [" ".join(rng.choice(words) for _ in range(settings.prompt_tokens)) for _ in range(8)]
    bodies = []
    for i in range(count):
        messages = [
            {"role": "system", "content": systems[i % len(systems)]},
            {"role": "user", "content": f"question {i}?"},
        ]
        bodies.append(json.dumps({"model": "m", "messages": messages}).encode())
    return bodies


async def route_open_loop(
    service: EppService, bodies: list[bytes], rate: float, duration_s: float
) -> list[float]:
    """Decisions at `rate`/s for `duration_s`; each one's latency (us) from its scheduled
    start to its completion."""
    router = service.router
    loop = asyncio.get_running_loop()
    start = loop.time()
    latencies: list[float] = []
    for n in range(int(rate * duration_s)):
        due = start + n / rate
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            await asyncio.sleep(0)  # late: still let the loop run what is due
        routed = router.route_now(
            IncomingRequest(
                path="/v1/chat/completions", body=bodies[n % len(bodies)], request_id=f"r{n}"
            )
        )
        router.complete(routed, 200)
        latencies.append((loop.time() - due) * 1e6)
    return latencies


# --- (a) the KV-event storm ----------------------------------------------------------------


def publish_main(argv: list[str]) -> None:
    """The publisher process: `kv_pods` vLLM-layout publishers; prints their ports, then
    publishes until stdin closes; prints how many batches it sent."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, required=True)
    parser.add_argument("--batches", type=float, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    args = parser.parse_args(argv)
    asyncio.run(_publish(args.pods, args.batches, args.blocks))


async def _publish(pods: int, batches: float, blocks: int) -> None:
    from vllm_sim.kv_events import BlockStored
    from vllm_sim.kv_publisher import KvEventPublisher, KvEventsConfig

    publishers = [KvEventPublisher(KvEventsConfig(port=0), topic="") for _ in range(pods)]
    for publisher in publishers:
        await publisher.start()
    print(json.dumps({"ports": [p.pub_port for p in publishers]}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.readline() else None)
    rng = random.Random(7)
    tokens = [[rng.randrange(50_000) for _ in range(blocks * 16)] for _ in range(16)]
    next_hash = [rng.getrandbits(62) for _ in range(pods)]
    tick = 1.0 / batches
    start, n = loop.time(), 0
    sent = 0
    while not stop.is_set():
        for i, publisher in enumerate(publishers):
            base = next_hash[i]
            hashes = list(range(base, base + blocks))
            next_hash[i] = base + blocks
            parent = None if n % 8 == 0 else base - 1
            event = BlockStored(hashes, parent, tokens[(i + n) % len(tokens)], 16)
            publisher.publish([event])
            sent += 1
        n += 1
        late = loop.time() - (start + n * tick)
        if late > tick:  # starved of CPU: skip the missed ticks rather than burst
            start += late
        await asyncio.sleep(max(0.0, start + n * tick - loop.time()))
    for publisher in publishers:
        await publisher.close()
    print(json.dumps({"sent": sent}), flush=True)


class Publisher:
    """The publisher process, started once for the whole run."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen[str] | None = None
        self.ports: list[int] = []

    def start(self) -> list[int]:
        s = self.settings
        code = (
            "import sys; from epp_bench.picker.loop import publish_main; publish_main(sys.argv[1:])"
        )
        argv = [sys.executable, "-c", code, "--pods", str(s.kv_publishers or s.kv_pods)]
        argv += ["--batches", str(s.batches), "--blocks", str(s.blocks)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.ports = json.loads(self.proc.stdout.readline())["ports"]
        return self.ports

    def stop(self) -> int:
        if self.proc is None:
            return 0
        try:  # stdin closed: the publisher stops
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return int(json.loads(lines[-1])["sent"]) if lines else 0


async def kv_ingest(
    service: EppService, kv_pods: int, in_thread: bool
) -> tuple[Callable[[], Awaitable[None]], Callable[[], dict[str, float]]]:
    """The product's PreciseMode on the service's index, one subscriber per pod; the live
    socket read and decoded in the shared receiver thread (`in_thread`) or on the loop."""
    config = service.config.kv_events.model_copy(update={"mode": "precise"})
    # libzmq's default of 1,023 sockets a context would stop the on-loop arm (three
    # sockets a pod) at ~340 pods.
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, context.get(zmq.SOCKET_LIMIT))
    precise = PreciseMode(config, service.index, service.config.prefix.block_size, context=context)
    precise.settings = dataclasses.replace(precise.settings, receive_in_thread=in_thread)
    for endpoint in service.store.all()[:kv_pods]:
        precise.on_change("added", endpoint)
    await precise.start()

    def counts() -> dict[str, float]:
        subs = precise.subscribers.values()
        return {
            "batches": sum(s.state.messages for s in subs),
            "gaps": sum(s.state.gaps for s in subs),
        }

    async def close() -> None:
        await precise.close()
        context.term()

    return close, counts


# --- (b) the relist ----------------------------------------------------------------------


def pod_object(i: int, ready: bool) -> dict[str, Any]:
    """A pod as the API server lists it (about the size of a real vLLM pod's object)."""
    name = f"pod-{i:04d}"
    env = [{"name": f"VLLM_VAR_{k}", "value": f"value-{k}-{i}"} for k in range(12)]
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"00000000-0000-0000-0000-{i:012d}",
            "resourceVersion": str(100_000 + i),
            "labels": {"app": "vllm", "pod-template-hash": "5d8f7c9b6d"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-12-01T00:00:00Z"},
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-5d8f7c9b6d"}
            ],
        },
        "spec": {
            "nodeName": f"node-{i // 8}",
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.32.0",
                    "args": [
                        "--model",
                        "meta-llama/Llama-3.1-8B-Instruct",
                        "--port",
                        "8000",
                        "--kv-events-config",
                        '{"enable_kv_cache_events": true}',
                    ],
                    "env": env,
                    "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": _pod_ip(i),
            "hostIP": f"192.168.{i // 250}.{i % 250 + 1}",
            "conditions": [
                {
                    "type": t,
                    "status": "True" if ready or t != "Ready" else "False",
                    "lastTransitionTime": "2026-12-01T00:00:00Z",
                }
                for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
            ],
        },
    }


def pod_list_bodies(fleet: int, kv_ports: list[int]) -> list[bytes]:
    """Two list bodies: `FLAPPING` pods (not the KV ones) Ready in the first, not the second."""
    bodies = []
    for flip in (True, False):
        items = []
        for i in range(fleet):
            pod = pod_object(i, ready=flip or not (len(kv_ports) <= i < len(kv_ports) + FLAPPING))
            if i < len(kv_ports):
                pod["metadata"]["labels"][LABEL_ENDPOINT] = f"tcp://127.0.0.1:{kv_ports[i]}"
                pod["metadata"]["labels"][LABEL_REPLAY] = ""
            items.append(pod)
        doc = {"kind": "PodList", "metadata": {"resourceVersion": "200000"}, "items": items}
        bodies.append(json.dumps(doc).encode())
    return bodies


def parse_list(body: bytes) -> dict[str, Any]:
    """What `Reflector._list` does with a list body in its thread."""
    doc = json.loads(body)
    return {item["metadata"]["name"]: item for item in doc["items"]}


async def relisting(
    service: EppService, bodies: list[bytes], every_s: float, off_loop: bool, stop: asyncio.Event
) -> dict[str, float]:
    """A relist every `every_s` until `stop`; the loop's share of each (ms)."""
    pool = standalone_pool("bench", SELECTOR, [8000])
    location = MetricsLocation()
    delivered: list[EndpointConfig] = []
    loop_ms: list[float] = []
    n = 0

    def in_thread(body: bytes) -> Any:
        objects = parse_list(body)
        if off_loop:
            return endpoints_for_pool(pool, objects.values(), location)
        return objects

    while not stop.is_set():
        result = await asyncio.to_thread(in_thread, bodies[n % len(bodies)])
        started = time.perf_counter()
        endpoints = result if off_loop else endpoints_for_pool(pool, result.values(), location)
        # Each pod's model comes from its page (scraped); the list does not carry it.
        if endpoints != delivered:
            delivered = endpoints
            service.store.sync(endpoints)
        loop_ms.append((time.perf_counter() - started) * 1000)
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    return {
        "relists": n,
        "loop_ms_p50": percentile(loop_ms, 50) or 0.0,
        "loop_ms_max": max(loop_ms, default=0.0),
    }


# --- (c) debug pages and /metrics ----------------------------------------------------------


def pages_app(service: EppService, off_loop: bool) -> web.Application:
    """/metrics and /debug/endpoints, rendered on the loop or each in a worker thread."""
    app = web.Application()

    async def rendered(render: Callable[[], bytes], kind: str) -> web.Response:
        body = await asyncio.to_thread(render) if off_loop else render()
        return web.Response(body=body, content_type=kind)

    async def metrics(_: web.Request) -> web.Response:
        return await rendered(service.metrics.exposition, "text/plain")

    async def endpoints(_: web.Request) -> web.Response:
        return await rendered(lambda: json.dumps(service._endpoint_rows()).encode(), "application/json")  # fmt: skip

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/endpoints", endpoints)
    return app


def metrics_app(service: EppService, where: str) -> web.Application:
    """/metrics alone: `on` the loop (collect and encode), `off` as the service serves it
    (`EppMetrics.render`: collect on the loop, encode in a worker thread), `thread` the
    whole exposition in a worker thread (collectors included: not safe while the loop
    resizes what they iterate; measured for comparison only)."""
    if where in ("off", "frozen"):
        return service._web_app()
    app = web.Application()

    async def metrics(_: web.Request) -> web.Response:
        expose = service.metrics.exposition
        body = await asyncio.to_thread(expose) if where == "thread" else expose()
        return web.Response(body=body, content_type="text/plain")

    app.router.add_get("/metrics", metrics)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def fetch_pages(
    port: int,
    every_s: float,
    stop: threading.Event,
    out: dict[str, float],
    paths: tuple[str, ...] = ("/metrics", "/debug/endpoints"),
) -> None:
    """The client, in its own thread: the pages every `every_s`."""
    fetched = 0
    size = 0
    while not stop.is_set():
        for path in paths:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
                size = max(size, len(resp.read()))
            fetched += 1
        stop.wait(every_s)
    out["pages"] = fetched
    out["largest_page_kib"] = size / 1024


# --- the run -----------------------------------------------------------------------------


class GcPauses:
    """The longest garbage collection and their total (ms) since `reset`, in any thread:
    a collection holds the GIL, so it stops the loop wherever it runs."""

    def __init__(self) -> None:
        self._started = 0.0
        self.longest_ms = 0.0
        self.total_ms = 0.0
        self.full = 0  # generation-2 collections
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            took = (time.perf_counter() - self._started) * 1000
            self.total_ms += took
            self.longest_ms = max(self.longest_ms, took)
            self.full += info.get("generation") == 2

    def reset(self) -> None:
        self.longest_ms = self.total_ms = 0.0
        self.full = 0

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


Latencies = list[float]


async def _kv_phase(service: EppService, bodies: list[bytes], settings: Settings, where: str, ctx: dict[str, Any]) -> tuple[Latencies, dict[str, float]]:  # fmt: skip
    close, counts = await kv_ingest(service, settings.kv_pods, in_thread=where != "on")
    await asyncio.sleep(0.3)  # connected before the clock starts
    before = counts()
    threads = threading.active_count()  # the process's, the publisher excluded
    started = time.perf_counter()
    latencies = await route_open_loop(service, bodies, settings.rate, settings.phase_s)
    after = counts()
    took = time.perf_counter() - started
    await close()
    await asyncio.sleep(1.0)  # the publisher process catches up before the next phase
    work = {k: after[k] - before.get(k, 0) for k in after}
    work["batches_per_s"] = work.get("batches", 0) / took
    work["blocks_per_s"] = work["batches_per_s"] * settings.blocks
    work["threads"] = threads
    return latencies, work


async def _relist_phase(service: EppService, bodies: list[bytes], settings: Settings, where: str, ctx: dict[str, Any]) -> tuple[Latencies, dict[str, float]]:  # fmt: skip
    stop = asyncio.Event()
    every_s = settings.relist_ms / 1000
    task = asyncio.create_task(relisting(service, ctx["lists"], every_s, where != "on", stop))
    latencies = await route_open_loop(service, bodies, settings.rate, settings.phase_s)
    stop.set()
    return latencies, await task


async def _pages_phase(service: EppService, bodies: list[bytes], settings: Settings, where: str, ctx: dict[str, Any]) -> tuple[Latencies, dict[str, float]]:  # fmt: skip
    """A client thread fetches the pages (`pages`: both; `metrics`: /metrics alone)."""
    port, paths = ctx["ports"][where]
    work: dict[str, float] = {}
    stop_client = threading.Event()
    client = threading.Thread(
        target=fetch_pages, args=(port, settings.pages_ms / 1000, stop_client, work, paths)
    )
    client.start()
    latencies = await route_open_loop(service, bodies, settings.rate, settings.phase_s)
    stop_client.set()
    await asyncio.to_thread(client.join)
    return latencies, work


async def _idle_phase(service: EppService, bodies: list[bytes], settings: Settings, where: str, ctx: dict[str, Any]) -> tuple[Latencies, dict[str, float]]:  # fmt: skip
    return await route_open_loop(service, bodies, settings.rate, settings.phase_s), {}


async def _phase(
    service: EppService,
    bodies: list[bytes],
    settings: Settings,
    load: str,
    where: str,
    repeat: int,
    ctx: dict[str, Any],
) -> PhaseResult:
    # Every phase starts from a collected heap; `frozen`: then frozen (gc.freeze), as
    # the service does after start-up, and unfrozen after the phase.
    gc.collect()
    if where == "frozen":
        gc.freeze()
    gc_pauses: GcPauses = ctx["gc"]
    gc_pauses.reset()
    cpu_started, process_started = time.thread_time(), time.process_time()
    wall_started = time.perf_counter()
    try:
        run_load = {"kv": _kv_phase, "relist": _relist_phase, "pages": _pages_phase}
        run_load["metrics"] = _pages_phase
        ports = ctx["ports"]
        ctx = {**ctx, "ports": ports.get(load, {})}
        latencies, work = await run_load.get(load, _idle_phase)(service, bodies, settings, where, ctx)  # fmt: skip
    finally:
        gc.unfreeze()
    # Per second of the phase as it ran (longer than phase_s when decisions ran late).
    wall = time.perf_counter() - wall_started
    work["loop_cpu_share"] = (time.thread_time() - cpu_started) / wall
    work["process_cpu_share"] = (time.process_time() - process_started) / wall
    work["gc_longest_ms"] = gc_pauses.longest_ms
    work["gc_total_ms"] = gc_pauses.total_ms
    work["gc_full"] = gc_pauses.full
    return PhaseResult(
        load,
        where,
        repeat,
        len(latencies),
        round(percentile(latencies, 50) or 0.0, 1),
        round(percentile(latencies, 99) or 0.0, 1),
        round(max(latencies, default=0.0), 1),
        {k: round(v, 2) for k, v in work.items()},
    )


def work_costs(service: EppService, lists: list[bytes], repeats: int = 5) -> dict[str, float]:
    """Each piece of background work alone, best of `repeats` (ms): what it would hold the
    loop for in one piece."""
    pool = standalone_pool("bench", SELECTOR, [8000])
    objects = parse_list(lists[0])
    endpoints = [
        endpoints_for_pool(pool, parse_list(body).values(), MetricsLocation()) for body in lists
    ]
    flips = iter(range(1_000_000))

    def relist_sync() -> None:
        service.store.sync(endpoints[next(flips) % 2])

    pieces: dict[str, Callable[[], object]] = {
        "json.loads of the pod list (reflector thread)": lambda: parse_list(lists[0]),
        "endpoints_for_pool": lambda: endpoints_for_pool(pool, objects.values(), MetricsLocation()),
        "EndpointStore.sync (20 pods flap)": relist_sync,
        "/metrics exposition": service.metrics.exposition,
        "/debug/endpoints rows + JSON": lambda: json.dumps(service._endpoint_rows()),
        "gc.collect() (full)": gc.collect,
    }
    costs = {}
    for name, piece in pieces.items():
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            piece()
            best = min(best, time.perf_counter() - started)
        costs[name] = round(best * 1000, 2)
    service.store.sync(endpoints[0])
    return costs


# (load, where): `on` the loop, `off` as the service does it now, `thread` (/metrics
# entirely in a worker thread), `frozen` (`off` with the start-up heap frozen, gc.freeze).
PHASES = [
    ("idle", "-"), ("idle", "frozen"),
    ("kv", "on"), ("kv", "off"), ("kv", "frozen"),
    ("relist", "on"), ("relist", "off"), ("relist", "frozen"),
    ("pages", "on"), ("pages", "off"),
    ("metrics", "on"), ("metrics", "off"), ("metrics", "thread"), ("metrics", "frozen"),
]  # fmt: skip
LOADS = ("kv", "relist", "pages", "metrics")


def phase_order(loads: list[str], repeat: int) -> list[tuple[str, str]]:
    """The phases of one repeat, grouped by load; within a load the arms' order is
    reversed every other repeat, so that no arm always runs first."""
    order: list[tuple[str, str]] = []
    for load in ["idle", *loads]:
        arms = [p for p in PHASES if p[0] == load]
        order += arms[::-1] if repeat % 2 else arms
    return order


async def run(settings: Settings, loads: list[str]) -> tuple[list[PhaseResult], dict[str, float]]:
    publisher = Publisher(settings)
    ports = publisher.start() if "kv" in loads else []
    # Each followed pod's publisher port (several pods subscribe to one with kv_publishers).
    kv_ports = [ports[i % len(ports)] for i in range(settings.kv_pods)] if ports else []
    try:
        config = fleet_config(settings, kv_ports)
        service = build_service(config)
        bodies = request_bodies(settings)
        ctx: dict[str, Any] = {"lists": pod_list_bodies(settings.fleet, kv_ports), "gc": GcPauses()}
        ctx["ports"] = {"pages": {}, "metrics": {}}
        runners = []
        apps = {
            ("pages", "on"): pages_app(service, off_loop=False),
            ("pages", "off"): pages_app(service, off_loop=True),
            **{("metrics", w): metrics_app(service, w) for w in ("on", "off", "thread", "frozen")},
        }
        for (load, where), app in apps.items():
            runner, port = await serve(app)
            runners.append(runner)
            paths = ("/metrics",) if load == "metrics" else ("/metrics", "/debug/endpoints")
            ctx["ports"][load][where] = (port, paths)
        await route_open_loop(service, bodies, settings.rate, 0.5)  # warm up
        costs = work_costs(service, ctx["lists"])
        for name, ms in costs.items():
            print(f"  alone: {name}: {ms:.1f} ms", flush=True)
        results = []
        for repeat in range(settings.repeats):
            for load, where in phase_order(loads, repeat):
                result = await _phase(service, bodies, settings, load, where, repeat, ctx)
                results.append(result)
                print(
                    f"  {load:<7} {where:<6} #{repeat}: p50 {result.p50_us / 1000:7.2f} ms"
                    f"  p99 {result.p99_us / 1000:7.2f} ms  max {result.max_us / 1000:7.2f} ms"
                    f"  {result.work}",
                    flush=True,
                )
        for runner in runners:
            await runner.cleanup()
        return results, costs
    finally:
        sent = publisher.stop()
        if sent:
            print(f"  publisher sent {sent} batches", flush=True)


def summary(results: list[PhaseResult]) -> list[dict[str, Any]]:
    """Per (load, where): median over repeats of p50 and p99, and the worst p99."""
    rows = []
    for load, where in PHASES:
        mine = [r for r in results if r.load == load and r.where == where]
        if not mine:
            continue
        p50s = sorted(r.p50_us for r in mine)
        p99s = sorted(r.p99_us for r in mine)
        rows.append(
            {
                "load": load,
                "where": where,
                "runs": len(mine),
                "p50_ms": round(p50s[len(p50s) // 2] / 1000, 2),
                "p99_ms": round(p99s[len(p99s) // 2] / 1000, 2),
                "p99_worst_ms": round(p99s[-1] / 1000, 2),
                "p99_runs_ms": [round(r.p99_us / 1000, 2) for r in mine],
                "max_ms": round(max(r.max_us for r in mine) / 1000, 2),
            }
        )
    return rows


WHERE = {
    "-": "-",
    "on": "on the loop",
    "off": "off the loop",
    "thread": "all in a thread",
    "frozen": "off, heap frozen",
}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| load | work | runs | p50 (ms) | p99 (ms, median of runs) | p99 of each run (ms) | max (ms) |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for row in rows:
        where = WHERE[row["where"]]
        runs = ", ".join(f"{v:.2f}" for v in row["p99_runs_ms"])
        lines.append(
            f"| {row['load']} | {where} | {row['runs']} | {row['p50_ms']:.2f} | "
            f"{row['p99_ms']:.2f} | {runs} | {row['max_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epp bench loop", description=__doc__.split("\n")[0])
    defaults = Settings()
    parser.add_argument("--fleet", type=int, default=defaults.fleet)
    parser.add_argument("--rate", type=float, default=defaults.rate, help="decisions per second")
    parser.add_argument("--phase-s", type=float, default=defaults.phase_s)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--kv-pods", type=int, default=defaults.kv_pods, help="pods followed")
    parser.add_argument("--kv-publishers", type=int, default=defaults.kv_publishers, help="publisher sockets (0: one per followed pod)")  # fmt: skip
    parser.add_argument("--batches", type=float, default=defaults.batches, help="per pod per second")  # fmt: skip
    parser.add_argument("--blocks", type=int, default=defaults.blocks, help="per batch")
    parser.add_argument("--relist-ms", type=float, default=defaults.relist_ms)
    parser.add_argument("--pages-ms", type=float, default=defaults.pages_ms)
    parser.add_argument("--loads", default=",".join(LOADS))
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    settings = Settings(
        fleet=args.fleet,
        rate=args.rate,
        phase_s=args.phase_s,
        repeats=args.repeats,
        kv_pods=args.kv_pods,
        kv_publishers=args.kv_publishers,
        batches=args.batches,
        blocks=args.blocks,
        relist_ms=args.relist_ms,
        pages_ms=args.pages_ms,
    )
    loads = [x for x in args.loads.split(",") if x]
    unknown = set(loads) - set(LOADS)
    if unknown:
        parser.error(f"unknown loads {sorted(unknown)}: {', '.join(LOADS)}")
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    started = time.perf_counter()
    results, costs = asyncio.run(run(settings, loads))
    rows = summary(results)
    print()
    print(markdown(rows))
    command = "epp bench loop " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"\n{time.perf_counter() - started:.0f} s; rerun: {command}")
    if args.out:
        report = {
            "command": command,
            "settings": asdict(settings),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "alone_ms": costs,
            "summary": rows,
            "phases": [asdict(r) for r in results],
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
