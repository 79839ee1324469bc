"""Shared-secret authentication of peer connections (`replicas.secret_file`): the proofs
and the secret file on their own, then replicas over real loopback sockets. Replicas with
the same secret share decisions; a different secret, or a secret on one side only,
shares nothing in either direction and is counted, logged and backed off; a forged peer
without the secret changes nothing; recorded handshakes replayed to either side fail."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
from replicas.loopback import Names, Replica, closed, running, start_links, until

from epp.config import EppConfig
from epp.replicas import SecretError
from epp.replicas.auth import (
    DIALLER,
    LISTENER,
    MIN_SECRET_BYTES,
    PeerAuth,
    SharedSecret,
    proof,
    read_secret,
)
from epp.replicas.protocol import (
    HEADER,
    NONCE_BYTES,
    PROOF_BYTES,
    PROTOCOL_VERSION,
    Auth,
    Completion,
    Decision,
    Hello,
    decode,
    encode,
    read_frame,
)

SECRET = "3f1c0a9e5b7d2468ace0bdf13579b2d4"  # 32 bytes, as `openssl rand -hex 16` gives
OTHER = "0000000000000000ffffffffffffffff"
NONCE_D, NONCE_L = b"d" * NONCE_BYTES, b"l" * NONCE_BYTES


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def secret_file(tmp_path: Path, text: str, name: str = "secret") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def rejected(replica: Replica, reason: str = "unauthenticated") -> float:
    return replica.sample("epp_replica_connections_rejected_total", {"reason": reason})


def received(replica: Replica) -> float:
    return sum(replica.received(o) for o in ("applied", "late", "unknown_pod", "self"))


def states(replica: Replica) -> list[str]:
    return sorted(link.current for link in replica.sync.peers.links.values())


async def never_connected(*replicas: Replica, seconds: float) -> None:
    """No link of these replicas is connected at any moment of `seconds` (a refused link
    shows "unauthenticated" between attempts and "connecting" during each)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        for r in replicas:
            assert "connected" not in states(r), states(r)
            assert r.sample("epp_replica_peers_connected") == 0
        await asyncio.sleep(0.002)


# -- the proof ------------------------------------------------------------------------
BASE = (SECRET.encode(), DIALLER, "ra", "rb", NONCE_D, NONCE_L)


@pytest.mark.parametrize(
    ("index", "other"),
    [
        (0, OTHER.encode()),  # the secret
        (1, LISTENER),  # the role: a listener's proof is no dialler's
        (2, "rc"),  # the dialler's id
        (3, "rc"),  # the listener's id
        (4, b"e" * NONCE_BYTES),  # the dialler's nonce
        (5, b"m" * NONCE_BYTES),  # the listener's nonce
    ],
    ids=["secret", "role", "dialler", "listener", "dialler_nonce", "listener_nonce"],
)
def test_a_proof_is_bound_to_the_secret_the_role_both_ids_and_both_nonces(index, other):
    changed = list(BASE)
    changed[index] = other
    assert len(proof(*BASE)) == PROOF_BYTES
    assert proof(*changed) != proof(*BASE)


