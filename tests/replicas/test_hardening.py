"""The peers port under attack (issue 15, finding 4), over real loopback sockets: nothing
listens without peers; a forged decision cannot keep a pod from traffic (values bounded
to what a real request carries, out-of-range frames dropped and counted, what a peer adds
to a pod's prefill lane fading within replicas.load_ttl_s); connections that say nothing,
or many from one address, cannot keep a real peer out; handshake and idle timeouts close
what holds a slot, and a real peer with nothing to send pings so that it is not closed."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time

import pytest
from helpers import config
from replicas.loopback import Names, Replica, closed, raw_connection, running, start_links, until

from epp.app import EppService
from epp.config import EppConfig
from epp.replicas.protocol import PROTOCOL_VERSION, Decision, Hello, Ping, encode
from epp.scheduling.scorers.prefill import PrefillScorer

SECRET = "3f1c0a9e5b7d2468ace0bdf13579b2d4"
ATTACKER = "127.0.0.2"  # another source address on loopback: the attacker's connections


def lane_ahead(r: Replica, pod: str) -> float:
    scorer = r.router.scheduler.scorer("prefill")
    assert isinstance(scorer, PrefillScorer)
    return scorer.state(r.store.get(pod)).lane_end - r.store.now()


def rejected(r: Replica, reason: str) -> float:
    return r.sample("epp_replica_connections_rejected_total", {"reason": reason})


def invalid(r: Replica, reason: str) -> float:
    return r.sample("epp_replica_decisions_invalid_total", {"reason": reason})


def share_of(r: Replica, pod: str, topics: list[str]) -> int:
    """Route each topic once (nothing completes) and count those that went to `pod`."""
    return sum(r.route(topic).endpoint.name == pod for topic in topics)


async def connect_from(host: str, port: int, hello: Hello | None = None):
    """A raw connection from source address `host`, with an optional hello (its answer read)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    if hello is not None:
        writer.write(encode(hello))
        await writer.drain()
        await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))
    return reader, writer


# -- the listener exists only with peers -------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refuses(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("peers", [[], ["127.0.0.1:1"]], ids=["no-peers", "peers"])
async def test_the_peers_port_listens_only_when_peers_are_configured(peers):
    port = free_port()
    settings = {"peers": peers, "listen_host": "127.0.0.1", "listen_port": port}
    service = EppService(
        EppConfig.model_validate(
            {
                "server": {
                    "grpc_host": "127.0.0.1",
                    "grpc_port": 0,
                    "grpc_health_port": 0,
                    "metrics_host": "127.0.0.1",
                    "metrics_port": 0,
                },
                "replicas": settings,
            }
        )
    )
    await service.start()
    try:
        assert (service.replicas is not None) == bool(peers)
        assert refuses(port) == (not peers)
        families = {m.name for m in service.metrics.registry.collect()}
        assert ("epp_replica_connections_rejected" in families) == bool(peers)
    finally:
        await service.stop(grace_s=0.1)


# -- frames: bounded, dropped and counted, fading ------------------------------------------
async def test_one_forged_frame_no_longer_keeps_a_pod_from_traffic():
    """The issue's attack: no secret, one 42-byte decision claiming a 2**31-token prompt
    for pod a pushed a's prefill lane 5.4 days ahead; a got no traffic until restart."""
    a = Replica("ra", [], Names())
    async with running(a):
        _, writer = await raw_connection(a.port, Hello("evil", PROTOCOL_VERSION, 16))
        frame = encode(Decision("evil", "a", [], 2**31, 0, 2**31, time.time()))
        assert len(frame) == 42
        writer.write(frame)
        await writer.drain()
        outcomes = ("applied", "late", "unknown_pod", "invalid")
        await until(lambda: sum(map(a.received, outcomes)) == 1, what="the forged frame")
        ahead = lane_ahead(a, "a")
        assert share_of(a, "a", [f"t{i}" for i in range(40)]) >= 10  # half of 40, roughly
        assert ahead <= 0.0  # dropped: nothing of it in the lane
        assert a.received("invalid") == invalid(a, "prompt_tokens") == 1
        assert not writer.is_closing() and a.sync.server.connections == 1  # dropped, not cut
        writer.close()


