"""A pod's server restart seen from its start time (issue 9), through real sockets.

Simulated pods run as their own processes (each has its own `process_start_time_seconds`,
as a vLLM server has) and are restarted on the same HTTP and KV-event ports. The EPP's
side is real: its metrics scraper fetches the pages over HTTP (by hand here, one
`scrape_once` at a time, so that the test decides what each page shows), the endpoint
store decides a restart, and the prefix index and precise mode act on it.

- Approximate pod: the restarted server serves more than the old one had before its
  first page is fetched, so its counters are higher, not lower; the start time alone
  tells, and the index forgets what it recorded for the pod.
- Precise pod: its KV events reach the EPP's subscriber through a ZMQ forwarder (XSUB to
  XPUB, real sockets), so the subscriber's connection never drops, and the restarted
  publisher continues the old one's sequence numbers (`--kv-events-first-seq`): neither
  a disconnect nor a sequence going back tells. The start time does: the old process's
  blocks go, the new one's are kept block by block.
- Precise pod whose subscriber caught up first: the subscriber reconnects to the new
  process and rebuilds the pod's entries from its replay before the EPP reads the new
  start time (as with vLLM, which serves its page once the engine is up). The start time
  then changes nothing: neither the app's index listener nor the subscriber drops the
  entries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq
from helpers import until

from epp.config import EndpointConfig, EppConfig, KvEventsConfig
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.wiring import index_listener
from epp_harness.stack import HOST, free_ports

pytestmark = pytest.mark.e2e
MODEL = "m"
FAST = ["--prefill-per-token-ms", "0.01", "--decode-per-token-ms", "0.2"]


class Sim:
    """`python -m vllm_sim` on fixed ports, as its own process."""

    def __init__(self, port: int, kv_port: int, log: Path, replay_port: int | None = None) -> None:
        self.port, self.kv_port, self.log = port, kv_port, log
        self.replay_port = replay_port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self, first_seq: int = 0) -> None:
        argv = [
            sys.executable, "-m", "vllm_sim", "--host", HOST, "--port", str(self.port),
            "--name", "pod-0", "--model", MODEL, *FAST,
            "--kv-events-port", str(self.kv_port), "--kv-events-topic", "",
            "--kv-events-first-seq", str(first_seq),
        ]  # fmt: skip
        if self.replay_port is not None:
            argv += ["--kv-replay-port", str(self.replay_port)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 60
            while True:
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                try:
                    async with session.get(self.url + "/health") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the simulator did not answer"
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    async def serve(self, ids: list[int]) -> None:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + "/v1/completions", json=body) as response,
        ):
            assert response.status == 200, await response.text()

    async def get(self, path: str) -> str:
        async with aiohttp.ClientSession() as session, session.get(self.url + path) as response:
            assert response.status == 200
            return await response.text()

    async def start_time(self) -> float:
        for line in (await self.get("/metrics")).splitlines():
            if line.startswith("process_start_time_seconds "):
                return float(line.split()[1])
        raise AssertionError("no process_start_time_seconds on the page")

    async def engine_blocks(self) -> set[int]:
        return {int(h, 16) for h in json.loads(await self.get("/sim/kv"))["blocks"]}


class Forwarder:
    """A ZMQ XSUB -> XPUB forwarder on its own thread: subscribers connect to it and stay
    connected while the publisher behind it restarts (XSUB reconnects upstream and sends
    the subscriptions again)."""

    def __init__(self, upstream: str, port: int = 0) -> None:
        self._context = zmq.Context()
        self._ready = threading.Event()
        self.port = port  # 0: any free one
        self._thread = threading.Thread(target=self._run, args=(upstream,), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)
        self._control = self._context.socket(zmq.PAIR)
        self._control.connect("inproc://forwarder-control")

    def _run(self, upstream: str) -> None:
        context = self._context
        front, back = context.socket(zmq.XSUB), context.socket(zmq.XPUB)
        control = context.socket(zmq.PAIR)
        control.bind("inproc://forwarder-control")
        front.setsockopt(zmq.RECONNECT_IVL, 50)
        front.connect(upstream)
        if self.port:
            back.bind(f"tcp://{HOST}:{self.port}")
        else:
            self.port = back.bind_to_random_port(f"tcp://{HOST}")
        self._ready.set()
        try:
            zmq.proxy_steerable(front, back, None, control)
        finally:
            for sock in (front, back, control):
                sock.close(linger=0)

    def close(self) -> None:
        self._control.send(b"TERMINATE")
        self._thread.join(10)
        self._control.close(linger=0)
        self._context.term()


class Epp:
    """The EPP's data layer around one pod: store, scraper (by hand), index, precise mode."""

    def __init__(self, labels: dict[str, str]) -> None:
        config = EppConfig()
        self.store = EndpointStore(config.datalayer)
        self.index = PrefixIndex(100_000, clock=self.store.now)
        kv_events = KvEventsConfig.model_validate(
            {"resync_timeout_s": 1.0, "reconnect_max_s": 0.2, "fallback_after_s": 0.5}
        )
        self.mode = PreciseMode(kv_events, self.index, 16)
        self.store.on_change(index_listener(self.index, config.prefix, self.mode))
        self.store.on_change(self.mode.on_change)
        self.scraper = MetricsScraper(self.store, config.datalayer)
        self.labels = labels
        self.resets = 0
        self.store.on_change(self._count_resets)

    def _count_resets(self, event: str, _endpoint: object) -> None:
        self.resets += event == "reset"

    async def start(self, sim: Sim) -> None:
        await self.scraper.start()  # no pod yet: no scrape loop, pages are fetched by hand
        await self.mode.start()
        address = f"{HOST}:{sim.port}"
        self.store.sync([EndpointConfig(name="pod-0", address=address, labels=self.labels)])

    async def page(self) -> None:
        endpoint = self.store.get("pod-0")
        assert endpoint is not None
        await self.scraper.scrape_once(endpoint)
        assert endpoint.consecutive_failures == 0, endpoint.last_error

    def holds(self, ids: list[int]) -> int:
        hashes = block_hashes(array("I", ids), 16, chain_seed(MODEL))
        return self.index.match(hashes).get("pod-0", 0)

    async def close(self) -> None:
        await self.mode.close()
        await self.scraper.stop()