def test_a_proof_is_bound_to_the_protocol_version(monkeypatch):
    before = proof(*BASE)
    monkeypatch.setattr("epp.replicas.auth.PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    assert proof(*BASE) != before


def test_ids_cannot_be_shifted_between_fields():
    """Length-prefixed parts: ("ab", "c") and ("a", "bc") are different transcripts."""
    key = SECRET.encode()
    assert proof(key, DIALLER, "ab", "c", NONCE_D, NONCE_L) != proof(
        key, DIALLER, "a", "bc", NONCE_D, NONCE_L
    )


def auth_with(tmp_path: Path, *secrets: str, clock: Clock | None = None) -> PeerAuth:
    """A PeerAuth whose accepted secrets are `secrets`, the first current (a rotation
    seen: the file changed from the last to the first)."""
    clock = clock or Clock()
    path = secret_file(tmp_path, secrets[-1], name=f"s{len(list(tmp_path.iterdir()))}")
    shared = SharedSecret(path, check_s=1.0, previous_s=100.0, clock=clock)
    for text in reversed(secrets[:-1]):
        path.write_text(text)
        clock.now += 1.0
        shared.accepted()
    assert shared.accepted() == tuple(s.encode() for s in secrets)
    return PeerAuth(shared)


@pytest.mark.parametrize(
    ("listener", "dialler", "proved"),
    [
        ([SECRET], [SECRET], True),
        ([SECRET], [OTHER], False),
        ([OTHER, SECRET], [SECRET], True),  # the listener rotated first
        ([SECRET], [OTHER, SECRET], True),  # the dialler rotated first
        ([OTHER], [SECRET], False),  # the previous one no longer accepted
    ],
)
def test_both_proofs_hold_when_the_replicas_share_an_accepted_secret(
    tmp_path, listener, dialler, proved
):
    at_listener = auth_with(tmp_path, *listener)
    at_dialler = auth_with(tmp_path, *dialler)
    sent = Hello("ra", PROTOCOL_VERSION, 16, nonce=NONCE_D)
    answer = Hello(
        "rb", PROTOCOL_VERSION, 16, nonce=NONCE_L,
        proofs=at_listener.listener_proofs(sent, "rb", NONCE_L),
    )  # fmt: skip
    dialler_proof, listener_proved = at_dialler.dialler_proof(sent, answer)
    assert listener_proved is proved
    assert at_listener.dialler_proved(sent, answer, dialler_proof) is proved


# -- the secret file ------------------------------------------------------------------
def test_the_secret_is_read_with_surrounding_whitespace_stripped(tmp_path):
    path = secret_file(tmp_path, f"  {SECRET}\n")
    assert read_secret(path) == SECRET.encode()
    assert read_secret(secret_file(tmp_path, "x" * MIN_SECRET_BYTES)) == b"x" * MIN_SECRET_BYTES


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", "No such file"),
        (lambda d: d, "Is a directory"),  # unreadable as a file
        (lambda d: secret_file(d, ""), "the secret is 0 bytes"),
        (lambda d: secret_file(d, " short-secret-15 \n"), "the secret is 15 bytes"),
        (lambda d: secret_file(d, "x" * 5000), "larger than 4096 bytes"),
    ],
    ids=["missing", "directory", "empty", "short", "huge"],
)
def test_a_secret_file_that_cannot_be_used_stops_the_replicas_with_its_path(
    tmp_path, make, message
):
    path = make(tmp_path)
    with pytest.raises(SecretError, match=message) as info:
        Replica("ra", ["b:1"], Names(), secret_file=str(path))
    assert str(path) in str(info.value) and "replicas.secret_file" in str(info.value)
    assert "short-secret-15" not in str(info.value)  # never the secret itself


def test_the_config_takes_the_path_and_never_reads_or_holds_the_secret(tmp_path):
    """The chart's rendered config is validated where the file does not exist."""
    config = EppConfig.model_validate({"replicas": {"secret_file": "/nowhere/secret"}})
    assert config.replicas.secret_file == Path("/nowhere/secret")
    assert EppConfig().replicas.secret_file is None  # off by default
    path = secret_file(tmp_path, SECRET)
    replica = Replica("ra", ["b:1"], Names(), secret_file=str(path))
    assert SECRET not in repr(replica.sync.auth.secret)
    assert SECRET not in repr(EppConfig.model_validate({"replicas": {"secret_file": path}}))