async def test_a_flood_of_valid_maximal_frames_fades_within_load_ttl():
    """Frames within the bounds (the longest prompt allowed) still cannot push the lane
    beyond their arrival + load_ttl_s: once they stop, the pod is back within that. A
    load_ttl_s of 2 s: the flood's share is still in the lane when it is read, even on a
    loaded machine stalled for a while after the last frame."""
    a = Replica("ra", [], Names(), load_ttl_s=2.0)
    biggest = a.sync.inbox._max_prompt_tokens
    assert biggest == 1_048_576  # replicas.max_prompt_tokens' default
    async with running(a):
        _, writer = await raw_connection(a.port, Hello("mallory", PROTOCOL_VERSION, 16))
        for _ in range(100):
            writer.write(encode(Decision("mallory", "a", [], biggest, 0, biggest, time.time())))
        await writer.drain()
        await until(lambda: a.received("applied") == 100, what="the flood")
        assert 0.0 < lane_ahead(a, "a") <= 2.0  # not 100 x 227 s
        await asyncio.sleep(2.1)
        a.store.refresh_health()  # the maintenance pass: peer dispatches past load_ttl_s go
        assert lane_ahead(a, "a") <= 0.0 and not a.store.get("a").peer
        assert share_of(a, "a", [f"t{i}" for i in range(40)]) >= 10
        writer.close()


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"prompt_tokens": 1_048_577, "uncached": 16}, "prompt_tokens"),
        ({"prompt_tokens": 16, "uncached": 17}, "uncached"),
        ({"hashes": [1, 2], "matched": 3}, "matched"),
        ({"at": math.nan}, "at"),
        ({"at": math.inf}, "at"),
    ],
    ids=["prompt_tokens", "uncached", "matched", "at-nan", "at-inf"],
)
async def test_a_decision_no_real_request_makes_is_dropped_and_counted(fields, reason):
    a = Replica("ra", [], Names())
    values = {"replica": "mallory", "pod": "a", "hashes": [1, 2], "prompt_tokens": 64}
    values |= {"matched": 0, "uncached": 64, "at": time.time()} | fields
    async with running(a):
        _, writer = await raw_connection(a.port, Hello("mallory", PROTOCOL_VERSION, 16))
        writer.write(encode(Decision(**values)))
        # The connection goes on: the next decision, a real one, is applied.
        writer.write(encode(Decision("mallory", "a", [9], 16, 0, 16, time.time())))
        await writer.drain()
        await until(lambda: a.received("applied") == 1, what="the next decision")
        assert a.received("invalid") == invalid(a, reason) == 1
        assert a.index.match([1, 2]) == {}  # nothing of the invalid one recorded
        writer.close()


def test_the_bound_is_configurable_and_a_longer_context_passes():
    cfg = config(replicas={"peers": ["x:1"], "max_prompt_tokens": 10_000_000})
    assert cfg.replicas.max_prompt_tokens == 10_000_000
    with pytest.raises(ValueError):
        config(replicas={"max_prompt_tokens": 0})


# -- connections: timeouts and a limit that silence cannot hold ------------------------------
async def test_idle_connections_do_not_lock_a_real_peer_out():
    """70 connections (the limit is 64) from one address, half silent and half past their
    hello and silent; then a real peer connects and its decisions are applied, well before
    any handshake timeout (5 s) could have freed a slot."""
    names = Names()
    a, b = Replica("ra", [], names), Replica("rb", ["a:1"], names)
    assert a.sync.server._max_connections == 64
    async with running(a, b):
        idle = [
            await connect_from(
                ATTACKER, a.port, Hello(f"m{i}", PROTOCOL_VERSION, 16) if i % 2 else None
            )
            for i in range(70)
        ]
        assert a.sync.server.connections == 64
        names.table = {"a": [("127.0.0.1", a.port)]}
        start_links(b)
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, 3.0, "b connected")
        b.route("alpha")
        await until(lambda: a.received("applied") == 1, 3.0, "b's decision applied")
        assert rejected(a, "evicted") >= 7
        assert a.sync.server.connections <= 64
        for _, w in idle:
            w.close()


