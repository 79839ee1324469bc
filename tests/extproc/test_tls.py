"""TLS on the gRPC port: by default with a certificate the EPP generates at start, or with
certificates the tests make (tests/certs.py).

The real server (build_grpc_server) on loopback, real gRPC clients: TLS answers the
ext_proc and health services and refuses plaintext; mutual TLS refuses a client without a
certificate (or with one from another CA); rotated files (rewritten in place, or a
Kubernetes Secret's `..data` symlink swap) reach new connections within reload_check_s
while open connections go on; a broken replacement is logged and the last good
certificate kept. Every client uses its own subchannel pool, so each channel is a new
connection and a new handshake.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
import structlog
from certs import CertAuthority, Leaf, encrypt_key, needs_openssl
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc.fakes import ADDRESSES, DUPLEX, FakeRouter, body_msg, body_of, destination, headers_msg
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import served_certificate
from pydantic import ValidationError

from epp.app import config_from_args, parse_serve_args
from epp.config import ServerConfig, TlsConfig
from epp.extproc.server import ExternalProcessor, HealthState, build_grpc_server
from epp.observability.metrics import EppMetrics
from epp.tls import (
    GrpcServerTls,
    SelfSignedTls,
    TlsError,
    WatchedFiles,
    generate_self_signed,
    grpc_transport,
)

pytestmark = needs_openssl

RELOAD_S = 0.1
# A rotation must reach new connections within reload_check_s; this much more allows for
# a loaded 2-core machine (handshakes, polling).
SLACK_S = 1.0
OK = "SERVING"


@pytest.fixture(scope="module")
def ca_one(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    return CertAuthority(tmp_path_factory.mktemp("ca-one"), "ca-one")


@pytest.fixture(scope="module")
def ca_two(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    return CertAuthority(tmp_path_factory.mktemp("ca-two"), "ca-two")


@pytest.fixture(scope="module")
def leaves(ca_one: CertAuthority, ca_two: CertAuthority) -> dict[str, Leaf]:
    return {
        "server1": ca_one.issue("epp-server"),
        "server1b": ca_one.issue("epp-server-b"),
        "server2": ca_two.issue("epp-server-two"),
        "client1": ca_one.issue("envoy"),
        "client2": ca_two.issue("envoy-two"),
    }


def install(directory: Path, leaf: Leaf, client_ca: CertAuthority | None = None) -> TlsConfig:
    """Writes the files the EPP reads (in place, like `cp`); its TLS config."""
    (directory / "tls.crt").write_bytes(leaf.cert_pem)
    (directory / "tls.key").write_bytes(leaf.key_pem)
    if client_ca is not None:
        (directory / "ca.crt").write_bytes(client_ca.pem)
    return TlsConfig(
        cert_file=directory / "tls.crt",
        key_file=directory / "tls.key",
        client_ca_file=directory / "ca.crt" if client_ca is not None else None,
        reload_check_s=RELOAD_S,
    )


async def serve(
    tls: TlsConfig | None, *, secure_serving: bool = True
) -> tuple[grpc.aio.Server, int]:
    """The real server; `tls` None and secure_serving: the self-signed default."""
    health = HealthState()
    await health.set(live=True, ready=True)
    processor = ExternalProcessor(FakeRouter(), ServerConfig(), EppMetrics())
    config = ServerConfig(
        grpc_host="127.0.0.1", grpc_port=0, tls=tls, secure_serving=secure_serving
    )
    server, port = build_grpc_server(processor, health, config)
    await server.start()
    return server, port


def channel(port: int, ca: CertAuthority | None, client: Leaf | None = None) -> grpc.aio.Channel:
    """A client with its own connection; plaintext when `ca` is None."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    target = f"127.0.0.1:{port}"
    if ca is None:
        return grpc.aio.insecure_channel(target, options=options)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.pem,
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None,
    )
    return grpc.aio.secure_channel(target, credentials, options=options)


