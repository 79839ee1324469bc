"""Replicas over real loopback sockets: decisions flow both ways, a replica listed among
its own peers parks that link, peer names are resolved and re-resolved, a slow or absent
peer costs bounded memory and never blocks, links reconnect and a new replica gets the
recent history, response ends reach the replica that routed, and hostile input closes
only its own connection."""

from __future__ import annotations

import asyncio
import socket

import pytest
from helpers import config
from replicas.loopback import (
    Names,
    Replica,
    closed,
    raw_connection,
    running,
    start_links,
    until,
)

import epp.replicas.link as link_module
import epp.replicas.peers as peers_module
from epp.replicas.peers import PeerSet
from epp.replicas.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    Decision,
    Hello,
    decode,
    encode,
    read_frame,
)


async def test_two_replicas_share_decisions_both_ways():
    names = Names()
    a, b = Replica("ra", ["b:1"], names), Replica("rb", ["a:1"], names)
    async with running(a, b):
        names.table = {"a": [("127.0.0.1", a.port)], "b": [("127.0.0.1", b.port)]}
        start_links(a, b)
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="a connected")
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, what="b connected")

        first = a.route("alpha")
        await until(lambda: b.received("applied") == 1, what="b received")
        pod = b.store.get(first.endpoint.name)
        assert b.index.match(a.hashes("alpha")) == {pod.name: len(a.hashes("alpha"))}
        assert len(pod.peer) == 1  # counted in the pod's load at b until a page shows it
        # The next turn of that prompt, routed by b, lands on the same pod.
        second = b.route("alpha")
        assert second.endpoint.name == first.endpoint.name
        assert second.decision.factor("cache") == 1.0
        await until(lambda: a.received("applied") == 1, what="a received")
        assert a.sample("epp_replica_decisions_sent_total") == 1
        assert b.sample("epp_replica_decisions_sent_total") == 1


async def test_a_replica_listed_among_its_own_peers_parks_that_link():
    """A headless Service lists every replica, this one included."""
    names = Names()
    a, b = Replica("ra", ["svc:1"], names), Replica("rb", ["svc:1"], names)
    async with running(a, b):
        names.table = {"svc": [("127.0.0.1", a.port), ("127.0.0.1", b.port)]}
        start_links(a, b)
        await until(lambda: ("127.0.0.1", a.port) in a.sync.peers.links, what="resolved")
        own = a.sync.peers.links[("127.0.0.1", a.port)]
        await until(lambda: own.state == "self", what="self detected")
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="a connected")
        assert a.sample("epp_replica_peers") == 1  # the peer count leaves itself out
        a.route("alpha")
        await until(lambda: b.received("applied") == 1, what="b received")
        assert not own.queue  # nothing queued for itself
        await asyncio.sleep(0.1)
        assert a.received("applied") == 0 and a.received("self") == 0


async def test_a_name_standing_for_several_replicas_connects_each_of_them():
    names = Names()
    replicas = [Replica(f"r{i}", ["svc:1"], names) for i in range(3)]
    async with running(*replicas):
        names.table = {"svc": [("127.0.0.1", r.port) for r in replicas]}
        start_links(*replicas)
        for r in replicas:
            await until(lambda r=r: r.sample("epp_replica_peers_connected") == 2, what="mesh")
        replicas[0].route("alpha")
        await until(
            lambda: all(r.received("applied") == 1 for r in replicas[1:]), what="both received"
        )


async def test_peer_names_are_re_resolved_and_a_failed_lookup_keeps_the_last_answer():
    names = Names()
    a = Replica("ra", ["svc:1"], names, resolve_s=0.05)
    b, c = Replica("rb", [], names), Replica("rc", [], names)
    async with running(a, b, c):
        names.table = {"svc": [("127.0.0.1", b.port)]}
        start_links(a)
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="b linked")
        names.table = {"svc": [("127.0.0.1", b.port), ("127.0.0.1", c.port)]}  # scaled up
        await until(lambda: a.sample("epp_replica_peers_connected") == 2, what="c linked")
        names.table = {}  # NXDOMAIN, e.g. a DNS blip: the links stay
        lookups = names.lookups
        await until(lambda: names.lookups > lookups + 2, what="lookups")
        assert set(a.sync.peers.links) == {("127.0.0.1", b.port), ("127.0.0.1", c.port)}
        names.table = {"svc": [("127.0.0.1", c.port)]}  # b scaled away
        await until(lambda: set(a.sync.peers.links) == {("127.0.0.1", c.port)}, what="b gone")
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="gauge")


