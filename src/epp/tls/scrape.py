"""The client SSL context for https metrics URLs (`datalayer.scrape_*`)."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from typing import Any

import structlog

from epp.config import DataLayerConfig
from epp.tls.files import (
    WatchedFiles,
    cert_info,
    check_ca_bundle,
    refuse_password,
    warn_if_not_valid_now,
)

log = structlog.get_logger("epp.tls")

# How often the scraper's CA and client certificate files are checked for changes.
SCRAPE_TLS_CHECK_S = 5.0


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
        _log_settings(config)

    def context(self) -> ssl.SSLContext:
        if self.files is None:
            assert self._static is not None
            return self._static
        return self.files.current()[0]

    def _build(self, contents: list[bytes]) -> ssl.SSLContext:
        config = self.config
        ca = config.scrape_ca_file
        if ca is not None:
            check_ca_bundle(str(ca), contents[0])
        context = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
        if config.scrape_insecure_skip_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if config.scrape_client_cert_file is not None:
            assert config.scrape_client_key_file is not None  # the config checks the pair
            context.load_cert_chain(
                config.scrape_client_cert_file,
                config.scrape_client_key_file,
                password=refuse_password,
            )
        return context


def _log_settings(config: DataLayerConfig) -> None:
    """One line at start: the files in use, the client certificate's subject and expiry, and
    a warning when verification is off."""
    fields: dict[str, Any] = {}
    if config.scrape_ca_file is not None:
        fields["ca_file"] = str(config.scrape_ca_file)
    if config.scrape_client_cert_file is not None:
        info = cert_info(config.scrape_client_cert_file)
        fields["client_cert_file"] = str(config.scrape_client_cert_file)
        fields.update({f"client_{k}": v for k, v in (info.fields() if info else {}).items()})
        warn_if_not_valid_now("scrape client certificate", config.scrape_client_cert_file, info)
    if config.scrape_insecure_skip_verify:
        log.warning(
            "scrape_tls_verification_disabled",
            detail="https metrics endpoints are not authenticated "
            "(datalayer.scrape_insecure_skip_verify)",
            **fields,
        )
    elif fields:
        log.info("scrape_tls", **fields)