async def check(ch: grpc.aio.Channel) -> str:
    """The readiness status through `ch`, or the gRPC error code that refused it."""
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=3)
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def connect(port: int, ca: CertAuthority | None, client: Leaf | None = None) -> str:
    """One new connection, one health check."""
    async with channel(port, ca, client) as ch:
        return await check(ch)


async def until_ok(connect_once: Callable[[], Awaitable[str]], seconds: float) -> float:
    """Connects every 50 ms until the health check passes; how long that took."""
    started = time.monotonic()
    while await connect_once() != OK:
        if time.monotonic() - started > seconds:
            raise AssertionError(f"no successful handshake within {seconds} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def route_once(ch: grpc.aio.Channel) -> str:
    """One ext_proc routing stream: the destination the EPP answers."""

    async def requests() -> AsyncIterator[pb.ProcessingRequest]:
        yield headers_msg(mode=DUPLEX)
        yield body_msg(body_of(), True)

    call = pb_grpc.ExternalProcessorStub(ch).Process(requests(), timeout=5)
    replies = [reply async for reply in call]
    return destination(replies[0])


# -- TLS and mutual TLS --------------------------------------------------------------------


async def test_tls_serves_ext_proc_and_health_and_refuses_plaintext(tmp_path, ca_one, leaves):
    with structlog.testing.capture_logs() as logs:
        server, port = await serve(install(tmp_path, leaves["server1"]))
    try:
        async with channel(port, ca_one) as ch:
            assert await check(ch) == OK
            assert await route_once(ch) == ADDRESSES[0]
        assert await connect(port, None) == "UNAVAILABLE"  # plaintext
        # A client trusting another CA does not accept the EPP's certificate.
        assert await connect(port, CertAuthority(tmp_path / "other", "other")) == "UNAVAILABLE"
    finally:
        await server.stop(0)
    [started] = [e for e in logs if e["event"] == "grpc_transport"]
    assert started["mode"] == "tls"
    assert started["subject"] == "CN=epp-server" and started["issuer"] == "CN=ca-one"
    assert started["names"] == ["IP Address:127.0.0.1", "DNS:localhost"]
    assert 1.9 < started["expires_in_days"] <= 2.0 and started["not_after"].endswith("+00:00")
    assert "PRIVATE KEY" not in repr(logs)


async def test_plaintext_only_when_asked_and_logged_as_such():
    with structlog.testing.capture_logs() as logs:
        server, port = await serve(None, secure_serving=False)
    try:
        assert await connect(port, None) == OK
    finally:
        await server.stop(0)
    assert [e["mode"] for e in logs if e["event"] == "grpc_transport"] == ["plaintext"]


# -- the default: a self-signed certificate ------------------------------------------------


async def test_the_default_serves_tls_with_a_self_signed_certificate():
    """ServerConfig() as `epp serve` builds it without TLS settings: TLS with a certificate
    generated at start, ALPN h2 (what Envoy's gRPC client negotiates), the ext_proc and
    health services to a client that trusts that certificate, nothing to plaintext."""
    assert ServerConfig().secure_serving is True and ServerConfig().tls is None
    with structlog.testing.capture_logs() as logs:
        server, port = await serve(None)
    try:
        pem, alpn = await asyncio.to_thread(served_certificate, "127.0.0.1", port)
        assert alpn == "h2"
        credentials = grpc.ssl_channel_credentials(root_certificates=pem)
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options) as ch:
            assert await check(ch) == OK
            assert await route_once(ch) == ADDRESSES[0]
        assert await connect(port, None) == "UNAVAILABLE"  # plaintext
    finally:
        await server.stop(0)
    [started] = [e for e in logs if e["event"] == "grpc_transport"]
    assert started["mode"] == "tls" and started["certificate"] == "self-signed"
    # The logged fingerprint is the served certificate's (what `openssl x509 -fingerprint
    # -sha256` prints), so an operator can compare what a client sees.
    served = x509.load_pem_x509_certificate(pem)
    assert started["sha256_fingerprint"] == served.fingerprint(hashes.SHA256()).hex(":").upper()
    assert {"DNS:localhost", "IP Address:127.0.0.1"} <= set(started["names"])
    assert "PRIVATE KEY" not in repr(logs)


