"""TLS on the gRPC port and for the metrics scraper.

Three users: the gRPC port with certificate files (`GrpcServerTls`: server certificate,
optional client CA for mutual TLS), the gRPC port without files (`SelfSignedTls`: a
certificate generated in memory at start, as the upstream EPP's SecureServing does), and
the metrics scraper (`ScrapeTls`: the client context for https metrics URLs). The file
users read their files through `WatchedFiles`:

- the files are re-read at most every `check_s`, when the value is asked for (gRPC asks
  before every new TLS handshake; the scraper before every https scrape);
- what decides "changed" is a SHA-256 over the files' content, not their mtime: a
  Kubernetes Secret volume swaps its `..data` symlink (the paths never change, their
  targets do), and a file rewritten in place within one coarse mtime tick keeps its mtime.
  The files are a few KB (at most MAX_FILE_BYTES each), so reading them every few
  seconds costs microseconds;
- a changed set is validated before it is used (PEM parses, the key matches the
  certificate, the CA bundle holds a certificate), then read again: it is taken only if
  nothing changed meanwhile, so a half-written rotation is never served. A set that fails
  is logged once (per distinct content or error) and the last good one stays in use;
- at start there is no last good one: a bad file raises TlsError and the process does not
  start.

Connections already open keep the session they were established with; only new handshakes
see a new certificate.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from epp.config import DataLayerConfig, ServerConfig, TlsConfig

log = structlog.get_logger("epp.tls")

T = TypeVar("T")

# A certificate, key or CA bundle file larger than this is not one.
MAX_FILE_BYTES = 1024 * 1024
# How often the scraper's CA and client certificate files are checked for changes.
SCRAPE_TLS_CHECK_S = 5.0


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used."""


def _refuse_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key.
    raise TlsError("the private key is encrypted; the EPP needs an unencrypted PEM key")


@dataclass(frozen=True)
class CertInfo:
    """What the logs say about a certificate (never anything about its key)."""

    subject: str
    issuer: str
    not_before: float  # seconds since the epoch
    not_after: float
    names: tuple[str, ...]  # subjectAltName entries

    def fields(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "subject": self.subject,
            "issuer": self.issuer,
            "names": list(self.names),
            "not_after": datetime.fromtimestamp(self.not_after, UTC).isoformat(),
            "expires_in_days": round((self.not_after - now) / 86400, 1),
        }


_DN_KEYS = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
    "domainComponent": "DC",
}


def _dn(name: Any) -> str:
    return ",".join(f"{_DN_KEYS.get(key, key)}={value}" for rdn in name for key, value in rdn)


def cert_info(path: Path) -> CertInfo | None:
    """The first certificate in a PEM file (the leaf of a chain), or None if unreadable.

    Uses the ssl module's own decoder (the one behind SSLSocket.getpeercert), so that the
    EPP needs no X.509 library for a log line."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        decoded = decode(str(path))
        return CertInfo(
            subject=_dn(decoded.get("subject", ())),
            issuer=_dn(decoded.get("issuer", ())),
            not_before=ssl.cert_time_to_seconds(decoded["notBefore"]),
            not_after=ssl.cert_time_to_seconds(decoded["notAfter"]),
            names=tuple(f"{kind}:{value}" for kind, value in decoded.get("subjectAltName", ())),
        )
    except (ssl.SSLError, OSError, KeyError, ValueError):
        return None


def _warn_if_not_valid_now(what: str, path: Path, info: CertInfo | None) -> None:
    if info is None:
        return
    now = time.time()
    if now >= info.not_after:
        log.warning("tls_certificate_expired", what=what, file=str(path), **info.fields(now))
    elif now < info.not_before:
        log.warning("tls_certificate_not_yet_valid", what=what, file=str(path), **info.fields(now))


def _read(paths: Sequence[Path]) -> tuple[list[bytes], str]:
    """The files' contents and one digest over all of them."""
    digest = hashlib.sha256()
    contents = []
    for path in paths:
        try:
            with path.open("rb") as file:
                data = file.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise TlsError(f"{path}: {exc.strerror or exc}") from exc
        if len(data) > MAX_FILE_BYTES:
            raise TlsError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        if not data.strip():
            raise TlsError(f"{path}: empty")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
        contents.append(data)
    return contents, digest.hexdigest()


