"""Certificate files: reading them, watching them for changes (`WatchedFiles`), and what
the logs say about a certificate (`CertInfo`).

- the files are re-read at most every `check_s`, when the value is asked for (gRPC asks
  ahead of every new TLS handshake; the scraper ahead of every https scrape);
- what decides "changed" is a SHA-256 over the files' content, not their mtime: a
  Kubernetes Secret volume swaps its `..data` symlink (the paths never change, their
  targets do), and a file rewritten in place within one coarse mtime tick keeps its mtime.
  The files are a few KB (at most MAX_FILE_BYTES each), so reading them every few
  seconds costs microseconds;
- a changed set is validated first (PEM parses, the key matches the certificate, the CA
  bundle holds a certificate), then read again: it is taken only if nothing changed
  meanwhile, so a half-written rotation is never served. A set that fails is logged once
  (per distinct content or error) and the last good one stays in use;
- at start there is no last good one: a bad file raises TlsError and the process does not
  start.
"""

from __future__ import annotations

import hashlib
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog

log = structlog.get_logger("epp.tls")

T = TypeVar("T")

# A certificate, key or CA bundle file larger than this is not one.
MAX_FILE_BYTES = 1024 * 1024


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used."""


def refuse_password() -> bytes:
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


def dn(name: Any) -> str:
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
            subject=dn(decoded.get("subject", ())),
            issuer=dn(decoded.get("issuer", ())),
            not_before=ssl.cert_time_to_seconds(decoded["notBefore"]),
            not_after=ssl.cert_time_to_seconds(decoded["notAfter"]),
            names=tuple(f"{kind}:{value}" for kind, value in decoded.get("subjectAltName", ())),
        )
    except (ssl.SSLError, OSError, KeyError, ValueError):
        return None


def warn_if_not_valid_now(what: str, path: Path, info: CertInfo | None) -> None:
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
            raise TlsError(f"{what}: {reason(exc)}") from exc
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
            self._report_failure(digest, reason(exc))
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


def reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return f"{exc.library or 'SSL'}: {exc.reason}"
    return str(exc) or type(exc).__name__


def check_ca_bundle(what: str, data: bytes) -> int:
    """How many certificates a PEM CA bundle holds; raises if none parses."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise TlsError(f"{what}: not a PEM file") from exc
    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
    return text.count("-----BEGIN CERTIFICATE-----")