async def test_each_start_generates_its_own_key():
    first, second = SelfSignedTls(), SelfSignedTls()
    assert first.certificate.key_pem != second.certificate.key_pem
    assert first.certificate.sha256 != second.certificate.sha256


def test_the_self_signed_certificate_names_this_pod_and_serves_only_servers():
    when = datetime(2026, 12, 2, tzinfo=UTC)
    generated = generate_self_signed(env={"POD_IP": "10.1.2.3"}, now=when)
    cert = x509.load_pem_x509_certificate(generated.cert_pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost", socket.gethostname()]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == [
        "127.0.0.1",
        "::1",
        "10.1.2.3",
    ]
    assert cert.issuer == cert.subject  # self-signed
    key = serialization.load_pem_private_key(generated.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert cert.not_valid_after_utc - when == timedelta(days=365)
    assert cert.not_valid_before_utc < when
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # A POD_IP that is not an address is left out (logged), never a failed start.
    odd = x509.load_pem_x509_certificate(generate_self_signed(env={"POD_IP": "x"}).cert_pem)
    san = odd.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]


def test_plaintext_with_certificate_files_is_a_configuration_error(tmp_path, leaves):
    tls = install(tmp_path, leaves["server1"])
    with pytest.raises(ValidationError) as error:
        ServerConfig(secure_serving=False, tls=tls)
    assert "server.secure_serving" in str(error.value) and "server.tls" in str(error.value)
    assert grpc_transport(ServerConfig(secure_serving=False)) is None
    assert isinstance(grpc_transport(ServerConfig(tls=tls)), GrpcServerTls)
    assert isinstance(grpc_transport(ServerConfig()), SelfSignedTls)


async def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(
    tmp_path, ca_one, leaves
):
    with structlog.testing.capture_logs() as logs:
        server, port = await serve(install(tmp_path, leaves["server1"], client_ca=ca_one))
    try:
        assert await connect(port, ca_one) == "UNAVAILABLE"  # no client certificate
        assert await connect(port, ca_one, leaves["client2"]) == "UNAVAILABLE"  # other CA
        assert await connect(port, None) == "UNAVAILABLE"
        async with channel(port, ca_one, leaves["client1"]) as ch:
            assert await check(ch) == OK
            assert await route_once(ch) == ADDRESSES[0]
    finally:
        await server.stop(0)
    [started] = [e for e in logs if e["event"] == "grpc_transport"]
    assert started["mode"] == "mtls" and started["client_ca_certs"] == 1
    assert started["client_ca_file"] == str(tmp_path / "ca.crt")


# -- rotation --------------------------------------------------------------------------------


async def test_rewritten_files_reach_new_connections_and_open_ones_go_on(
    tmp_path, ca_one, ca_two, leaves
):
    server, port = await serve(install(tmp_path, leaves["server1"]))
    try:
        async with channel(port, ca_one) as before:
            assert await check(before) == OK
            with structlog.testing.capture_logs() as logs:
                install(tmp_path, leaves["server2"])  # a new certificate from a new CA
                took = await until_ok(lambda: connect(port, ca_two), RELOAD_S + SLACK_S)
            assert took <= RELOAD_S + SLACK_S
            assert await connect(port, ca_one) == "UNAVAILABLE"  # new handshakes: new cert
            assert await check(before) == OK  # the open connection keeps its session
            assert await route_once(before) == ADDRESSES[0]
    finally:
        await server.stop(0)
    reloaded = [e for e in logs if e["event"] == "tls_reloaded"]
    assert reloaded and reloaded[-1]["subject"] == "CN=epp-server-two"


