"""The scraper against https metrics endpoints (aiohttp servers on loopback with
certificates the tests make, tests/certs.py): verified with the configured CA, a failed
scrape (recorded, the loop goes on) without it, insecure_skip_verify, a client certificate
for pods that require one, and CA / client certificate files re-read when they change."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from aiohttp import web
from certs import CertAuthority, Leaf, needs_openssl

from epp.config import DataLayerConfig, EndpointConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.tls import ScrapeTls, TlsError

pytestmark = needs_openssl

PAGE = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.33-metrics.txt").read_text()
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the page's


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertAuthority | Leaf]:
    one = CertAuthority(tmp_path_factory.mktemp("ca-one"), "ca-one")
    two = CertAuthority(tmp_path_factory.mktemp("ca-two"), "ca-two")
    return {
        "ca1": one,
        "ca2": two,
        "pod1": one.issue("vllm-pod"),
        "pod2": two.issue("vllm-pod-two"),
        "epp1": one.issue("epp"),
        "epp2": two.issue("epp-two"),
    }


class HttpsPod:
    """A vLLM metrics page over https. Its server context can take a new certificate
    (`load`) for the handshakes that follow; `close_each` answers `Connection: close`, so
    every scrape is a new handshake."""

    def __init__(self, leaf: Leaf, client_ca: CertAuthority | None = None, close_each=False):
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.load(leaf)
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(cafile=client_ca.cert)
        self.close_each = close_each
        self.port = 0

    def load(self, leaf: Leaf) -> None:
        self.context.load_cert_chain(leaf.cert, leaf.key)

    async def __aenter__(self) -> HttpsPod:
        async def metrics(_: web.Request) -> web.Response:
            headers = {"Connection": "close"} if self.close_each else None
            return web.Response(text=PAGE, headers=headers)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/metrics"


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s")
        await asyncio.sleep(0.01)


class Scraping:
    """A store and a running scraper for some endpoints (name -> metrics URL)."""

    def __init__(self, config: DataLayerConfig, urls: dict[str, str], tls_check_s=None):
        self.store = EndpointStore(config)
        self.store.sync(
            [
                EndpointConfig(name=name, address=f"127.0.0.1:{i + 1}", metrics_url=url)
                for i, (name, url) in enumerate(urls.items())
            ]
        )
        self.scraper = MetricsScraper(self.store, config)
        if tls_check_s is not None:  # files checked more often than the default 5 s
            self.scraper.tls = ScrapeTls(config, check_s=tls_check_s)

    def pod(self, name: str = "pod") -> Endpoint:
        return self.store.get(name)

    async def __aenter__(self) -> Scraping:
        await self.scraper.start()
        await asyncio.wait_for(self.scraper.first_round.wait(), 5)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.scraper.stop()


def config(**tls: object) -> DataLayerConfig:
    return DataLayerConfig(scrape_interval_s=0.02, scrape_timeout_s=2.0, **tls)


async def test_https_pod_scraped_with_the_ca_file_and_failed_without_it(pki):
    async with HttpsPod(pki["pod1"]) as pod:
        async with Scraping(config(scrape_ca_file=pki["ca1"].cert), {"pod": pod.url}) as s:
            assert s.pod().metrics_at is not None and s.pod().model == MODEL
            assert s.pod().consecutive_failures == 0
        # The system's trust store does not know the test CA: every scrape fails, each one
        # recorded against the pod, and its loop goes on.
        async with Scraping(config(), {"pod": pod.url}) as s:
            await until(lambda: s.pod().consecutive_failures >= 3)
            assert s.pod().metrics_at is None
            assert "CERTIFICATE_VERIFY_FAILED" in (s.pod().last_error or "")
            # No other pod answered meanwhile, so the failures are not charged against
            # its health (datalayer/health.py: they could be the EPP's own).
            assert s.pod().charged_failures == 0 and s.pod().health == 0.5


async def test_a_ca_file_does_not_disturb_plain_http_pods(pki):
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=PAGE)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/metrics"  # type: ignore[union-attr]
    try:
        async with HttpsPod(pki["pod2"]) as pod:  # signed by a CA the scraper does not trust
            urls = {"http": http_url, "https": pod.url}
            async with Scraping(config(scrape_ca_file=pki["ca1"].cert), urls) as s:
                await until(lambda: s.pod("https").consecutive_failures >= 2)
                assert s.pod("http").metrics_at is not None
                assert s.pod("http").consecutive_failures == 0
    finally:
        await runner.cleanup()


async def test_insecure_skip_verify_scrapes_any_certificate_with_a_warning(pki):
    async with HttpsPod(pki["pod2"]) as pod:
        with structlog.testing.capture_logs() as logs:
            cfg = config(scrape_ca_file=pki["ca1"].cert, scrape_insecure_skip_verify=True)
            async with Scraping(cfg, {"pod": pod.url}) as s:
                assert s.pod().metrics_at is not None
    [warning] = [e for e in logs if e["event"] == "scrape_tls_verification_disabled"]
    assert warning["log_level"] == "warning"


async def test_a_pod_that_requires_a_client_certificate(pki):
    async with HttpsPod(pki["pod1"], client_ca=pki["ca1"]) as pod:
        async with Scraping(config(scrape_ca_file=pki["ca1"].cert), {"pod": pod.url}) as s:
            await until(lambda: s.pod().consecutive_failures >= 2)
            assert s.pod().metrics_at is None
        # A certificate from another CA is refused too.
        other = config(
            scrape_ca_file=pki["ca1"].cert,
            scrape_client_cert_file=pki["epp2"].cert,
            scrape_client_key_file=pki["epp2"].key,
        )
        async with Scraping(other, {"pod": pod.url}) as s:
            await until(lambda: s.pod().consecutive_failures >= 2)
            assert s.pod().metrics_at is None
        with structlog.testing.capture_logs() as logs:
            mutual = config(
                scrape_ca_file=pki["ca1"].cert,
                scrape_client_cert_file=pki["epp1"].cert,
                scrape_client_key_file=pki["epp1"].key,
            )
            async with Scraping(mutual, {"pod": pod.url}) as s:
                assert s.pod().metrics_at is not None and s.pod().consecutive_failures == 0
    [started] = [e for e in logs if e["event"] == "scrape_tls"]
    assert started["client_subject"] == "CN=epp" and started["ca_file"] == str(pki["ca1"].cert)
    assert "PRIVATE KEY" not in repr(logs)


async def test_a_rotated_ca_file_is_used_for_new_connections_and_a_broken_one_is_not(tmp_path, pki):
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(pki["ca1"].pem)
    pod = HttpsPod(pki["pod1"], close_each=True)
    async with pod, Scraping(config(scrape_ca_file=ca_file), {"pod": pod.url}, 0.05) as s:
        assert s.pod().metrics_at is not None
        # A broken CA file: reported, the previous trust kept, scraping goes on.
        with structlog.testing.capture_logs() as logs:
            ca_file.write_text("not a certificate\n")
            await until(lambda: s.scraper.tls.files.failures == 1)  # type: ignore[union-attr]
            for _ in range(3):  # new handshakes (Connection: close) with the kept trust
                scraped = s.pod().metrics_at
                await until(lambda: s.pod().metrics_at != scraped)  # noqa: B023
            assert s.pod().consecutive_failures == 0
        assert [e["event"] for e in logs if e["event"].startswith("tls_")] == ["tls_reload_failed"]
        ca_file.write_bytes(pki["ca1"].pem)
        # The pod turns to a certificate from a new CA: scrapes fail until the
        # scraper's CA file names that CA too.
        pod.load(pki["pod2"])
        await until(lambda: s.pod().consecutive_failures >= 2)
        ca_file.write_bytes(pki["ca2"].pem)
        await until(lambda: s.pod().consecutive_failures == 0, seconds=2.0)
        assert s.scraper.tls.files.reloads == 1  # type: ignore[union-attr]


def test_scrape_tls_files_are_checked_at_most_every_check_s(tmp_path, pki):
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(pki["ca1"].pem)
    now = [0.0]
    tls = ScrapeTls(config(scrape_ca_file=ca_file), check_s=1.0, clock=lambda: now[0])
    first = tls.context()
    ca_file.write_bytes(pki["ca2"].pem)
    now[0] += 0.9
    assert tls.context() is first
    now[0] += 0.1
    second = tls.context()
    assert second is not first
    assert second.get_ca_certs()[0]["subject"] == ((("commonName", "ca-two"),),)
    assert second.verify_mode == ssl.CERT_REQUIRED and second.check_hostname


def test_unusable_scrape_tls_files_fail_at_start(tmp_path, pki):
    with pytest.raises(TlsError, match="No such file"):
        MetricsScraper(EndpointStore(config()), config(scrape_ca_file=tmp_path / "missing.crt"))
    mismatched = config(
        scrape_client_cert_file=pki["epp1"].cert, scrape_client_key_file=pki["epp2"].key
    )
    with pytest.raises(TlsError, match="KEY_VALUES_MISMATCH"):
        MetricsScraper(EndpointStore(config()), mismatched)
