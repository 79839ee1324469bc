"""`epp bench scale`: the EPP at 1,000 pods with 10,000 requests in flight.

In one process, the service's own components wired as `epp serve` wires them (endpoint
store, prefix index, scheduler, Router, metrics: `epp.wiring.connect`), no Envoy and no
I/O, on a virtual clock (the store's and the index's clock stands still, so no page goes
stale and no reservation times out while the benchmark runs):

1. **The fleet**: `--pods` pods, each scraped once with a real vLLM page (the fixture
   page tests/fixtures/vllm-0.33-metrics.txt, its waiting / running / KV-usage values
   varied per pod, read by the scraper's `PageReader` into `EndpointStore.scraped`).
2. **Prefix state**: each pod holds about `--blocks-per-pod` blocks in the prefix index:
   the full chains of some of `--systems` shared 4k-token system prompts (the real hashes
   of their prompts, so that the measured requests hit them) and its own conversations'
   blocks (random chains).
3. **In flight**: `--in-flight` chat requests (a shared system prompt and a user turn)
   routed by the Router itself (`Router.route_now`) and not completed.
4. **Decision latency**: `Router.route` (awaited) on a 4k-token chat with a shared system
   prompt, byte estimate, each completed at once (untimed) so that the in-flight count
   stays put: at `--pods` pods with `--in-flight` in flight, with none in flight, and
   over `--small-pods` pods with none in flight, side by side in the same run.
5. **Memory**: RSS (/proc) and tracemalloc at each stage: per pod (store and page
   state; prefix index) and per request in flight.
6. **Completion**: `Router.complete` of every request in flight (the drain), CPU per
   completion.
7. **Scrape cost**: process CPU to read `--pods` pages (`PageReader.parse`, whole page
   and the `name[]`-filtered page the scraper asks for by default) and to apply them
   (`EndpointStore.scraped`, with its listeners), per round; cores at the 50 ms
   interval and at the slow ones (KV events 0.2 s, idle 0.5 s). The HTTP fetch is not
   included (see docs/benchmarks/scrape.md for the client's cost per page).

The machine is shared and noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import re
import resource
import shlex
import subprocess
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from epp.config import EppConfig
from epp.datalayer.metrics_parser import PageReader
from epp.datalayer.scraper import page_reader, scrape_url
from epp.datalayer.store import EndpointStore
from epp.observability.logs import configure_logging
from epp.observability.metrics import EppMetrics
from epp.prefix.hashing import BlockHash
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.wiring import connect
from epp_harness.stats import percentile

CODE = Path(__file__).resolve().parents[2]  # src/, or a frozen commit's code directory
# The repository: src/'s parent, else (frozen code) the working directory.
REPO = CODE.parent if (CODE.parent / "tests").is_dir() else Path.cwd()
FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.33-metrics.txt"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the fixture page's model_name
PATH = "/v1/chat/completions"
# The scraper's intervals (DataLayerConfig defaults): busy pods, pods followed by KV
# events, idle pods.
FLAP = 20  # pods removed by one relist (as docs/benchmarks/loop.md's relist load)
INTERVALS = {"50 ms (busy)": 0.05, "0.2 s (KV events)": 0.2, "0.5 s (idle)": 0.5}


@dataclass(slots=True)
class Settings:
    pods: int = 1000
    small_pods: int = 64
    in_flight: int = 10_000
    blocks_per_pod: int = 4000
    systems: int = 64  # shared system prompts
    systems_per_pod: int = 4  # held whole by each pod
    prompt_tokens: int = 4096
    decisions: int = 400  # measured per arm
    seed: int = 0
    live_s: float = 5.0  # each live scrape arm (0: none; they start processes)


@dataclass(slots=True)
class Arm:
    name: str
    pods: int
    in_flight: int
    decisions: int
    p50_us: float
    p99_us: float
    mean_us: float
    cpu_us: float  # process CPU per decision
    gc_us: float  # garbage collection per decision (its share of the arm's time)
    gc_full: int  # full (generation 2) collections during the arm


@dataclass(slots=True)
class Report:
    settings: dict[str, Any]
    arms: list[Arm] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)
    fill: dict[str, float] = field(default_factory=dict)
    drain: dict[str, float] = field(default_factory=dict)
    scrape: dict[str, float] = field(default_factory=dict)
    index: dict[str, float] = field(default_factory=dict)
    upkeep: dict[str, float] = field(default_factory=dict)
    live: dict[str, dict[str, float]] = field(default_factory=dict)


# -- pages ---------------------------------------------------------------------------------

_GAUGE = re.compile(
    rb"^(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc)\{[^}]*\}) \S+$",
    re.M,
)


def page_variants(page: bytes, count: int, seed: int) -> list[bytes]:
    """`count` copies of the page with their running / waiting / KV-usage values varied."""
    rng = random.Random(seed)
    variants = []
    for _ in range(count):
        values = {
            b"num_requests_running": float(rng.randrange(0, 12)),
            b"num_requests_waiting": float(rng.randrange(0, 5)),
            b"kv_cache_usage_perc": round(rng.random() * 0.8, 4),
        }

        def vary(match: re.Match[bytes], values: dict[bytes, float] = values) -> bytes:
            series = match.group(1)
            name = series.split(b"{")[0].split(b":")[1]
            return series + b" " + repr(values[name]).encode()

        variants.append(_GAUGE.sub(vary, page))
    return variants


def filtered_page(page: bytes, names: tuple[str, ...]) -> bytes:
    """The page as vLLM's prometheus_client answers `?name[]=...` (only those series)."""
    from epp_bench.picker.scrape_engine import render, vllm_registry

    return render(vllm_registry(page.decode()), scrape_url("/metrics", names))