@pytest.mark.e2e  # starts `epp serve` as a process
def test_epp_serve_refuses_to_start_with_a_bad_secret_file(tmp_path):
    secret = secret_file(tmp_path, "too-short\n")
    config = tmp_path / "epp.yaml"
    config.write_text(
        "endpoints: [{name: a, address: '127.0.0.1:8001'}]\n"
        "server: {grpc_port: 0, grpc_health_port: 0, metrics_port: 0}\n"
        f"replicas: {{peers: ['127.0.0.1:1'], listen_port: 0, secret_file: '{secret}'}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert f"replicas.secret_file {secret}: the secret is 9 bytes" in output
    assert '"epp_failed"' in output and "Traceback" not in output  # one clear line
    assert "replica_listening" not in output  # nothing was served


def test_a_rotated_secret_signs_at_once_and_the_previous_is_accepted_for_a_while(tmp_path):
    clock = Clock()
    path = secret_file(tmp_path, SECRET)
    shared = SharedSecret(path, check_s=5.0, previous_s=60.0, clock=clock)
    assert shared.accepted() == (SECRET.encode(),)
    path.write_text(OTHER + "\n")
    clock.now = 4.0
    assert shared.accepted() == (SECRET.encode(),)  # not checked yet
    clock.now = 5.0
    assert shared.accepted() == (OTHER.encode(), SECRET.encode())
    assert shared.reloads == 1
    clock.now = 64.9
    assert shared.accepted() == (OTHER.encode(), SECRET.encode())
    clock.now = 65.0
    assert shared.accepted() == (OTHER.encode(),)


def test_a_bad_replacement_is_logged_once_and_the_last_secret_kept(tmp_path):
    clock = Clock()
    path = secret_file(tmp_path, SECRET)
    shared = SharedSecret(path, check_s=1.0, clock=clock)
    path.write_text("short")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            clock.now += 1.0
            assert shared.accepted() == (SECRET.encode(),)
    failures = [e for e in logs if e["event"] == "replica_secret_reload_failed"]
    assert len(failures) == 1 and "the secret is 5 bytes" in failures[0]["error"]
    assert shared.reloads == 0


def test_a_file_read_half_written_is_not_taken(tmp_path, monkeypatch):
    """A file rewritten in place can be read mid-write: a new content is taken only when
    a second read agrees."""
    clock = Clock()
    shared = SharedSecret(secret_file(tmp_path, SECRET), check_s=1.0, clock=clock)
    reads = iter([b"half-written-secr", OTHER.encode(), OTHER.encode(), OTHER.encode()])
    monkeypatch.setattr("epp.replicas.auth.read_secret", lambda path: next(reads))
    clock.now = 1.0
    assert shared.accepted() == (SECRET.encode(),)  # the two reads disagree
    clock.now = 2.0
    assert shared.accepted() == (OTHER.encode(), SECRET.encode())


# -- replicas over loopback -----------------------------------------------------------
def pair(tmp_path: Path, secret_a: str | None, secret_b: str | None, **settings):
    """Replicas ra and rb dialling each other, with these secrets (None: no secret)."""
    names = Names()
    replicas = []
    for name, peer, secret in (("ra", "b:1", secret_a), ("rb", "a:1", secret_b)):
        extra = dict(settings)
        if secret is not None:
            extra["secret_file"] = str(secret_file(tmp_path, secret, name=f"{name}-secret"))
        replicas.append(Replica(name, [peer], names, **extra))
    return names, replicas[0], replicas[1]


async def test_two_replicas_with_the_same_secret_share_decisions_both_ways(tmp_path):
    names, a, b = pair(tmp_path, SECRET, f"{SECRET}\n")  # whitespace does not count
    async with running(a, b):
        names.table = {"a": [("127.0.0.1", a.port)], "b": [("127.0.0.1", b.port)]}
        start_links(a, b)
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="a->b")
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, what="b->a")
        routed = a.route("alpha")
        await until(lambda: b.received("applied") == 1, what="b received")
        assert max(b.index.match(a.hashes("alpha")).values()) == len(a.hashes("alpha"))
        b.route("beta")
        await until(lambda: a.received("applied") == 1, what="a received")
        b.router.complete(routed.token, 200, routed.endpoint.address)  # seen by b's observer
        await until(lambda: routed.endpoint.in_flight == 0, what="released at a")
        assert rejected(a) == rejected(b) == 0