async def test_a_full_queue_for_an_absent_peer_loses_its_oldest_frames():
    names = Names()
    a = Replica("ra", ["down:1"], names, queue_size=5)
    probe = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()  # nothing listens on `port` now
    async with running(a):
        names.table = {"down": [("127.0.0.1", port)]}
        await a.sync.peers.resolve_all()
        a.sync.peers.update(await a.sync.peers.resolve_all())
        link = a.sync.peers.links[("127.0.0.1", port)]
        routed = [a.route(f"topic{i}") for i in range(8)]  # routing goes on regardless
        assert len(routed) == 8
        assert len(link.queue) == 5
        assert a.sample("epp_replica_decisions_dropped_total") == 3
        kept = [decode(frame[4:]) for _, frame in link.queue]
        assert [m.hashes for m in kept] == [a.hashes(f"topic{i}") for i in range(3, 8)]


async def test_a_peer_that_stops_reading_costs_a_bounded_queue_and_never_blocks_routing():
    names = Names()
    a = Replica("ra", ["slow:1"], names, queue_size=50)
    accepted = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(encode(Hello("slow", PROTOCOL_VERSION, 16)))  # then never reads
        held.append(writer)
        accepted.set()

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with running(a):
            names.table = {"slow": [("127.0.0.1", port)]}
            start_links(a)
            await accepted.wait()
            await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="link")
            link = a.sync.peers.links[("127.0.0.1", port)]
            # 8,192 hashes each (~74 KB): the socket's buffers fill within a few frames.
            big = encode(Decision("ra", "a", list(range(2**63, 2**63 + 8192)), 1, 0, 1, 0.0))
            for _ in range(200):
                a.sync.peers.broadcast(big)  # returns at once, whatever the peer does
                await asyncio.sleep(0)  # let the link write what the socket takes
            assert len(link.queue) <= 50
            assert a.sample("epp_replica_decisions_dropped_total") > 0
    finally:
        for w in held:
            w.close()
        server.close()


async def test_links_reconnect_and_a_new_replica_gets_the_recent_history():
    names = Names()
    a = Replica("ra", ["b:1"], names, backoff_max_s=0.1)
    b = Replica("rb", [], names)
    async with running(a):
        # b is not up yet: a's decisions wait in its queue.
        probe = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        names.table = {"b": [("127.0.0.1", port)]}
        start_links(a)
        for topic in ("t0", "t1"):
            a.route(topic)
        b.sync.server.port = port
        await b.sync.server.start()
        try:
            await until(
                lambda: b.index.nodes > 0 and b.received("applied") + b.received("late") == 2,
                what="b got the backlog",
            )
        finally:
            await b.sync.stop()
        a.route("t2")  # while b is down
        # b restarts: a new process, a new replica id, the same address.
        b2 = Replica("rb2", [], names)
        b2.sync.server.port = port
        await b2.sync.server.start()
        try:
            await until(
                lambda: b2.received("applied") + b2.received("late") == 3,
                what="b2 got the history",
            )
            for topic in ("t0", "t1", "t2"):
                assert max(b2.index.match(a.hashes(topic)).values()) == len(a.hashes(topic))
        finally:
            await b2.sync.stop()


async def test_the_end_of_a_request_seen_by_another_replica_releases_it_where_it_was_routed():
    names = Names()
    a, b = Replica("ra", ["b:1"], names), Replica("rb", ["a:1"], names)
    async with running(a, b):
        names.table = {"a": [("127.0.0.1", a.port)], "b": [("127.0.0.1", b.port)]}
        start_links(a, b)
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, what="b->a")
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="a->b")
        routed = a.route("alpha")
        assert routed.endpoint.in_flight == 1
        # b's observer stream saw the response end of a's decision.
        b.router.complete(routed.token, 200, routed.endpoint.address)
        await until(lambda: routed.endpoint.in_flight == 0, what="released at a")
        assert a.sample("epp_replica_completions_received_total") == 1
        assert b.sample("epp_replica_completions_forwarded_total") == 1


