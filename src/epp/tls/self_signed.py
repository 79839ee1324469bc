"""A self-signed certificate generated in memory at start (the upstream EPP's
SecureServing without certificate files)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from epp.tls.files import dn

log = structlog.get_logger("epp.tls")


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
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    not_after = now + timedelta(days=valid_days)
    cert = _sign(key, dns[-1][:64], alt_names, now, not_after)
    digest = cert.fingerprint(hashes.SHA256()).hex().upper()
    return SelfSignedCertificate(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        sha256=":".join(digest[i : i + 2] for i in range(0, len(digest), 2)),
        subject=dn(
            [[("organizationName", SELF_SIGNED_ORGANIZATION)], [("commonName", dns[-1][:64])]]
        ),
        names=tuple([f"DNS:{n}" for n in dns] + [f"IP Address:{a}" for a in ips]),
        not_after=not_after.timestamp(),
    )


# A leaf for TLS servers only: it signs handshakes, nothing else, and is no CA.
_SERVER_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)


def _sign(
    key: ec.EllipticCurvePrivateKey,
    common_name: str,
    alt_names: list[x509.GeneralName],
    now: datetime,
    not_after: datetime,
) -> x509.Certificate:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, SELF_SIGNED_ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(seconds=SELF_SIGNED_BACKDATE_S))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_SERVER_KEY_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