def ids_of(seed: int, n: int = 160) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 100_000) for _ in range(n)]


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[Sim]:
    port, kv_port = free_ports(2)
    running = Sim(port, kv_port, tmp_path / "sim.log")
    try:
        yield running
    finally:
        running.stop()


async def test_the_simulator_reports_its_process_start_time_like_vllm(sim: Sim):
    before = time.time()
    await sim.start()
    first = await sim.start_time()
    # As prometheus_client reads it (vLLM's page too): the boot time in whole seconds
    # plus the process's start in 1/100 s ticks since boot, so up to a second early, and
    # more if the wall clock was stepped since boot.
    assert before - 5 <= first <= time.time()
    sim.stop()
    await sim.start()
    assert await sim.start_time() > first


async def test_an_approximate_pod_restarted_with_higher_counters_is_seen_by_its_start_time(
    sim: Sim,
):
    await sim.start()
    epp = Epp({"kv_events_mode": "approximate"})
    await epp.start(sim)
    try:
        await sim.serve(ids_of(1))
        await epp.page()
        old = epp.store.get("pod-0")
        assert old is not None and old.metrics is not None
        queries = old.metrics.prefix_queries
        hashes = block_hashes(array("I", ids_of(1)), 16, chain_seed(MODEL))
        epp.index.record("pod-0", hashes)  # as the router records a decision
        assert epp.holds(ids_of(1)) == 10

        sim.stop()
        await sim.start()
        for seed in (2, 3):  # more than the old server had served
            await sim.serve(ids_of(seed))
        await epp.page()
        assert old.metrics.prefix_queries > queries  # the counters did not go back
        assert epp.resets == 1
        assert epp.holds(ids_of(1)) == 0
    finally:
        await epp.close()