# -- hostile input --------------------------------------------------------------------
PEER = Hello("mallory", PROTOCOL_VERSION, 16)


@pytest.mark.parametrize(
    ("hello", "payload", "reason"),
    [
        (None, HEADER.pack(2**31) + b"x", "bad_frame"),  # huge first frame
        (None, HEADER.pack(3) + b"\xc1\xc1\xc1", "bad_frame"),  # not msgpack
        (None, encode(Decision("mallory", "a", [1], 16, 0, 16, 0.0)), "bad_frame"),  # no hello
        (None, encode(Hello("mallory", PROTOCOL_VERSION, 32)), "incompatible"),  # block size
        (None, encode(Hello("mallory", PROTOCOL_VERSION + 1, 16)), "incompatible"),
        (PEER, HEADER.pack(50_000_000), "bad_frame"),  # above the frame bound
        (PEER, HEADER.pack(4) + b"\x94\x01\x02\x03", "bad_frame"),  # wrong shape
        (PEER, encode(Decision("alice", "a", [1], 16, 0, 16, 0.0)), "bad_frame"),  # signed
        (PEER, encode(PEER), "bad_frame"),  # a second hello
    ],
)
async def test_a_bad_frame_closes_only_its_connection(hello, payload, reason):
    names = Names()
    a, good = Replica("ra", [], names), Replica("rgood", ["a:1"], names)
    async with running(a):
        reader, writer = await raw_connection(a.port, hello)
        writer.write(payload)
        await writer.drain()
        assert await closed(reader)
        writer.close()
        assert a.sample("epp_replica_connections_rejected_total", {"reason": reason}) == 1
        assert a.index.nodes == 0 and all(not e.peer for e in a.store.all())
        # The server goes on: a well-behaved peer is served.
        names.table = {"a": [("127.0.0.1", a.port)]}
        start_links(good)
        await until(lambda: good.sample("epp_replica_peers_connected") == 1, what="good peer")
        good.route("alpha")
        await until(lambda: a.received("applied") == 1, what="applied")
        await good.sync.stop()


async def test_a_peer_that_says_nothing_is_dropped_after_the_handshake_timeout():
    a = Replica("ra", [], Names())
    a.sync.server._handshake_timeout = 0.1
    async with running(a):
        reader, writer = await raw_connection(a.port)
        assert await closed(reader)
        writer.close()


async def test_connections_beyond_the_limit_push_out_the_longest_silent():
    """Without a secret anything completes a hello: at the limit the connection silent the
    longest goes (test_hardening.py has the rest of the policy)."""
    a = Replica("ra", [], Names())
    a.sync.server._max_connections = 2
    async with running(a):
        kept = [
            await raw_connection(a.port, Hello(f"p{i}", PROTOCOL_VERSION, 16)) for i in range(2)
        ]
        kept[1][1].write(encode(Decision("p1", "a", [1], 16, 0, 16, 0.0)))  # p1 spoke last
        await kept[1][1].drain()
        await until(lambda: a.received("late") == 1, what="p1's frame")
        reader, writer = await raw_connection(a.port)
        assert await closed(kept[0][0])  # p0: silent the longest
        assert a.sample("epp_replica_connections_rejected_total", {"reason": "evicted"}) == 1
        assert not kept[1][1].is_closing() and a.sync.server.connections == 2
        for _, w in [*kept, (reader, writer)]:
            w.close()


async def test_a_replica_that_reconnects_replaces_its_older_connection():
    a = Replica("ra", [], Names())
    async with running(a):
        old_reader, old_writer = await raw_connection(a.port, PEER)
        _new_reader, new_writer = await raw_connection(a.port, PEER)
        assert await closed(old_reader)  # one replica, one connection: nothing twice
        new_writer.write(encode(Decision("mallory", "a", [7], 16, 0, 16, 0.0)))
        await new_writer.drain()
        await until(lambda: a.received("late") == 1, what="applied once")
        for w in (old_writer, new_writer):
            w.close()