@pytest.mark.parametrize(
    ("secret_a", "secret_b"),
    [(SECRET, OTHER), (SECRET, None), (None, SECRET)],
    ids=["different", "only-a", "only-b"],
)
async def test_replicas_without_a_common_secret_share_nothing_and_say_so(
    tmp_path, secret_a, secret_b
):
    names, a, b = pair(tmp_path, secret_a, secret_b, backoff_max_s=0.2)
    with structlog.testing.capture_logs() as logs:
        async with running(a, b):
            names.table = {"a": [("127.0.0.1", a.port)], "b": [("127.0.0.1", b.port)]}
            start_links(a, b)
            for r in (a, b):  # both directions refused, counted by each listener
                await until(lambda r=r: states(r) == ["unauthenticated"], what="link refused")
                await until(lambda r=r: rejected(r) >= 1, what="listener counted")
            a.route("alpha")
            b.route("beta")
            await never_connected(a, b, seconds=0.5)  # a couple of reconnects
            for r in (a, b):
                assert r.sample("epp_replica_decisions_sent_total") == 0
                assert received(r) == 0
                assert all(not e.peer for e in r.store.all())
            assert a.index.match(b.hashes("beta")) == {}
            assert b.index.match(a.hashes("alpha")) == {}
    refused = [e for e in logs if e["event"] == "replica_peer_unauthenticated"]
    closed_ = [e for e in logs if e["event"] == "replica_connection_rejected"]
    # Each side says it once (per LOG_EVERY_S): its link and its listener.
    assert len(refused) == 2 and len(closed_) == 2
    assert {e["reason"] for e in closed_} == {"unauthenticated"}
    texts = " ".join(str(e) for e in logs)
    assert SECRET not in texts and OTHER not in texts
    assert "replicas.secret_file" in refused[0]["detail"]


async def test_an_unauthenticated_link_waits_backoff_max_s_between_attempts(tmp_path):
    names, a, b = pair(tmp_path, SECRET, None, backoff_max_s=1.0)
    async with running(a, b):
        names.table = {"a": [("127.0.0.1", a.port)], "b": [("127.0.0.1", b.port)]}
        start_links(a)  # a dials b only
        await until(lambda: rejected(b) == 1, what="the first attempt")
        await asyncio.sleep(0.9)  # doubling from 0.05 s would try 4 more times by now
        assert rejected(b) == 1
        await until(lambda: rejected(b) == 2, timeout=2.0, what="the next attempt")


def forged_frames(token: str) -> list[list[bytes]]:
    """What a peer without `secret` can send: hellos, no proof or a wrong one, then
    frames that would change the index, the load or the in-flight counts."""
    decision = encode(Decision("rb", "a", [1, 2, 3], 48, 0, 48, 0.0))
    completion = encode(Completion(token, 200, "127.0.0.1:8001"))
    bare = encode(Hello("rb", PROTOCOL_VERSION, 16))
    with_nonce = encode(Hello("rb", PROTOCOL_VERSION, 16, nonce=NONCE_D))
    wrong = encode(Auth(b"\x00" * PROOF_BYTES))
    return [
        [bare, decision, completion],
        [with_nonce, decision, completion],
        [with_nonce, wrong, decision, completion],
    ]


@pytest.mark.parametrize("case", [0, 1, 2], ids=["no-nonce", "no-proof", "wrong-proof"])
async def test_a_forged_peer_without_the_secret_changes_nothing(tmp_path, case):
    names, a, b = pair(tmp_path, SECRET, SECRET)
    async with running(a, b):
        names.table = {"a": [("127.0.0.1", a.port)]}
        start_links(b)  # the genuine rb is connected to a
        await until(lambda: b.sample("epp_replica_peers_connected") == 1, what="rb->a")
        routed = a.route("alpha")  # in flight at a until its completion
        genuine = a.sync.server._by_replica["rb"]
        reader, writer = await asyncio.open_connection("127.0.0.1", a.port)
        for frame in forged_frames(routed.token)[case]:
            writer.write(frame)
        await writer.drain()
        assert await closed(reader)
        writer.close()
        assert rejected(a) == 1
        assert received(a) == 0 and a.sample("epp_replica_completions_received_total") == 0
        assert routed.endpoint.in_flight == 1
        assert a.index.match([1, 2, 3]) == {}
        assert all(not e.peer for e in a.store.all())
        # The forger claimed rb's id: rb's genuine connection was not replaced.
        assert a.sync.server._by_replica["rb"] is genuine and not genuine.is_closing()
        b.route("beta")
        await until(lambda: a.received("applied") == 1, what="rb still delivers")


