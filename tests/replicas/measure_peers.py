"""Figures for docs/reliability.md, "Replica peers" (not a test: run it directly).

    .venv/bin/python tests/replicas/measure_peers.py

Over real loopback sockets with the tests' Replica helpers: the issue's forged frame
(pod a's prefill lane and its share of 40 requests after it), and how long a real peer
takes to connect and have a decision applied behind 200 connections from one address
(silent or past a hello without a secret; silent with one)."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replicas.loopback import Names, Replica, raw_connection, running, start_links, until
from replicas.test_hardening import ATTACKER, SECRET, connect_from, lane_ahead, share_of

from epp.replicas.protocol import PROTOCOL_VERSION, Decision, Hello, encode


async def forged() -> None:
    a = Replica("ra", [], Names())
    async with running(a):
        _, writer = await raw_connection(a.port, Hello("evil", PROTOCOL_VERSION, 16))
        writer.write(encode(Decision("evil", "a", [], 2**31, 0, 2**31, time.time())))
        await writer.drain()
        await until(lambda: a.received("invalid") + a.received("applied") == 1)
        ahead = max(0.0, lane_ahead(a, "a"))
        share = share_of(a, "a", [f"t{i}" for i in range(40)])
        print(f"forged frame: pod a's lane {ahead:.0f} s ahead, a got {share} of 40 requests")
        writer.close()


async def lockout(secret: bool, connections: int = 200) -> None:
    names = Names()
    extra = {}
    if secret:
        path = Path(tempfile.mkdtemp()) / "secret"
        path.write_text(SECRET)
        extra = {"secret_file": str(path)}
    a, b = Replica("ra", [], names, **extra), Replica("rb", ["a:1"], names, **extra)
    async with running(a, b):
        idle = [
            await connect_from(
                ATTACKER,
                a.port,
                None if secret or i % 2 == 0 else Hello(f"m{i}", PROTOCOL_VERSION, 16),
            )
            for i in range(connections)
        ]
        names.table = {"a": [("127.0.0.1", a.port)]}
        started = time.monotonic()
        start_links(b)
        await until(lambda: b.sample("epp_replica_peers_connected") == 1)
        b.route("alpha")
        await until(lambda: a.received("applied") == 1)
        took = (time.monotonic() - started) * 1000
        evicted = a.sample("epp_replica_connections_rejected_total", {"reason": "evicted"})
        print(
            f"{'secret' if secret else 'no secret'}: behind {connections} connections a real "
            f"peer's decision was applied after {took:.1f} ms ({evicted:.0f} evicted)"
        )
        for _, writer in idle:
            writer.close()


async def main() -> None:
    await forged()
    await lockout(secret=False)
    await lockout(secret=True)


if __name__ == "__main__":
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    asyncio.run(main())