async def test_one_replica_at_two_addresses_is_sent_to_once():
    names = Names()
    a = Replica("ra", ["b1:1", "b2:1"], names)
    b = Replica("rb", [], names, listen_host="0.0.0.0")
    async with running(a, b):
        names.table = {"b1": [("127.0.0.1", b.port)], "b2": [("127.0.0.2", b.port)]}
        start_links(a)
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="one link")
        await until(
            lambda: (
                sorted(link.state for link in a.sync.peers.links.values())
                == ["connected", "duplicate"]
            ),
            what="the other waits",
        )
        a.route("alpha")
        await until(lambda: b.received("applied") == 1, what="received")
        await asyncio.sleep(0.2)
        assert b.received("applied") == 1


async def test_peer_set_accepts_host_port_and_bracketed_ipv6():
    """Both spellings pass the config validator and are split into the right host and port;
    a bracketed IPv6 peer is then resolved (the real resolver, no test table) and dialled
    over ::1, and a decision crosses it."""
    specs = ["epp-peers.ns.svc:9010", "[::1]:9010", "10.0.0.7:9010"]
    assert config(replicas={"peers": specs}).replicas.peers == specs
    peer_set = Replica("rs", specs, Names()).sync.peers
    assert isinstance(peer_set, PeerSet)
    assert peer_set.specs == [("epp-peers.ns.svc", 9010), ("::1", 9010), ("10.0.0.7", 9010)]
    for bad in ["no-port", "host:", ":9010", "host:port", "host:0", "host:65536", "[::1]"]:
        with pytest.raises(ValueError, match="a peer must be host:port"):
            config(replicas={"peers": [bad]})

    b = Replica("rb", [], Names(), listen_host="::1")
    async with running(b):
        a = Replica("ra", [f"[::1]:{b.port}"], peers_module.resolve)
        async with running(a):
            assert await a.sync.peers.resolve_all() == {("::1", b.port)}
            start_links(a)
            await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="a dialled ::1")
            a.route("over ipv6")
            await until(lambda: b.received("applied") == 1, what="b received over ::1")


async def test_a_restarted_replica_that_connects_gets_the_history_without_waiting_a_backoff(
    monkeypatch,
):
    """Its own link dials the survivor at once; the survivor, seeing a replica it never
    greeted, ends its reconnect delay (here 30 s) and sends the history."""
    monkeypatch.setattr("epp.replicas.link.BACKOFF_MIN_S", 30.0)
    names = Names()
    a = Replica("ra", ["b:1"], names, backoff_max_s=30.0)
    async with running(a):
        probe = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        names.table = {"a": [("127.0.0.1", a.port)], "b": [("127.0.0.1", port)]}
        start_links(a)
        link_to_b = None
        await until(lambda: ("127.0.0.1", port) in a.sync.peers.links, what="resolved")
        link_to_b = a.sync.peers.links[("127.0.0.1", port)]
        a.route("t0")
        await asyncio.sleep(0.05)  # the first attempt failed: a now waits 30 s
        assert link_to_b.current == "connecting"
        b = Replica("rb", ["a:1"], names)
        b.sync.server.port = port
        async with running(b):
            start_links(b)
            await until(
                lambda: b.received("late") + b.received("applied") == 1, timeout=5.0, what="history"
            )
            assert max(b.index.match(a.hashes("t0")).values()) == len(a.hashes("t0"))