# -- the fleet ---------------------------------------------------------------------------


class Clock:
    """The virtual clock of the store and the index: it moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class Fleet:
    config: EppConfig
    clock: Clock
    store: EndpointStore
    index: PrefixIndex
    router: Router
    metrics: EppMetrics


def _pod_ip(i: int) -> str:
    return f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}"


def build_fleet(pods: int, pages: list[bytes], reader: PageReader, seed: int) -> Fleet:
    """The components as the service wires them, every pod scraped once with a page."""
    config = EppConfig.model_validate(
        {
            "endpoints": [
                {"name": f"pod-{i:04d}", "address": f"{_pod_ip(i)}:8000", "model": MODEL}
                for i in range(pods)
            ],
            "log_level": "warning",
        }
    )
    clock = Clock()
    store = EndpointStore.for_config(config, clock)
    index = PrefixIndex.from_config(config.prefix, clock=clock)
    metrics = EppMetrics()
    scheduler = Scheduler(config.scheduling)
    router = Router(config, store, index, scheduler, ByteEstimateTokenizer(), metrics)
    connect(store, index, router, config)
    store.sync(config.endpoints)
    rng = random.Random(seed)
    for endpoint in store.all():
        store.scraped(endpoint, reader.parse(pages[rng.randrange(len(pages))]))
    return Fleet(config, clock, store, index, router, metrics)


def _words(rng: random.Random, tokens: int) -> str:
    # The byte estimate counts ~4 bytes a token: "w123 " is 5 bytes, 1.25 tokens.
    return " ".join(f"w{rng.randrange(1000):03d}" for _ in range(tokens * 4 // 5))


def chat(system: str, user: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": MODEL, "messages": messages}).encode()


def system_prompts(settings: Settings) -> list[str]:
    rng = random.Random(settings.seed + 1)
    return [_words(rng, settings.prompt_tokens) for _ in range(settings.systems)]


def fill_index(fleet: Fleet, systems: list[str], settings: Settings) -> int:
    """Each pod: `systems_per_pod` shared system prompts' chains (their real hashes) and
    its own conversations' blocks (random 64-bit chains of 256 blocks) up to
    `blocks_per_pod`. Returns the blocks recorded."""
    rng = random.Random(settings.seed + 2)
    router, index = fleet.router, fleet.index
    chains = [
        router.prepare(IncomingRequest(path=PATH, body=chat(s, "hi"), request_id="fill")).hashes
        for s in systems
    ]
    recorded = 0
    for n, endpoint in enumerate(fleet.store.all()):
        held = 0
        for k in range(settings.systems_per_pod):
            chain = chains[(n * settings.systems_per_pod + k) % len(chains)]
            index.record(endpoint.name, chain)
            held += len(chain)
        while held < settings.blocks_per_pod:
            length = min(256, settings.blocks_per_pod - held)
            chain = cast("list[BlockHash]", array("Q", rng.randbytes(8 * length)).tolist())
            index.record(endpoint.name, chain)
            held += length
        recorded += held
    return recorded


def bodies(systems: list[str], count: int, seed: int) -> list[bytes]:
    """Chats on the shared system prompts, each with its own user turn."""
    rng = random.Random(seed)
    return [
        chat(systems[rng.randrange(len(systems))], f"question {seed}-{i}: {_words(rng, 40)}")
        for i in range(count)
    ]


def prefix_state(fleet: Fleet, probe: bytes) -> dict[str, float]:
    """What the index holds, and how the measured requests meet it: the pods holding at
    least 90 % of a probe's blocks (its shared system prompt) and the longest match."""
    hashes = fleet.router.prepare(IncomingRequest(path=PATH, body=probe, request_id="p")).hashes
    matched = fleet.index.match(hashes)
    return {
        "prefixes held (index.nodes)": float(fleet.index.nodes),
        "probe blocks": float(len(hashes)),
        "pods holding 90 % of the probe": float(
            sum(1 for n in matched.values() if n >= 0.9 * len(hashes))
        ),
        "longest match (blocks)": float(max(matched.values(), default=0)),
    }