async def test_a_kubernetes_secret_symlink_swap_is_picked_up(tmp_path, ca_one, ca_two, leaves):
    """A Secret volume: tls.crt -> ..data/tls.crt, ..data -> ..<timestamp>/; the kubelet
    writes a new timestamped directory and renames a new ..data link over the old one."""

    def secret_version(name: str, leaf: Leaf) -> None:
        version = tmp_path / name
        version.mkdir()
        (version / "tls.crt").write_bytes(leaf.cert_pem)
        (version / "tls.key").write_bytes(leaf.key_pem)
        (tmp_path / "..data_tmp").symlink_to(name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")  # atomic

    secret_version("..2026_01_01", leaves["server1"])
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).symlink_to(f"..data/{name}")
    tls = TlsConfig(
        cert_file=tmp_path / "tls.crt", key_file=tmp_path / "tls.key", reload_check_s=RELOAD_S
    )
    server, port = await serve(tls)
    try:
        assert await connect(port, ca_one) == OK
        secret_version("..2026_02_01", leaves["server2"])
        await until_ok(lambda: connect(port, ca_two), RELOAD_S + SLACK_S)
        assert await connect(port, ca_one) == "UNAVAILABLE"
    finally:
        await server.stop(0)


async def test_a_rotated_client_ca_changes_which_clients_are_accepted(
    tmp_path, ca_one, ca_two, leaves
):
    server, port = await serve(install(tmp_path, leaves["server1"], client_ca=ca_one))
    try:
        assert await connect(port, ca_one, leaves["client1"]) == OK
        assert await connect(port, ca_one, leaves["client2"]) == "UNAVAILABLE"
        (tmp_path / "ca.crt").write_bytes(ca_two.pem)
        await until_ok(lambda: connect(port, ca_one, leaves["client2"]), RELOAD_S + SLACK_S)
        assert await connect(port, ca_one, leaves["client1"]) == "UNAVAILABLE"
    finally:
        await server.stop(0)


def _garbage_cert(d: Path, leaves: dict[str, Leaf]) -> None:
    (d / "tls.crt").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n")


def _other_key(d: Path, leaves: dict[str, Leaf]) -> None:
    (d / "tls.key").write_bytes(leaves["server1b"].key_pem)  # another certificate's key


def _missing_key(d: Path, leaves: dict[str, Leaf]) -> None:
    (d / "tls.key").unlink()


def _empty_cert(d: Path, leaves: dict[str, Leaf]) -> None:
    (d / "tls.crt").write_bytes(b"")


def _garbage_client_ca(d: Path, leaves: dict[str, Leaf]) -> None:
    (d / "ca.crt").write_text("this is not a CA bundle\n")


def _encrypted_key(d: Path, leaves: dict[str, Leaf]) -> None:
    os.replace(encrypt_key(d / "tls.key", d / "encrypted.key"), d / "tls.key")


@pytest.mark.parametrize(
    ("breakage", "error"),
    [
        (_garbage_cert, "PEM"),
        (_other_key, "KEY_VALUES_MISMATCH"),
        (_missing_key, "No such file"),
        (_empty_cert, "empty"),
        (_garbage_client_ca, "certificate"),
        (_encrypted_key, "encrypted"),
    ],
    ids=lambda v: getattr(v, "__name__", v)[:20].strip("_"),
)
async def test_a_broken_replacement_keeps_the_last_good_certificate(
    tmp_path, ca_one, ca_two, leaves, breakage, error
):
    server, port = await serve(install(tmp_path, leaves["server1"], client_ca=ca_one))
    client = leaves["client1"]
    try:
        with structlog.testing.capture_logs() as logs:
            breakage(tmp_path, leaves)
            # Several checks of the broken files: reported once, the old certificate served.
            for _ in range(2):
                await asyncio.sleep(RELOAD_S * 1.5)
                assert await connect(port, ca_one, client) == OK
        failed = [e for e in logs if e["event"] == "tls_reload_failed"]
        assert len(failed) == 1, logs
        assert error in failed[0]["error"]
        assert not [e for e in logs if e["event"] == "tls_reloaded"]
        # A good replacement afterwards is taken.
        install(tmp_path, leaves["server2"], client_ca=ca_one)
        await until_ok(lambda: connect(port, ca_two, client), RELOAD_S + SLACK_S)
    finally:
        await server.stop(0)


