"""Server credentials for the gRPC port: from certificate files that are watched and
reloaded (`GrpcServerTls`), or from a certificate generated at start (`SelfSignedTls`).
Connections already open keep the session they were established with; only new
handshakes see a new certificate."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc
import structlog

from epp.config import ServerConfig, TlsConfig
from epp.tls.files import (
    CertInfo,
    WatchedFiles,
    cert_info,
    check_ca_bundle,
    refuse_password,
    warn_if_not_valid_now,
)
from epp.tls.self_signed import SelfSignedCertificate, generate_self_signed

log = structlog.get_logger("epp.tls")


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
        warn_if_not_valid_now("grpc server certificate", config.cert_file, self.files.value.cert)

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
            warn_if_not_valid_now("grpc server certificate", self.config.cert_file, material.cert)
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
            self.config.cert_file, self.config.key_file, password=refuse_password
        )
        ca_certs = 0
        if client_ca is not None:
            ca_certs = check_ca_bundle(str(self.config.client_ca_file), client_ca)
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