async def test_a_precise_pod_restarted_behind_a_forwarder_with_its_sequence_continuing(
    sim: Sim,
):
    await sim.start()
    forwarder = Forwarder(f"tcp://{HOST}:{sim.kv_port}")
    labels = {
        "kv_events_mode": "precise",
        "kv_events_endpoint": f"tcp://{HOST}:{forwarder.port}",
        "kv_events_replay": "",
        "kv_events_topic": "",
    }
    epp = Epp(labels)
    try:
        await epp.start(sim)
        await epp.page()  # the model from the page: the pod is followed
        sub = epp.mode.subscriber("pod-0")
        assert sub is not None
        await until(lambda: sub.state.connected and sub.state.attached, 20, "the subscriber")
        await sim.serve(ids_of(1))
        engine = await sim.engine_blocks()
        await until(lambda: set(epp.index.engine_blocks("pod-0")) == engine, 20, "the events")
        assert epp.holds(ids_of(1)) == 10
        next_seq = sub.state.next_seq
        assert next_seq is not None and next_seq > 0

        sim.stop()
        await sim.start(first_seq=next_seq)
        await epp.page()  # the new start time: the old process's blocks go
        assert epp.resets == 1 and sub.state.restarts == 1
        assert epp.holds(ids_of(1)) == 0

        # The forwarder subscribes to the new publisher when it reconnects, a moment after
        # the server answers; until then a PUB socket drops what it sends. Warm-up
        # prompts until one batch has come through.
        seen = sub.state.messages
        for seed in range(100, 140):
            await sim.serve(ids_of(seed))
            with contextlib.suppress(AssertionError):
                await until(lambda: sub.state.messages > seen, timeout=0.5)
                break
        assert sub.state.messages > seen, "no event came through the forwarder"
        await sim.serve(ids_of(2))
        await until(lambda: epp.holds(ids_of(2)) == 10, 20, "the new server's events")
        assert epp.holds(ids_of(1)) == 0
        assert set(epp.index.engine_blocks("pod-0")) <= await sim.engine_blocks()
        # Neither the connection nor the sequence told: the forwarder kept the subscriber
        # connected and the numbers went on.
        assert sub.state.disconnects == 0 and sub.state.gaps == 0
        assert sub.state.next_seq is not None and sub.state.next_seq > next_seq
        assert sub is epp.mode.subscriber("pod-0")  # the same subscriber throughout
    finally:
        await epp.close()
        forwarder.close()


async def test_a_precise_pods_new_start_time_read_after_its_resync_keeps_the_entries(
    tmp_path: Path,
):
    """The pod's events come through a forwarder that goes down with the old process and
    comes back (on the same port) after the new one has been running for longer than the
    subscriber's margin (3 s): it stands for vLLM's engine, which binds its publisher
    20-70 s after its process started (the simulator binds at once). The subscriber
    reconnects, rebuilds the entries from the new process's replay socket, and only then
    the EPP reads the page with the new start time: the store's reset reaches both the
    index listener and precise mode, and neither drops the entries."""
    port, kv_port, replay_port, front = free_ports(4)
    sim = Sim(port, kv_port, tmp_path / "sim.log", replay_port=replay_port)
    upstream = f"tcp://{HOST}:{kv_port}"
    forwarder: Forwarder | None = None
    epp = Epp(
        {
            "kv_events_mode": "precise",
            "kv_events_endpoint": f"tcp://{HOST}:{front}",
            "kv_events_replay": f"tcp://{HOST}:{replay_port}",
            "kv_events_topic": "",
        }
    )
    try:
        await sim.start()
        forwarder = Forwarder(upstream, front)
        await epp.start(sim)
        await epp.page()
        sub = epp.mode.subscriber("pod-0")
        assert sub is not None
        await until(lambda: sub.state.resynced_at is not None, 20, "the first resync")
        await sim.serve(ids_of(1))
        engine = await sim.engine_blocks()
        await until(lambda: set(epp.index.engine_blocks("pod-0")) == engine, 20, "the events")

        sim.stop()
        forwarder.close()
        forwarder = None
        await until(lambda: sub.state.disconnects == 1, 20, "the disconnect")
        assert epp.holds(ids_of(1)) == 0
        await sim.start()
        started = await sim.start_time()
        await sim.serve(ids_of(2))  # only in its replay buffer: nobody subscribes yet
        margin = sub.settings.restart_margin_s
        await asyncio.sleep(max(0.0, started + margin + 0.2 - time.time()))
        forwarder = Forwarder(upstream, front)
        await until(lambda: epp.holds(ids_of(2)) == 10, 20, "the resync from the new process")
        await until(lambda: sub.state.resynced_at is not None, 20, "the resync to finish")
        resynced_at = sub.state.resynced_at
        assert resynced_at is not None and resynced_at >= started + margin
        resyncs = sub.state.resyncs

        await epp.page()  # the new start time
        assert epp.resets == 1 and sub.state.restarts == 1
        assert sub.state.restart_drops_skipped == 1
        assert epp.mode.stats.counts["restart_drops_skipped"] == 1
        assert epp.holds(ids_of(2)) == 10  # not dropped by either
        await asyncio.sleep(0.5)
        assert sub.state.resyncs == resyncs  # and not replayed again
        assert epp.holds(ids_of(2)) == 10 and epp.holds(ids_of(1)) == 0
        assert set(epp.index.engine_blocks("pod-0")) == await sim.engine_blocks()
    finally:
        await epp.close()
        if forwarder is not None:
            forwarder.close()
        sim.stop()
