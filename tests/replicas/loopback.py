"""Replicas over real loopback sockets, for the tests of this directory: a resolver the
test controls, a `Replica` (ReplicaSync with its router, store and index), `running`
(servers first, then links), `until`, and raw connections for hostile input."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

from helpers import config, router_with

from epp.config import DEFAULT_WEIGHTS
from epp.replicas import ReplicaSync
from epp.replicas.protocol import HEADER, Hello, encode
from epp.request import IncomingRequest

PODS = [
    {"name": "a", "address": "127.0.0.1:8001", "model": "m"},
    {"name": "b", "address": "127.0.0.1:8002", "model": "m"},
]
SECTIONS = {"scheduling": {"weights": DEFAULT_WEIGHTS}}


def body(topic: str) -> bytes:
    return json.dumps({"model": "m", "prompt": f"{topic} " * 2000}).encode()


class Names:
    """A resolver for the test: name -> addresses; a missing name fails like NXDOMAIN."""

    def __init__(self) -> None:
        self.table: dict[str, list[tuple[str, int]]] = {}
        self.lookups = 0

    async def __call__(self, host: str, port: int) -> list[tuple[str, int]]:
        self.lookups += 1
        if host not in self.table:
            raise OSError(f"cannot resolve {host}")
        return list(self.table[host])


class Replica:
    def __init__(self, replica_id: str, peers: list[str], names: Names, **replicas) -> None:
        settings = {"peers": peers, "listen_host": "127.0.0.1", "listen_port": 0}
        settings.update(replicas)
        cfg = config(replicas=settings, **SECTIONS)
        self.router, self.store, self.index, self.metrics = router_with(
            PODS, replicas=settings, **SECTIONS
        )
        self.sync = ReplicaSync(
            cfg, self.store, self.index, self.router.scheduler, self.router, self.metrics,
            replica_id=replica_id, resolver=names,
        )  # fmt: skip

    @property
    def port(self) -> int:
        return self.sync.server.port

    def route(self, topic: str):
        return self.router.route_now(
            IncomingRequest(path="/v1/completions", body=body(topic), request_id=topic)
        )

    def hashes(self, topic: str) -> list[int]:
        return list(
            self.router.prepare(
                IncomingRequest(path="/v1/completions", body=body(topic), request_id="x")
            ).hashes
        )

    def sample(self, name: str, labels: dict | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def received(self, outcome: str) -> float:
        return self.sample("epp_replica_decisions_received_total", {"outcome": outcome})


async def until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(*replicas: Replica):
    """Start the servers first (their ports are then known to the names), then the links."""
    for r in replicas:
        await r.sync.server.start()
    try:
        yield
    finally:
        for r in replicas:
            await r.sync.stop()


def start_links(*replicas: Replica) -> None:
    for r in replicas:
        r.sync.peers.start()


async def raw_connection(port: int, hello: Hello | None = None):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if hello is not None:
        writer.write(encode(hello))
        await writer.drain()
        header = await reader.readexactly(4)
        await reader.readexactly(HEADER.unpack(header)[0])  # the server's hello
    return reader, writer


async def closed(reader: asyncio.StreamReader) -> bool:
    """True when the server closes the connection (what it sends meanwhile is skipped)."""
    try:
        while await asyncio.wait_for(reader.read(65536), 5.0):
            pass
    except ConnectionError:
        pass
    return True