# -- measurements ---------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def traced_mb() -> float:
    return tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else 0.0


class GcWatch:
    """The garbage collections' time (ms, any generation) and the full ones since `reset`."""

    def __init__(self) -> None:
        self._started = 0.0
        self.total_ms = 0.0
        self.full = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_ms += (time.perf_counter() - self._started) * 1000
            self.full += info.get("generation") == 2

    def reset(self) -> None:
        self.total_ms, self.full = 0.0, 0

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def traced_requests(fleet: Fleet, chats: list[bytes]) -> tuple[float, float]:
    """With tracemalloc on: KB traced per request routed and open, and per request left
    once all are completed (what outlives a request)."""
    gc.collect()
    before = traced_mb()
    tokens, _ = fill_in_flight(fleet, chats)
    gc.collect()
    open_kb = (traced_mb() - before) * 1024 / len(chats)
    for token in tokens:
        fleet.router.complete(token, 200)
    del tokens
    gc.collect()
    left_kb = (traced_mb() - before) * 1024 / len(chats)
    return round(open_kb, 2), round(left_kb, 2)


async def measure_route(
    fleet: Fleet, name: str, probes: list[bytes], in_flight: int, gc_watch: GcWatch
) -> Arm:
    """`Router.route` over `probes`, each completed at once (untimed)."""
    router = fleet.router
    gc_watch.reset()
    samples = []
    clock = time.perf_counter_ns
    cpu = 0.0
    for n, body in enumerate(probes):
        incoming = IncomingRequest(path=PATH, body=body, request_id=f"{name}-{n}")
        cpu_started = time.process_time()
        started = clock()
        routed = await router.route(incoming)
        samples.append((clock() - started) / 1000)
        cpu += time.process_time() - cpu_started
        router.complete(routed, 200)
    warm = samples[len(samples) // 10 :]  # the first tenth warms caches
    return Arm(
        name,
        len(fleet.store.all()),
        in_flight,
        len(warm),
        round(percentile(warm, 50) or 0.0, 1),
        round(percentile(warm, 99) or 0.0, 1),
        round(sum(warm) / len(warm), 1),
        round(cpu / len(samples) * 1e6, 1),
        round(gc_watch.total_ms * 1000 / len(samples), 1),
        gc_watch.full,
    )


def fill_in_flight(fleet: Fleet, chats: list[bytes]) -> tuple[list[str], list[float]]:
    """Route every chat and keep it open; their route tokens (all the observer stream
    keeps of a request) and each decision's latency (us)."""
    router = fleet.router
    tokens, latencies = [], []
    clock = time.perf_counter_ns
    for n, body in enumerate(chats):
        started = clock()
        routed = router.route_now(IncomingRequest(path=PATH, body=body, request_id=f"f{n}"))
        latencies.append((clock() - started) / 1000)
        tokens.append(routed.token)
    return tokens, latencies


def cpu_of(call: Callable[[], object]) -> float:
    started = time.process_time()
    call()
    return time.process_time() - started


def scrape_costs(fleet: Fleet, pages: list[bytes], reader: PageReader) -> dict[str, float]:
    """Process CPU per round of one page per pod (best of 3 rounds): parse, and parse +
    `EndpointStore.scraped` (the store and its listeners, as the scraper calls it)."""
    store, endpoints = fleet.store, fleet.store.all()
    filtered = [filtered_page(page, reader.names) for page in pages[:4]]
    whole_per_pod = [pages[n % len(pages)] for n in range(len(endpoints))]
    filtered_per_pod = [filtered[n % len(filtered)] for n in range(len(endpoints))]

    def parse(per_pod: list[bytes]) -> Callable[[], object]:
        return lambda: [reader.parse(page) for page in per_pod]

    def apply(per_pod: list[bytes]) -> Callable[[], object]:
        def round_() -> None:
            fleet.clock.now += 0.05
            for endpoint, page in zip(endpoints, per_pod, strict=True):
                store.scraped(endpoint, reader.parse(page))

        return round_

    rounds = {
        "parse, whole page": parse(whole_per_pod),
        "parse, filtered page (default)": parse(filtered_per_pod),
        "parse + store.scraped, whole page": apply(whole_per_pod),
        "parse + store.scraped, filtered page (default)": apply(filtered_per_pod),
    }
    out: dict[str, float] = {
        "whole page bytes": float(len(pages[0])),
        "filtered page bytes": float(len(filtered[0])),
    }
    for name, round_ in rounds.items():
        best = min(cpu_of(round_) for _ in range(3))
        out[f"{name}: ms per round"] = round(best * 1000, 2)
        out[f"{name}: us per page"] = round(best / len(endpoints) * 1e6, 1)
    return out


def upkeep_costs(fleet: Fleet, pages: list[bytes], reader: PageReader) -> dict[str, float]:
    """What the service's periodic and event work costs at this load (process CPU, ms):
    the maintenance round's `Router.tick` and the store's health round (each every
    0.25 s, `epp.app.HEALTH_REFRESH_S`), and `FLAP` pods (one in 50 of a smaller fleet)
    removed by one relist (then added back and scraped, untimed)."""
    store, router = fleet.store, fleet.router
    tick = min(cpu_of(router.tick) for _ in range(5))
    health = min(cpu_of(store.refresh_health) for _ in range(5))
    endpoints = fleet.config.endpoints
    flap = min(FLAP, max(1, len(endpoints) // 50))
    removed = cpu_of(lambda: store.sync(endpoints[flap:]))
    store.sync(endpoints)
    for n, endpoint in enumerate(store.all()[:flap]):
        if endpoint.metrics is None:
            store.scraped(endpoint, reader.parse(pages[n % len(pages)]))
    return {
        "Router.tick ms": round(tick * 1000, 3),
        "EndpointStore.refresh_health ms": round(health * 1000, 3),
        f"{flap} pods removed (EndpointStore.sync) ms": round(removed * 1000, 3),
    }


# (name, pages, scrape_interval_s): the scraper's defaults otherwise (the `name[]` filter,
# idle pods every 0.5 s).
LIVE_ARMS = (
    ("busy pods, 50 ms (default settings)", "busy", 0.05),
    ("busy pods, scrape_interval_s 0.2", "busy", 0.2),
    ("idle pods, default settings (0.5 s)", "idle", 0.05),
)


def live_scrape(pods: int, seconds: float) -> dict[str, dict[str, float]]:
    """The scraper as the service runs it (`MetricsScraper`, its HTTP client, parse and
    store), over loopback to one page-server process answering what vLLM's
    prometheus_client answers, each arm a process of its own: `epp bench scrape`'s live
    arms (epp_bench/picker/scrape.py) at this pod count. Cores = the scraper process's
    CPU seconds per wall second; asked = the pages per second the intervals ask for."""
    from epp_bench.picker import scrape

    out: dict[str, dict[str, float]] = {}
    with scrape.page_server(FIXTURE) as port:
        for name, pages, interval in LIVE_ARMS:
            urls = [f"http://127.0.0.1:{port}/{pages}/{i}/metrics" for i in range(pods)]
            row = scrape.live_arm(urls, interval, seconds, {}, None)
            asked = pods / (interval if pages == "busy" else 0.5)
            out[name] = {
                "us per page": round(row["us_per_page"] or 0.0, 1),
                "pages per s": round(row["pages_per_s"], 0),
                "pages per s asked": round(asked, 0),
                "cores measured": round(row["cores"], 3),
                "failures": float(row["failures"]),
            }
            _say(f"live scrape, {name}: {out[name]}")
    return out


def commit() -> str:
    """The code's commit: a frozen checkout's (tools/bench/freeze_code.py names its
    directory after it), else the work tree's HEAD, marked when src/epp differs from it."""
    if re.fullmatch(r"[0-9a-f]{40}", CODE.name):
        return CODE.name[:7] + " (frozen)"
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src/epp"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return done.stdout.strip() + (" (src/epp modified)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# -- the run ---------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(f"  {text}", flush=True)


@dataclass(slots=True)
class Inputs:
    """What every stage of a run shares."""

    settings: Settings
    pages: list[bytes]  # page variants, one picked per pod
    reader: PageReader
    systems: list[str]  # the shared system prompts
    probes: list[bytes]  # the measured chats
    window: int  # requests routed under tracemalloc
    gc_watch: GcWatch


async def run(settings: Settings) -> Report:
    report = Report(asdict(settings))
    systems = system_prompts(settings)
    inputs = Inputs(
        settings,
        page_variants(FIXTURE.read_bytes(), 32, settings.seed),
        page_reader(EppConfig().datalayer),
        systems,
        bodies(systems, settings.decisions, seed=settings.seed + 10),
        max(1, min(200, settings.in_flight // 10)),
        GcWatch(),
    )
    try:
        await small_fleet_stage(inputs, report)
        fleet = await large_fleet_stage(inputs, report)
        tokens = await in_flight_stage(fleet, inputs, report)
        drain_stage(fleet, tokens, inputs, report)
        report.scrape = scrape_costs(fleet, inputs.pages, inputs.reader)
        _say(f"scrape: {report.scrape}")
        del fleet, tokens
        gc.collect()
    finally:
        inputs.gc_watch.close()
    if settings.live_s > 0:
        report.live = live_scrape(settings.pods, settings.live_s)
    return report


async def small_fleet_stage(inputs: Inputs, report: Report) -> None:
    """The small fleet, its memory traced stage by stage (tracemalloc slows every
    allocation: the large fleet's stages are read from RSS, beside a traced window),
    then its decisions with nothing in flight."""
    settings, memory = inputs.settings, report.memory
    gc.collect()
    tracemalloc.start()
    small = build_fleet(settings.small_pods, inputs.pages, inputs.reader, settings.seed)
    gc.collect()
    memory["small: store traced KB per pod"] = round(traced_mb() * 1024 / settings.small_pods, 2)
    before = traced_mb()
    blocks = fill_index(small, inputs.systems, settings)
    gc.collect()
    index_mb = traced_mb() - before
    memory["small: index traced KB per pod"] = round(index_mb * 1024 / settings.small_pods, 2)
    memory["small: index traced B per (block, pod)"] = round(index_mb * 2**20 / blocks, 1)
    chats = bodies(inputs.systems, inputs.window, seed=settings.seed + 30)
    per_request, kept = traced_requests(small, chats)
    memory["small: traced KB per open request"] = per_request
    memory["small: traced KB kept per completed request"] = kept
    tracemalloc.stop()
    gc.collect()
    arm = await measure_route(small, "small fleet, idle", inputs.probes, 0, inputs.gc_watch)
    report.arms.append(arm)
    _say(f"{arm}")


async def large_fleet_stage(inputs: Inputs, report: Report) -> Fleet:
    """The large fleet and its prefix state, by RSS; a traced window of requests; its
    decisions with nothing in flight."""
    settings, memory = inputs.settings, report.memory
    gc.collect()
    rss = rss_mb()
    started = time.perf_counter()
    fleet = build_fleet(settings.pods, inputs.pages, inputs.reader, settings.seed)
    gc.collect()
    memory["large: build s"] = round(time.perf_counter() - started, 2)
    memory["large: store RSS KB per pod"] = round((rss_mb() - rss) * 1024 / settings.pods, 2)
    rss = rss_mb()
    started = time.perf_counter()
    blocks = fill_index(fleet, inputs.systems, settings)
    gc.collect()
    memory["large: index fill s"] = round(time.perf_counter() - started, 2)
    memory["large: index blocks recorded"] = blocks
    memory["large: index RSS KB per pod"] = round((rss_mb() - rss) * 1024 / settings.pods, 2)
    memory["large: index RSS B per (block, pod)"] = round((rss_mb() - rss) * 2**20 / blocks, 1)
    report.index = prefix_state(fleet, inputs.probes[0])
    tracemalloc.start()
    chats = bodies(inputs.systems, inputs.window, seed=settings.seed + 40)
    per_request, kept = traced_requests(fleet, chats)
    tracemalloc.stop()
    memory["large: traced KB per open request"] = per_request
    memory["large: traced KB kept per completed request"] = kept
    gc.collect()
    _say(f"fleets and index: {memory}")
    arm = await measure_route(fleet, "large fleet, idle", inputs.probes, 0, inputs.gc_watch)
    report.arms.append(arm)
    _say(f"{arm}")
    return fleet


async def in_flight_stage(fleet: Fleet, inputs: Inputs, report: Report) -> list[str]:
    """`in_flight` chats routed by the Router itself and kept open; the decisions measured
    at that load, and the periodic work. Returns the open requests' route tokens."""
    settings, memory, gc_watch = inputs.settings, report.memory, inputs.gc_watch
    chats = bodies(inputs.systems, settings.in_flight, seed=settings.seed + 20)
    rss = rss_mb()
    memory["RSS MB, process with nothing in flight"] = round(rss, 1)
    gc_watch.reset()
    started = time.perf_counter()
    tokens, latencies = fill_in_flight(fleet, chats)
    fill_s = time.perf_counter() - started
    fill_gc_ms = gc_watch.total_ms
    gc.collect()
    memory["large: in flight RSS KB per request"] = round((rss_mb() - rss) * 1024 / len(tokens), 2)
    memory["RSS MB, process at full load"] = round(rss_mb(), 1)
    endpoints = fleet.store.all()
    open_now = sum(e.in_flight for e in endpoints)
    tenth = max(1, len(latencies) // 10)
    report.fill = {
        "requests routed and open": float(open_now),
        "pods used": float(sum(1 for e in endpoints if e.in_flight)),
        "most on one pod": float(max(e.in_flight for e in endpoints)),
        "fill s": round(fill_s, 1),
        "GC share of the fill": round(fill_gc_ms / 1000 / fill_s, 3),
        "route_now p50 us, first tenth": round(percentile(latencies[:tenth], 50) or 0, 1),
        "route_now p50 us, last tenth": round(percentile(latencies[-tenth:], 50) or 0, 1),
    }
    _say(f"in flight: {report.fill}")
    arm = await measure_route(fleet, "large fleet, loaded", inputs.probes, open_now, gc_watch)
    report.arms.append(arm)
    _say(f"{arm}")
    report.upkeep = upkeep_costs(fleet, inputs.pages, inputs.reader)
    _say(f"upkeep at full load: {report.upkeep}")
    return tokens


def drain_stage(fleet: Fleet, tokens: list[str], inputs: Inputs, report: Report) -> None:
    """Every open request completed, as the observer stream completes them."""
    router, gc_watch = fleet.router, inputs.gc_watch
    gc_watch.reset()
    cpu_started, started = time.process_time(), time.perf_counter()
    for token in tokens:
        router.complete(token, 200)
    drained_cpu, drained_wall = time.process_time() - cpu_started, time.perf_counter() - started
    report.drain = {
        "completions": float(len(tokens)),
        "CPU us per completion": round(drained_cpu / len(tokens) * 1e6, 2),
        "wall us per completion": round(drained_wall / len(tokens) * 1e6, 2),
        "GC ms during the drain": round(gc_watch.total_ms, 1),
        "open after": float(sum(e.in_flight for e in fleet.store.all())),
    }
    gc.collect()
    report.memory["RSS MB, process drained"] = round(rss_mb(), 1)
    report.memory["RSS MB, process peak (ru_maxrss)"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
    )
    _say(f"drain: {report.drain}")


def helm_memory_mb(report: Report, settings: Settings) -> float:
    """The measured process RSS at full load, rounded up to the next 256 MiB, plus a
    quarter for the HTTP / gRPC buffers, threads and pages this run has none of."""
    full = report.memory["RSS MB, process at full load"] * 1.25
    return float(-(-full // 256) * 256)


def cores(report: Report, settings: Settings) -> list[tuple[str, float, dict[str, float]]]:
    rows = []
    for name in (
        "parse, filtered page (default)",
        "parse + store.scraped, filtered page (default)",
        "parse, whole page",
        "parse + store.scraped, whole page",
    ):
        per_page_s = report.scrape[f"{name}: us per page"] / 1e6
        by_interval = {k: round(per_page_s * settings.pods / v, 3) for k, v in INTERVALS.items()}
        rows.append((name, report.scrape[f"{name}: us per page"], by_interval))
    return rows


def render(report: Report, settings: Settings) -> str:
    lines = [
        "",
        "Decision latency (Router.route, 4k-token chat, shared system prompt, byte estimate):",
    ]
    lines.append(
        "| arm | pods | in flight | decisions | p50 (us) | p99 (us) | mean (us) | "
        "CPU per decision (us) | GC per decision (us) | full GCs |"
    )
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for a in report.arms:
        lines.append(
            f"| {a.name} | {a.pods:,} | {a.in_flight:,} | {a.decisions} | {a.p50_us:,.0f} | "
            f"{a.p99_us:,.0f} | {a.mean_us:,.0f} | {a.cpu_us:,.0f} | {a.gc_us:,.0f} | "
            f"{a.gc_full} |"
        )
    by_name = {a.name: a for a in report.arms}
    small, loaded = by_name.get("small fleet, idle"), by_name.get("large fleet, loaded")
    idle = by_name.get("large fleet, idle")
    if small and loaded and idle:
        lines.append(
            f"\nratio p50: loaded / small {loaded.p50_us / small.p50_us:.1f}x, "
            f"idle large / small {idle.p50_us / small.p50_us:.1f}x, "
            f"loaded / idle large {loaded.p50_us / idle.p50_us:.2f}x"
        )
    lines.append("\nMemory:")
    lines += [f"  {k}: {v}" for k, v in report.memory.items()]
    lines.append(
        f"  memory to request at this load (RSS x 1.25, rounded up): {helm_memory_mb(report, settings):.0f} MiB"
    )
    lines.append("\nPrefix index (large fleet):")
    lines += [f"  {k}: {v:,.0f}" for k, v in report.index.items()]
    lines.append("\nIn flight (routed by the Router, not completed):")
    lines += [f"  {k}: {v}" for k, v in report.fill.items()]
    lines.append("\nUpkeep at full load (process CPU; the maintenance round runs every 0.25 s):")
    lines += [f"  {k}: {v}" for k, v in report.upkeep.items()]
    lines.append("\nDrain:")
    lines += [f"  {k}: {v}" for k, v in report.drain.items()]
    lines.append(f"\nScrape at {settings.pods:,} pods (process CPU, no HTTP fetch):")
    lines.append(
        "| work per page | us per page | " + " | ".join(f"cores at {k}" for k in INTERVALS) + " |"
    )
    lines.append("| --- | ---: | " + " | ".join("---:" for _ in INTERVALS) + " |")
    for name, us, by_interval in cores(report, settings):
        lines.append(
            f"| {name} | {us:,.1f} | " + " | ".join(f"{v:.2f}" for v in by_interval.values()) + " |"
        )
    lines.append(
        f"  page bytes: whole {report.scrape['whole page bytes']:,.0f}, "
        f"filtered {report.scrape['filtered page bytes']:,.0f}"
    )
    if report.live:
        lines.append(f"\nScrape at {settings.pods:,} pods, live (MetricsScraper over loopback):")
        lines.append("| arm | us per page | pages/s | pages/s asked | cores measured | failures |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, row in report.live.items():
            lines.append(
                f"| {name} | {row['us per page']:,.1f} | {row['pages per s']:,.0f} | "
                f"{row['pages per s asked']:,.0f} | {row['cores measured']:.2f} | "
                f"{row['failures']:.0f} |"
            )
    return "\n".join(lines)


QUICK = Settings(
    pods=40, small_pods=8, in_flight=200, blocks_per_pod=1500, systems=8, decisions=40, live_s=0
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epp bench scale", description=__doc__.split("\n")[0])
    d = Settings()
    parser.add_argument("--pods", type=int, default=d.pods)
    parser.add_argument("--small-pods", type=int, default=d.small_pods)
    parser.add_argument("--in-flight", type=int, default=d.in_flight)
    parser.add_argument("--blocks-per-pod", type=int, default=d.blocks_per_pod)
    parser.add_argument("--systems", type=int, default=d.systems, help="shared system prompts")
    parser.add_argument("--decisions", type=int, default=d.decisions, help="measured per arm")
    parser.add_argument("--live-s", type=float, default=d.live_s, help="each live scrape arm (0: none)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a tiny run, no live arm (the smoke test)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        settings = QUICK
    else:
        settings = Settings(
            pods=args.pods,
            small_pods=args.small_pods,
            in_flight=args.in_flight,
            blocks_per_pod=args.blocks_per_pod,
            systems=args.systems,
            decisions=args.decisions,
            live_s=args.live_s,
        )
    if (
        settings.pods < 1
        or settings.small_pods < 1
        or settings.in_flight < 1
        or settings.decisions < 10
    ):
        parser.error("--pods, --small-pods and --in-flight must be >= 1, --decisions >= 10")
    configure_logging("warning")  # the product's configuration, as `epp serve` sets it
    code = commit()
    print(f"epp bench scale at {code}: {asdict(settings)}", flush=True)
    started = time.perf_counter()
    report = asyncio.run(run(settings))
    print(render(report, settings))
    command = "epp bench scale " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"\n{time.perf_counter() - started:.0f} s at {code}; rerun: {command}")
    if args.out:
        out = {
            "command": command,
            "commit": code,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            **asdict(report),
            "helm_memory_mb": helm_memory_mb(report, settings),
            "cores": [{"work": n, "us_per_page": us, **c} for n, us, c in cores(report, settings)],
        }
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