async def test_a_peer_that_never_sends_its_proof_is_dropped_after_the_handshake_timeout(
    tmp_path,
):
    _, a, _ = pair(tmp_path, SECRET, SECRET)
    a.sync.server._handshake_timeout = 0.2
    async with running(a):
        reader, writer = await asyncio.open_connection("127.0.0.1", a.port)
        writer.write(encode(Hello("rb", PROTOCOL_VERSION, 16, nonce=NONCE_D)))
        await writer.drain()
        assert isinstance(decode(await read_frame(reader, 4096)), Hello)  # its answer
        started = asyncio.get_running_loop().time()
        assert await closed(reader)  # then nothing more from us: closed
        assert asyncio.get_running_loop().time() - started < 2.0
        writer.close()
        assert a.sync.server.connections == 0


class FakeListener:
    """A listener that answers each connection's Hello with `answer(hello)` (frames) and
    keeps what it is sent after that."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.after: list[object] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            hello = decode(await read_frame(reader, 4096))
            writer.write(self.answer(hello))
            await writer.drain()
            while True:
                self.after.append(decode(await read_frame(reader, 1 << 24)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()


@pytest.mark.parametrize(
    "answer",
    [
        lambda hello: encode(Hello("rb", PROTOCOL_VERSION, 16)),  # no secret, or older
        lambda hello: encode(
            Hello("rb", PROTOCOL_VERSION, 16, nonce=NONCE_L, proofs=(b"\x01" * PROOF_BYTES,))
        ),
        # Claiming to be the dialler itself must not park the link for good as "self".
        lambda hello: encode(
            Hello(hello.replica, PROTOCOL_VERSION, 16, nonce=NONCE_L, proofs=(b"\x01" * 32,))
        ),
    ],
    ids=["no-nonce", "wrong-proof", "claims-self"],
)
async def test_a_link_never_sends_a_decision_to_a_listener_without_the_secret(answer, tmp_path):
    names = Names()
    a = Replica(
        "ra", ["b:1"], names, backoff_max_s=0.1, secret_file=str(secret_file(tmp_path, SECRET))
    )
    fake = FakeListener(answer)
    async with fake as port, running(a):
        names.table = {"b": [("127.0.0.1", port)]}
        a.route("alpha")  # in the history a new peer would get
        start_links(a)
        await until(lambda: states(a) == ["unauthenticated"], what="refused")
        a.route("beta")
        await never_connected(a, seconds=0.3)
        # It tries again, and is refused again (waited for, not timed: a loaded machine
        # may not fit a backoff and a handshake in the window above).
        await until(lambda: fake.connections >= 2, what="a second attempt")
        await never_connected(a, seconds=0.05)
        assert not [m for m in fake.after if not isinstance(m, Auth)]
        assert a.sample("epp_replica_decisions_sent_total") == 0


class Recorder:
    """A TCP proxy that records each direction of the connections through it."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.to_listener = bytearray()
        self.to_dialler = bytearray()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, sink: bytearray):
            try:
                while data := await src.read(65536):
                    sink.extend(data)
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(
            pipe(reader, up_writer, self.to_listener), pipe(up_reader, writer, self.to_dialler)
        )


def first_frame(data: bytes) -> bytes:
    (length,) = HEADER.unpack(data[: HEADER.size])
    return data[: HEADER.size + length]


