"""Certificates the TLS tests make for themselves, with the `openssl` command line.

EC P-256 keys (fast to generate), a CA per test that wants one, leaf certificates for
127.0.0.1 and localhost usable as server and as client certificates, valid for two days.

Without an `openssl` binary the tests that need one skip, visibly (`needs_openssl`).
"""

from __future__ import annotations

import itertools
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="no openssl binary to make certificates")

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[leaf]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = IP:127.0.0.1,DNS:localhost
"""
_names = itertools.count()


def _openssl(*args: str | Path, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Leaf:
    cert: Path
    key: Path
    name: str

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()


class CertAuthority:
    """A self-signed CA in `directory` (ca.pem, ca.key) that issues leaf certificates."""

    def __init__(self, directory: Path, name: str = "test-ca") -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._config = self.dir / "openssl.cnf"
        self._config.write_text(_CONFIG)
        self.cert = self.dir / "ca.pem"
        self.key = self.dir / "ca.key"
        self._req(
            "-x509",
            "-days",
            "2",
            "-extensions",
            "ca",
            "-keyout",
            self.key,
            "-out",
            self.cert,
            subj=name,
        )

    @property
    def pem(self) -> bytes:
        return self.cert.read_bytes()

    def issue(self, name: str = "epp-server") -> Leaf:
        """A certificate for 127.0.0.1 / localhost (server and client use), and its key."""
        stem = f"{name}-{next(_names)}"
        key, csr, cert = (self.dir / f"{stem}.{ext}" for ext in ("key", "csr", "pem"))
        self._req("-keyout", key, "-out", csr, subj=name)
        _openssl(
            "x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key,
            "-set_serial", str(secrets.randbits(63)), "-days", "2",
            "-extfile", self._config, "-extensions", "leaf", "-out", cert,
            cwd=self.dir,
        )  # fmt: skip
        return Leaf(cert, key, name)

    def _req(self, *args: str | Path, subj: str) -> None:
        _openssl(
            "req", "-new", "-config", self._config, "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-subj", f"/CN={subj}", *args,
            cwd=self.dir,
        )  # fmt: skip


def encrypt_key(key: Path, out: Path, password: str = "secret") -> Path:
    """A copy of `key` encrypted with a password (which the EPP must refuse, not prompt for)."""
    _openssl(
        "pkey", "-in", key, "-aes256", "-passout", f"pass:{password}", "-out", out, cwd=out.parent
    )
    return out