async def test_queues_and_history_are_bounded_in_bytes_as_well_as_frames(monkeypatch):
    """A frame is ~1 KB for a 2,000-token prompt but up to 74 KB at 8,192 blocks: the
    frame counts alone would allow hundreds of MB."""
    monkeypatch.setattr("epp.replicas.link.MAX_QUEUE_BYTES", 3000)
    monkeypatch.setattr("epp.replicas.peers.MAX_HISTORY_BYTES", 5000)
    names = Names()
    a = Replica("ra", ["down:1"], names, queue_size=100, history=100)
    names.table = {"down": [("127.0.0.1", 9)]}  # never connected: update() only
    peers = a.sync.peers
    peers.update(await peers.resolve_all())
    link = peers.links[("127.0.0.1", 9)]
    big = 2**63
    frames = [
        encode(Decision("ra", "a", list(range(big + i, big + i + 100)), 1, 0, 1, 0.0))
        for i in range(10)
    ]
    size = len(frames[0])  # about 1 KB each
    for frame in frames:
        peers.broadcast(frame)
    assert link.queued_bytes == sum(len(f) for _, f in link.queue) <= 3000
    assert [f for _, f in link.queue] == frames[-(3000 // size) :]
    assert a.sample("epp_replica_decisions_dropped_total") == 10 - 3000 // size
    history = peers.history_for("new-replica")
    assert history == frames[-(5000 // size) :]
    assert peers.history_for("new-replica") == []  # once per replica
    await peers.stop()


async def test_history_keeps_the_last_frames_by_count():
    names = Names()
    a = Replica("ra", [], names, history=3)
    for i in range(5):
        a.sync.peers.broadcast(bytes([i]))
    assert a.sync.peers.history_for("x") == [bytes([2]), bytes([3]), bytes([4])]


async def test_a_link_connected_to_itself_is_a_failed_attempt_not_this_replica(monkeypatch):
    """Dialling a free port of this host can connect a socket to itself (TCP's simultaneous
    open, when the kernel picks that port as the source): the link reads its own hello
    back. That is no peer: the link must keep trying, not park for good as `self`."""
    real_open = asyncio.open_connection
    attempts = 0

    async def self_connected(host: str, port: int, **kwargs):
        nonlocal attempts
        attempts += 1
        if attempts > 1:
            return await real_open(host, port, **kwargs)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.connect(sock.getsockname())  # connected to itself
        return await real_open(sock=sock)

    monkeypatch.setattr("epp.replicas.link.asyncio.open_connection", self_connected)
    names = Names()
    a, b = Replica("ra", ["b:1"], names), Replica("rb", [], names)
    async with running(a, b):
        names.table = {"b": [("127.0.0.1", b.port)]}
        start_links(a)
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="b reached")
        assert attempts >= 2
        a.route("alpha")
        await until(lambda: b.received("applied") == 1, what="b received")


async def test_the_history_goes_again_when_its_connection_failed_at_once():
    """A replica seen for the first time gets the history once; when the connection that
    carried it fails right away (the peer closed or replaced it before reading), the
    next connection carries it again."""
    names = Names()
    a = Replica("ra", ["b:1"], names, backoff_max_s=0.2)
    a.route("t0")  # in the history before any peer is known
    handshakes = 0

    async def hello_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        nonlocal handshakes
        await read_frame(reader, 4096)
        writer.write(encode(Hello("rb", PROTOCOL_VERSION, 16)))
        await writer.drain()
        handshakes += 1
        writer.close()

    async with running(a):
        fake = await asyncio.start_server(hello_then_close, "127.0.0.1", 0)
        port = fake.sockets[0].getsockname()[1]
        names.table = {"b": [("127.0.0.1", port)]}
        start_links(a)
        await until(lambda: handshakes >= 1, what="the first connection")
        fake.close()
        await fake.wait_closed()
        b = Replica("rb", [], names)  # the same replica id: only the connection failed
        b.sync.server.port = port
        async with running(b):
            await until(lambda: b.received("late") + b.received("applied") == 1, what="the history")
            assert max(b.index.match(a.hashes("t0")).values()) == len(a.hashes("t0"))


@pytest.mark.parametrize("step", ["asyncio.open_connection", "read_frame"])
async def test_a_link_stopped_as_a_handshake_step_completes_stops(monkeypatch, step):
    """On Python 3.11 asyncio.wait_for returns the awaited result and drops a cancellation
    that arrives as that step completes: a link stopped at that instant went on dialling,
    and stop() (the EPP's shutdown) waited for it forever."""
    owner = asyncio if step.startswith("asyncio.") else link_module
    name = step.rpartition(".")[2]
    real = getattr(owner, name)
    names = Names()
    a, b = Replica("ra", ["b:1"], names), Replica("rb", [], names)

    async def then_stop(*args, **kwargs):
        result = await real(*args, **kwargs)
        for link in a.sync.peers.links.values():
            link._task.cancel()  # the stop request arrives as this step completes
        return result

    async with running(a, b):
        names.table = {"b": [("127.0.0.1", b.port)]}
        monkeypatch.setattr(owner, name, then_stop)
        start_links(a)
        await until(lambda: bool(a.sync.peers.links), what="resolved")
        (link,) = a.sync.peers.links.values()
        await until(lambda: link._task.done(), timeout=2.0, what="the link stopped")
        assert link._task.cancelled()
