"""TLS on the gRPC port and for the metrics scraper.

Three users: the gRPC port with certificate files (`GrpcServerTls`: server certificate,
optional client CA for mutual TLS), the gRPC port without files (`SelfSignedTls`: a
certificate generated in memory at start, as the upstream EPP's SecureServing does), and
the metrics scraper (`ScrapeTls`: the client context for https metrics URLs). The file
users read their files through `WatchedFiles`.

Modules: `files` (reading, watching and validating the files), `server` (the gRPC
port's credentials), `self_signed` (certificate generation), `scrape` (the scraper's
client context).

Connections already open keep the session they were established with; only new handshakes
see a new certificate.
"""

from epp.tls.files import MAX_FILE_BYTES, CertInfo, TlsError, WatchedFiles, cert_info
from epp.tls.scrape import SCRAPE_TLS_CHECK_S, ScrapeTls
from epp.tls.self_signed import (
    SELF_SIGNED_BACKDATE_S,
    SELF_SIGNED_ORGANIZATION,
    SELF_SIGNED_VALID_DAYS,
    SelfSignedCertificate,
    generate_self_signed,
    self_signed_names,
)
from epp.tls.server import GrpcServerTls, GrpcTransport, SelfSignedTls, grpc_transport

__all__ = [
    "MAX_FILE_BYTES",
    "SCRAPE_TLS_CHECK_S",
    "SELF_SIGNED_BACKDATE_S",
    "SELF_SIGNED_ORGANIZATION",
    "SELF_SIGNED_VALID_DAYS",
    "CertInfo",
    "GrpcServerTls",
    "GrpcTransport",
    "ScrapeTls",
    "SelfSignedCertificate",
    "SelfSignedTls",
    "TlsError",
    "WatchedFiles",
    "cert_info",
    "generate_self_signed",
    "grpc_transport",
    "self_signed_names",
]