class WatchedFiles(Generic[T]):
    """A value built from some files, rebuilt when their content changes.

    `build(contents)` gets the files' bytes in `paths` order (it may also open the paths:
    the content is read again afterwards and the build is kept only if it did not change);
    it raises on anything unusable. `describe(value)` gives the log fields of a value.
    Thread-safe: gRPC asks from its own threads.
    """

    def __init__(
        self,
        what: str,
        paths: Sequence[Path],
        build: Callable[[list[bytes]], T],
        *,
        check_s: float,
        clock: Callable[[], float] = time.monotonic,
        describe: Callable[[T], dict[str, Any]] | None = None,
    ) -> None:
        self.what = what
        self.paths = list(paths)
        self._build = build
        self._check_s = check_s
        self._clock = clock
        self._describe = describe or (lambda _: {})
        self._lock = threading.Lock()
        contents, digest = _read(self.paths)
        try:
            value = build(contents)
        except Exception as exc:
            raise TlsError(f"{what}: {_reason(exc)}") from exc
        # (value, generation), replaced as one object: readers need no lock.
        self._state: tuple[T, int] = (value, 0)
        self._digest = digest
        self._failed: str | None = None  # the digest or error last reported as failing
        self._next_check = clock() + check_s
        self.reloads = 0  # new values taken
        self.failures = 0  # distinct failures reported (the same broken files count once)

    @property
    def value(self) -> T:
        return self._state[0]

    def current(self) -> tuple[T, int]:
        """The value and its generation (+1 per reload), checking the files when due."""
        if self._clock() >= self._next_check:
            self.check()
        return self._state

    def check(self) -> bool:
        """Re-read the files now; True when a new value replaced the old one."""
        if not self._lock.acquire(blocking=False):
            return False  # another thread is checking
        try:
            self._next_check = self._clock() + self._check_s
            return self._check()
        finally:
            self._lock.release()

    def _check(self) -> bool:
        try:
            contents, digest = _read(self.paths)
        except TlsError as exc:
            self._report_failure(str(exc), str(exc))
            return False
        if digest == self._digest:
            self._failed = None
            return False
        if digest == self._failed:
            return False  # the same broken content: reported already
        try:
            value = self._build(contents)
            _, again = _read(self.paths)
        except Exception as exc:
            self._report_failure(digest, _reason(exc))
            return False
        if again != digest:
            log.info("tls_files_changing", what=self.what, retry_in_s=self._check_s)
            return False
        self._state = (value, self._state[1] + 1)
        self._digest = digest
        self._failed = None
        self.reloads += 1
        log.info("tls_reloaded", what=self.what, **self._describe(value))
        return True

    def _report_failure(self, key: str, reason: str) -> None:
        if key == self._failed:
            return  # the same error or content again: reported already
        self._failed = key
        self.failures += 1
        log.error(
            "tls_reload_failed",
            what=self.what,
            error=reason,
            files=[str(p) for p in self.paths],
            kept="the previous certificates",
        )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return f"{exc.library or 'SSL'}: {exc.reason}"
    return str(exc) or type(exc).__name__