async def record_a_session(tmp_path: Path) -> tuple[Recorder, Replica]:
    """ra dials rb through a recording proxy and sends one decision; ra then stops.
    Returns the recording and rb (still running: the caller stops it)."""
    names, a, b = pair(tmp_path, SECRET, SECRET)
    await b.sync.server.start()
    recorder = Recorder(b.port)
    proxy = await asyncio.start_server(recorder.serve, "127.0.0.1", 0)
    names.table = {"b": [("127.0.0.1", proxy.sockets[0].getsockname()[1])]}
    async with running(a):
        start_links(a)
        await until(lambda: a.sample("epp_replica_peers_connected") == 1, what="a->b")
        a.route("alpha")
        await until(lambda: b.received("applied") == 1, what="b received")
    proxy.close()
    assert isinstance(decode(first_frame(recorder.to_listener)[4:]), Hello)
    return recorder, b


async def test_a_recorded_handshake_replayed_to_the_listener_fails(tmp_path):
    recorder, b = await record_a_session(tmp_path)
    try:
        await until(lambda: b.sync.server.connections == 0, what="ra's connection closed")
        # The dialler's bytes, Hello, proof and decision, sent again as they were.
        reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
        writer.write(bytes(recorder.to_listener))
        await writer.drain()
        assert await closed(reader)
        writer.close()
        assert rejected(b) == 1
        assert received(b) == 1  # the recorded decision was not applied again
    finally:
        await b.sync.stop()


async def test_a_recorded_listener_answer_replayed_to_the_dialler_fails(tmp_path):
    recorder, b = await record_a_session(tmp_path)
    await b.sync.stop()
    recorded = first_frame(bytes(recorder.to_dialler))  # rb's Hello with its proofs
    assert decode(recorded[4:]).proofs
    fake = FakeListener(lambda hello: recorded)
    names = Names()
    # ra again (same id, same secret): it must not take the old answer for rb.
    a = Replica("ra", ["b:1"], names, secret_file=str(tmp_path / "ra-secret"))
    async with fake as port, running(a):
        names.table = {"b": [("127.0.0.1", port)]}
        start_links(a)
        await until(lambda: states(a) == ["unauthenticated"], what="refused")
        a.route("beta")
        await never_connected(a, seconds=0.2)
        assert not [m for m in fake.after if not isinstance(m, Auth)]
        assert a.sample("epp_replica_decisions_sent_total") == 0


async def test_a_rotated_secret_keeps_replicas_connecting_while_the_previous_is_accepted(
    tmp_path,
):
    """rb's file changes first: ra, not yet reloaded, still connects (rb accepts the
    previous secret); once that window passes ra is refused until its own file changes."""
    names, a, b = pair(tmp_path, SECRET, SECRET, backoff_max_s=0.1)
    clock = Clock()
    for r in (a, b):
        path = r.sync.auth.secret.path
        r.sync.auth.secret = SharedSecret(path, check_s=1.0, previous_s=60.0, clock=clock)

    def cut() -> None:  # a new connection, and with it a new handshake
        for writer in list(b.sync.server._open):
            writer.close()

    async with running(a, b):
        names.table = {"b": [("127.0.0.1", b.port)]}
        start_links(a)
        await until(lambda: states(a) == ["connected"], what="connected")
        (tmp_path / "rb-secret").write_text(OTHER)
        clock.now = 1.0  # rb reads its file again at its next handshake
        cut()
        await until(lambda: b.sync.auth.secret.reloads == 1, what="rb reloaded")
        await until(lambda: states(a) == ["connected"], what="reconnected on the previous")
        a.route("alpha")
        await until(lambda: b.received("applied") == 1, what="delivered")
        clock.now = 61.0  # rb no longer accepts the previous secret
        cut()
        await until(lambda: states(a) == ["unauthenticated"], what="refused")
        assert rejected(b) >= 1
        (tmp_path / "ra-secret").write_text(OTHER + "\n")
        clock.now = 62.0
        await until(lambda: states(a) == ["connected"], what="ra rotated too")