async def test_with_a_secret_connections_that_never_prove_cannot_keep_a_peer_out(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    names = Names()
    a = Replica("ra", [], names, secret_file=str(secret))
    b = Replica("rb", ["a:1"], names, secret_file=str(secret))
    async with running(a, b):
        idle = [await connect_from(ATTACKER, a.port) for _ in range(80)]
        names.table = {"a": [("127.0.0.1", a.port)]}
        start_links(b)
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, 3.0, "b connected")
        # More silent ones after it: they push out each other, never the authenticated peer.
        idle += [await connect_from(ATTACKER, a.port) for _ in range(80)]
        b.route("alpha")
        await until(lambda: a.received("applied") == 1, 3.0, "b's decision applied")
        assert b.sample("epp_replica_peers_connected") == 1
        for _, w in idle:
            w.close()


async def test_when_every_slot_is_an_authenticated_peer_a_newcomer_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    names = Names()
    a = Replica("ra", [], names, secret_file=str(secret), max_connections=2)
    peers = [Replica(f"r{i}", ["a:1"], names, secret_file=str(secret)) for i in range(2)]
    async with running(a, *peers):
        names.table = {"a": [("127.0.0.1", a.port)]}
        start_links(*peers)
        for p in peers:
            await until(lambda p=p: p.sample("epp_replica_peers_connected") == 1, what="peer")
        reader, writer = await connect_from(ATTACKER, a.port)
        assert await closed(reader)
        assert rejected(a, "limit") == 1 and rejected(a, "evicted") == 0
        assert all(p.sample("epp_replica_peers_connected") == 1 for p in peers)
        writer.close()


async def test_a_connection_that_does_not_complete_its_hello_in_time_is_closed_and_counted():
    a = Replica("ra", [], Names(), handshake_timeout_s=0.2)
    async with running(a):
        reader, writer = await raw_connection(a.port)
        started = time.monotonic()
        assert await closed(reader)
        assert time.monotonic() - started < 2.0
        assert rejected(a, "handshake_timeout") == 1 and a.sync.server.connections == 0
        writer.close()


async def test_a_silent_connection_is_closed_after_the_idle_timeout_and_a_real_peer_pings():
    names = Names()
    a = Replica("ra", [], names, idle_timeout_s=1.0)
    b = Replica("rb", ["a:1"], names)
    async with running(a, b):
        reader, writer = await raw_connection(a.port, Hello("mallory", PROTOCOL_VERSION, 16))
        writer.write(encode(Ping()))  # a ping resets the clock; then nothing
        await writer.drain()
        started = time.monotonic()
        assert await closed(reader)
        assert 0.9 <= time.monotonic() - started < 3.0
        assert rejected(a, "idle") == 1
        writer.close()
        names.table = {"a": [("127.0.0.1", a.port)]}
        start_links(b)
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, what="b connected")
        connection = a.sync.server._by_replica["rb"]
        await asyncio.sleep(3.5)  # three idle timeouts with nothing to send
        assert a.sync.server._by_replica["rb"] is connection and rejected(a, "idle") == 1
        b.route("alpha")
        await until(lambda: a.received("applied") == 1, what="still delivers")


@pytest.mark.parametrize(("announced", "pings"), [(0.0, False), (0.6, True)])
async def test_a_link_pings_only_a_listener_that_announced_an_idle_timeout(announced, pings):
    """An older listener knows no Ping (it would close the connection) and announces no
    idle timeout: it gets none. One that announces 0.6 s gets one every 0.2 s."""
    names = Names()
    b = Replica("rb", ["l:1"], names)
    received = bytearray()

    async def listener(reader, writer):
        await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))
        writer.write(encode(Hello("rl", PROTOCOL_VERSION, 16, idle_timeout_s=announced)))
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                received.extend(data)

    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    names.table = {"l": [("127.0.0.1", server.sockets[0].getsockname()[1])]}
    async with running(b):
        b.sync.peers.start()
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, what="connected")
        await asyncio.sleep(1.0)
        ping = encode(Ping())
        assert (received.count(ping) >= 3) == pings and len(received) % len(ping) == 0
    server.close()


async def test_a_failing_membership_update_costs_one_round_not_the_loop(monkeypatch):
    names = Names()
    a, b = Replica("ra", ["b:1"], names, resolve_s=0.05), Replica("rb", [], names)
    calls = []
    update = a.sync.peers.update

    def failing_once(targets):
        calls.append(targets)
        if len(calls) == 1:
            raise RuntimeError("a bug in update()")
        update(targets)

    monkeypatch.setattr(a.sync.peers, "update", failing_once)
    async with running(a, b):
        names.table = {"b": [("127.0.0.1", b.port)]}
        a.sync.peers.start()
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="next round")
        assert len(calls) >= 2