def _check_ca_bundle(what: str, data: bytes) -> int:
    """How many certificates a PEM CA bundle holds; raises if none parses."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise TlsError(f"{what}: not a PEM file") from exc
    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
    return text.count("-----BEGIN CERTIFICATE-----")


# -- the gRPC port ----------------------------------------------------------------------


@dataclass(frozen=True)
class _ServerMaterial:
    certificate_configuration: Any  # grpc.ServerCertificateConfiguration
    cert: CertInfo | None
    client_ca_certs: int


class GrpcServerTls:
    """Server credentials for the gRPC port that follow the certificate files.

    gRPC calls `fetch` before every new TLS handshake; it checks the files when
    `reload_check_s` has passed since the last check and hands gRPC the new certificate
    configuration once, after a change (None, "keep the current one", otherwise). With a
    client CA, clients must present a certificate it signed (mutual TLS)."""

    def __init__(self, config: TlsConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.mutual = config.client_ca_file is not None
        paths = [config.cert_file, config.key_file]
        if config.client_ca_file is not None:
            paths.append(config.client_ca_file)
        self.files: WatchedFiles[_ServerMaterial] = WatchedFiles(
            "grpc server certificate",
            paths,
            self._build,
            check_s=config.reload_check_s,
            clock=clock,
            describe=self._describe,
        )
        self._served = 0  # the generation gRPC has
        _warn_if_not_valid_now("grpc server certificate", config.cert_file, self.files.value.cert)

    @property
    def mode(self) -> str:
        return "mtls" if self.mutual else "tls"

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.files.value.certificate_configuration,
            self.fetch,
            require_client_authentication=self.mutual,
        )

    def fetch(self) -> Any:
        """gRPC's certificate configuration fetcher: a new configuration or None."""
        try:
            material, generation = self.files.current()
            if generation == self._served:
                return None
            self._served = generation
            _warn_if_not_valid_now("grpc server certificate", self.config.cert_file, material.cert)
            return material.certificate_configuration
        except Exception:  # never let a reload problem fail a handshake
            log.exception("tls_fetch_failed")
            return None

    def describe(self) -> dict[str, Any]:
        """The start-up log fields: mode, files, the certificate's subject and expiry."""
        fields: dict[str, Any] = {
            "mode": self.mode,
            "cert_file": str(self.config.cert_file),
            "reload_check_s": self.config.reload_check_s,
        }
        fields.update(self._describe(self.files.value))
        if self.config.client_ca_file is not None:
            fields["client_ca_file"] = str(self.config.client_ca_file)
        return fields

    def _build(self, contents: list[bytes]) -> _ServerMaterial:
        cert_pem, key_pem, *rest = contents
        client_ca = rest[0] if rest else None
        # The key must match the certificate: gRPC would take the pair and fail every
        # handshake. OpenSSL checks it from the paths (the bytes are re-read afterwards).
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            self.config.cert_file, self.config.key_file, password=_refuse_password
        )
        ca_certs = 0
        if client_ca is not None:
            ca_certs = _check_ca_bundle(str(self.config.client_ca_file), client_ca)
        configuration = grpc.ssl_server_certificate_configuration(
            [(key_pem, cert_pem)], root_certificates=client_ca
        )
        return _ServerMaterial(configuration, cert_info(self.config.cert_file), ca_certs)

    @staticmethod
    def _describe(material: _ServerMaterial) -> dict[str, Any]:
        fields = material.cert.fields() if material.cert is not None else {}
        if material.client_ca_certs:
            fields["client_ca_certs"] = material.client_ca_certs
        return fields


# -- the gRPC port without certificate files: a self-signed certificate ----------------

# A generated certificate's life. Gateways that dial a self-signed EPP do not verify it
# (that is what makes one usable), so its expiry matters only to a client pinned to it;
# the process would need a restart after a year to present a fresh one.
SELF_SIGNED_VALID_DAYS = 365
# notBefore this far in the past, for clients whose clock runs a little behind.
SELF_SIGNED_BACKDATE_S = 300
SELF_SIGNED_ORGANIZATION = "epp self-signed"


@dataclass(frozen=True)
class SelfSignedCertificate:
    """A certificate and its key, generated in memory; the key is never written anywhere."""

    cert_pem: bytes
    key_pem: bytes
    sha256: str  # the DER's SHA-256 as `openssl x509 -fingerprint -sha256` prints it
    subject: str
    names: tuple[str, ...]  # subjectAltName entries, "DNS:x" / "IP Address:x" as in CertInfo
    not_after: float


def self_signed_names(env: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """The DNS names and IP addresses the certificate carries: localhost, the loopback
    addresses, this host's name (a pod's name in Kubernetes) and $POD_IP when set."""
    env = os.environ if env is None else env
    dns = ["localhost"]
    hostname = socket.gethostname().strip()
    if hostname and hostname not in dns:
        dns.append(hostname)
    ips = ["127.0.0.1", "::1"]
    pod_ip = env.get("POD_IP", "").strip()
    if pod_ip:
        try:
            address = str(ipaddress.ip_address(pod_ip))
        except ValueError:
            log.warning(
                "pod_ip_not_an_address", pod_ip=pod_ip, detail="left out of the certificate"
            )
        else:
            if address not in ips:
                ips.append(address)
    return dns, ips


def generate_self_signed(
    *,
    env: Mapping[str, str] | None = None,
    valid_days: int = SELF_SIGNED_VALID_DAYS,
    now: datetime | None = None,
) -> SelfSignedCertificate:
    """An ECDSA P-256 certificate for serverAuth, signed by its own key (~1 ms)."""
    dns, ips = self_signed_names(env)
    now = now or datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, SELF_SIGNED_ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, dns[-1][:64]),
        ]
    )
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    not_after = now + timedelta(days=valid_days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(seconds=SELF_SIGNED_BACKDATE_S))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    digest = cert.fingerprint(hashes.SHA256()).hex().upper()
    return SelfSignedCertificate(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        sha256=":".join(digest[i : i + 2] for i in range(0, len(digest), 2)),
        subject=_dn(
            [[("organizationName", SELF_SIGNED_ORGANIZATION)], [("commonName", dns[-1][:64])]]
        ),
        names=tuple([f"DNS:{n}" for n in dns] + [f"IP Address:{a}" for a in ips]),
        not_after=not_after.timestamp(),
    )


