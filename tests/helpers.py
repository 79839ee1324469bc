"""Shared builders for unit tests: endpoints with given signals, a router on a store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from epp.config import EppConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_parser import PodMetrics


def endpoint(
    name: str,
    *,
    kv: float = 0.0,
    waiting: float = 0.0,
    health: float = 1.0,
    adapters: frozenset[str] = frozenset(),
    model: str | None = "m",
    port: int | None = None,
    labels: dict[str, str] | None = None,
) -> Endpoint:
    port = port if port is not None else 8000 + abs(hash(name)) % 1000
    e = Endpoint(
        name=name,
        address=f"10.0.0.1:{port}",
        metrics_url=f"http://10.0.0.1:{port}/metrics",
        labels=labels or {},
    )
    e.metrics = PodMetrics(waiting=waiting, kv_usage=kv, model=model, running_adapters=adapters)
    e.adapters_seen = dict.fromkeys(adapters, 0.0)
    e.metrics_at = 0.0
    e.health = health
    e.unhealthy = e.excluded = health < 0.3  # the store's verdict at the default threshold
    e.refresh()
    return e


def config(**sections: dict) -> EppConfig:
    return EppConfig.model_validate(sections)


def router_with(
    endpoint_configs: list[dict], *, clock: Callable[[], float] | None = None, **sections: dict
):
    """A real Router over a store holding these endpoints as freshly scraped, idle pods,
    connected to the store as the app connects it; `clock` replaces the store's
    (monotonic) clock."""
    from epp.app import connect
    from epp.config import EndpointConfig
    from epp.datalayer.store import EndpointStore
    from epp.observability.metrics import EppMetrics
    from epp.prefix.index import PrefixIndex
    from epp.routing import Router
    from epp.scheduling.scheduler import Scheduler
    from epp.tokenization.estimate import ByteEstimateTokenizer

    cfg = config(**sections)
    store = EndpointStore.for_config(cfg) if clock is None else EndpointStore.for_config(cfg, clock)
    store.sync([EndpointConfig.model_validate(c) for c in endpoint_configs])
    for e in store.all():
        store.scraped(e, PodMetrics(model="m"))
    index = PrefixIndex.from_config(cfg.prefix)
    metrics = EppMetrics()
    router = Router(cfg, store, index, Scheduler(cfg.scheduling), ByteEstimateTokenizer(), metrics)
    connect(store, index, router, cfg)
    return router, store, index, metrics


def served_certificate(host: str, port: int, timeout: float = 5.0) -> tuple[bytes, str | None]:
    """The certificate a TLS port presents (PEM) and the ALPN protocol it chose for a client
    offering h2, read from a handshake that verifies nothing: how a test client learns the
    EPP's self-signed certificate (gRPC Python has no "do not verify" option) and then
    trusts exactly that one. Blocking; from async code run it in a thread."""
    import socket
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return ssl.DER_cert_to_PEM_cert(der).encode(), tls.selected_alpn_protocol()


def epp_channel_credentials(host: str, port: int) -> grpc.ChannelCredentials:
    """Credentials that trust the certificate the EPP at host:port serves now (its
    self-signed one by default). The certificate names 127.0.0.1 and localhost."""
    return grpc.ssl_channel_credentials(root_certificates=served_certificate(host, port)[0])


async def until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Wait, yielding to the event loop, until `condition()` holds (AssertionError after
    `timeout` seconds): for what real sockets deliver in their own time."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or 'a condition'}")
        await asyncio.sleep(0.02)


def engine_router(address: str, model: str, **entry: object):
    """A real Router in front of one real pod at `address` serving `model`, whose
    tokenizer is the engine (`tokenizers: {model: {source: engine, **entry}}`), as the app
    wires it: (router, the EngineTokenizer, the metrics registry). Close the tokenizer."""
    from epp.app import connect
    from epp.datalayer.store import EndpointStore
    from epp.observability.metrics import EppMetrics
    from epp.prefix.index import PrefixIndex
    from epp.routing import Router
    from epp.scheduling.scheduler import Scheduler
    from epp.tokenization import TokenizerRegistry
    from epp.tokenization.engine import EngineTokenizer

    cfg = EppConfig.model_validate(
        {
            "tokenizers": {model: {"source": "engine", **entry}},
            "endpoints": [{"name": "pod-0", "address": address}],
        }
    )
    store = EndpointStore.for_config(cfg)
    store.sync(cfg.endpoints)
    for e in store.all():
        store.scraped(e, PodMetrics(model=model))
    index = PrefixIndex.from_config(cfg.prefix)
    metrics = EppMetrics()
    tokenizers = TokenizerRegistry.from_config(cfg.tokenizers)
    router = Router(cfg, store, index, Scheduler(cfg.scheduling), tokenizers, metrics)
    connect(store, index, router, cfg)
    engine = EngineTokenizer.from_config(cfg.tokenizers, store.all, metrics.registry)
    assert engine is not None
    router.engine_tokenizer = engine
    return router, engine, metrics.registry