# -- start-up and the check interval ---------------------------------------------------------


def test_unusable_files_at_start_fail_with_the_reason(tmp_path, leaves):
    config = install(tmp_path, leaves["server1"])
    (tmp_path / "tls.key").write_bytes(leaves["server2"].key_pem)
    with pytest.raises(TlsError, match="KEY_VALUES_MISMATCH"):
        GrpcServerTls(config)
    (tmp_path / "tls.key").unlink()
    with pytest.raises(TlsError, match=r"tls\.key: No such file"):
        GrpcServerTls(config)
    install(tmp_path, leaves["server1"])
    os.replace(encrypt_key(tmp_path / "tls.key", tmp_path / "enc.key"), tmp_path / "tls.key")
    with pytest.raises(TlsError, match="encrypted"):  # refused, never prompted for
        GrpcServerTls(config)


def test_files_are_checked_at_most_every_reload_check_s(tmp_path, leaves):
    now = [100.0]
    tls = GrpcServerTls(install(tmp_path, leaves["server1"]), clock=lambda: now[0])
    assert tls.fetch() is None  # gRPC keeps what it was started with
    install(tmp_path, leaves["server2"])
    now[0] += RELOAD_S * 0.9
    assert tls.fetch() is None  # not due yet: the files are not even read
    assert tls.files.reloads == 0
    now[0] += RELOAD_S * 0.2
    assert tls.fetch() is not None  # due: re-read, changed, handed to gRPC once
    assert tls.fetch() is None
    now[0] += RELOAD_S
    assert tls.fetch() is None and tls.files.reloads == 1


def test_the_content_decides_not_the_mtime(tmp_path, leaves):
    now = [0.0]
    config = install(tmp_path, leaves["server1"])
    files = WatchedFiles("t", [config.cert_file], lambda c: c[0], check_s=1.0, clock=lambda: now[0])
    os.utime(config.cert_file, (1, 1))  # touched: same content
    now[0] += 1.0
    assert files.current() == (leaves["server1"].cert_pem, 0)
    # Rewritten in place with the mtime and size unchanged: still a change.
    stat = config.cert_file.stat()
    new = leaves["server1"].cert_pem.replace(b"MII", b"NII", 1)
    assert len(new) == stat.st_size
    config.cert_file.write_bytes(new)
    os.utime(config.cert_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    now[0] += 1.0
    assert files.current() == (new, 1)


def test_the_plaintext_flag_is_secure_serving_false(tmp_path, leaves):
    """`epp serve --plaintext` (ours) and upstream's `--secure-serving=false`: plaintext;
    with certificate files in the config it is an error naming both keys."""
    for flags in (["--plaintext"], ["--secure-serving=false"]):
        args, upstream = parse_serve_args(flags)
        assert config_from_args(args, upstream).server.secure_serving is False
    args, upstream = parse_serve_args([])
    assert config_from_args(args, upstream).server.secure_serving is True
    tls = install(tmp_path, leaves["server1"])
    (tmp_path / "epp.yaml").write_text(
        f"server: {{tls: {{cert_file: {tls.cert_file}, key_file: {tls.key_file}}}}}\n"
    )
    args, upstream = parse_serve_args(["--config", str(tmp_path / "epp.yaml"), "--plaintext"])
    with pytest.raises(ValidationError, match=r"server\.secure_serving.*server\.tls"):
        config_from_args(args, upstream)