class SelfSignedTls:
    """Server credentials from a certificate generated at start (`server.secure_serving`
    without `server.tls`). gRPC offers ALPN h2 itself, which Envoy's gRPC client needs."""

    mode = "tls"

    def __init__(self, certificate: SelfSignedCertificate | None = None) -> None:
        self.certificate = certificate or generate_self_signed()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.certificate.key_pem, self.certificate.cert_pem)])

    def describe(self) -> dict[str, Any]:
        cert = self.certificate
        return {
            "mode": self.mode,
            "certificate": "self-signed",
            "sha256_fingerprint": cert.sha256,
            "subject": cert.subject,
            "issuer": cert.subject,
            "names": list(cert.names),
            "not_after": datetime.fromtimestamp(cert.not_after, UTC).isoformat(),
            "detail": "generated at start (server.secure_serving without server.tls); "
            "gateways that dial it must not verify it, or trust this certificate",
        }


GrpcTransport = GrpcServerTls | SelfSignedTls


def grpc_transport(config: ServerConfig) -> GrpcTransport | None:
    """The gRPC port's TLS as the config asks: certificate files, a generated certificate
    (secure_serving, the default), or None for plaintext (secure_serving: false)."""
    if not config.secure_serving:
        return None
    if config.tls is not None:
        return GrpcServerTls(config.tls)
    return SelfSignedTls()


# -- scraping https metrics endpoints ---------------------------------------------------


class ScrapeTls:
    """The SSL context for https metrics URLs, from `datalayer.scrape_*`.

    The CA file replaces the system's trust store (unset: the system's); a client
    certificate is presented to pods that ask for one; `scrape_insecure_skip_verify`
    turns verification off (logged as a warning). The files are re-read when they change
    (checked at most every `check_s` when a context is asked for)."""

    def __init__(
        self,
        config: DataLayerConfig,
        *,
        check_s: float = SCRAPE_TLS_CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        paths = [
            p
            for p in (
                config.scrape_ca_file,
                config.scrape_client_cert_file,
                config.scrape_client_key_file,
            )
            if p is not None
        ]
        self.files: WatchedFiles[ssl.SSLContext] | None = None
        self._static: ssl.SSLContext | None = None
        if paths:
            self.files = WatchedFiles(
                "scrape tls", paths, self._build, check_s=check_s, clock=clock
            )
        else:
            self._static = self._build([])
        fields: dict[str, Any] = {}
        if config.scrape_ca_file is not None:
            fields["ca_file"] = str(config.scrape_ca_file)
        if config.scrape_client_cert_file is not None:
            info = cert_info(config.scrape_client_cert_file)
            fields["client_cert_file"] = str(config.scrape_client_cert_file)
            fields.update({f"client_{k}": v for k, v in (info.fields() if info else {}).items()})
            _warn_if_not_valid_now(
                "scrape client certificate", config.scrape_client_cert_file, info
            )
        if config.scrape_insecure_skip_verify:
            log.warning(
                "scrape_tls_verification_disabled",
                detail="https metrics endpoints are not authenticated "
                "(datalayer.scrape_insecure_skip_verify)",
                **fields,
            )
        elif fields:
            log.info("scrape_tls", **fields)

    def context(self) -> ssl.SSLContext:
        if self.files is None:
            assert self._static is not None
            return self._static
        return self.files.current()[0]

    def _build(self, contents: list[bytes]) -> ssl.SSLContext:
        config = self.config
        ca = config.scrape_ca_file
        if ca is not None:
            _check_ca_bundle(str(ca), contents[0])
        context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
        if config.scrape_insecure_skip_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if config.scrape_client_cert_file is not None:
            assert config.scrape_client_key_file is not None  # the config checks the pair
            context.load_cert_chain(
                config.scrape_client_cert_file,
                config.scrape_client_key_file,
                password=_refuse_password,
            )
        return context
