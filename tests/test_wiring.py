"""epp.wiring: the endpoint store has one listener, which hands each event to the scraper,
the prefix index, precise mode and the router in that order (the data flow the module
states), whatever order the parts were built in.

Real parts (store, scraper, index, precise mode, router); each one's entry point is
wrapped to record the call, then runs as it would."""

from __future__ import annotations

from helpers import config

from epp.config import EndpointConfig, EppConfig
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.wiring import connect


def parts() -> tuple[EppConfig, EndpointStore, PrefixIndex, PreciseMode, Router, MetricsScraper]:
    """The real components, built but not connected."""
    cfg = config()
    store = EndpointStore.for_config(cfg)
    index = PrefixIndex.from_config(cfg.prefix)
    precise = PreciseMode(cfg.kv_events, index, cfg.prefix.block_size)
    router = Router(
        cfg, store, index, Scheduler(cfg.scheduling), ByteEstimateTokenizer(), EppMetrics()
    )
    return cfg, store, index, precise, router, MetricsScraper(store, cfg.datalayer)


def test_each_store_event_reaches_scraper_index_precise_mode_then_router():
    cfg, store, index, precise, router, scraper = parts()
    heard: list[tuple[str, str]] = []

    def record(name, real):
        def call(*args):
            heard.append((name, args[0] if isinstance(args[0], str) else "index"))
            return real(*args)

        return call

    scraper.on_endpoint_change = record("scraper", scraper.on_endpoint_change)
    precise.on_change = record("precise", precise.on_change)
    router.on_endpoint_change = record("router", router.on_endpoint_change)
    index.remove_pod = record("index", index.remove_pod)
    connect(store, index, router, cfg, precise, scraper=scraper)

    store.sync([EndpointConfig(name="a", address="10.0.0.1:8000")])
    assert heard == [("scraper", "added"), ("precise", "added"), ("router", "added")]
    heard.clear()
    store.sync([])
    # First calls (precise mode also drops the pod's entries from the index itself).
    first = list(dict.fromkeys(name for name, _ in heard))
    assert first == ["scraper", "index", "precise", "router"]


def test_precise_mode_hears_the_routers_decisions():
    cfg, store, index, precise, router, _ = parts()
    connect(store, index, router, cfg, precise)
    assert router.hooks.before_record == [precise.precise.dispatched]
    assert router.hooks.completed == [precise.precise.completed]


def test_a_dispatch_of_this_router_or_a_peer_wakes_the_pods_scrape_loop():
    """The router's `shared` hook and the peers' inbox (`peer_dispatched` hook) reach
    `MetricsScraper.wake` with the pod's name: an idle pod's loop is woken by a request."""
    from epp.observability.replica_metrics import ReplicaMetrics
    from epp.replicas.inbox import PeerInbox
    from epp.replicas.protocol import Decision
    from epp.request import IncomingRequest

    cfg = config()
    store = EndpointStore.for_config(cfg)
    store.sync([EndpointConfig(name="a", address="10.0.0.1:8000")])
    store.scraped(store.get("a"), PodMetrics(model="m"))
    index = PrefixIndex.from_config(cfg.prefix)
    metrics = EppMetrics()
    router = Router(cfg, store, index, Scheduler(cfg.scheduling), ByteEstimateTokenizer(), metrics)
    scraper = MetricsScraper(store, cfg.datalayer)
    woken: list[str] = []
    scraper.wake = woken.append
    connect(store, index, router, cfg, scraper=scraper)

    body = b'{"model": "m", "prompt": "hello"}'
    router.route_now(IncomingRequest(path="/v1/completions", body=body, request_id="r"))
    assert woken == ["a"]
    inbox = PeerInbox(
        "me", store, index, router.scheduler, router, ReplicaMetrics(metrics.registry),
        block_size=cfg.prefix.block_size, max_blocks=64, max_age_s=1e12,
    )  # fmt: skip
    message = Decision(
        replica="peer", pod="a", hashes=[], prompt_tokens=10, matched=0, uncached=10, at=0.0
    )
    assert inbox.decision(message) == "applied"
    assert woken == ["a", "a"]


def test_a_pod_whose_kv_events_stop_wakes_its_scrape_loop():
    """Precise mode detaching a pod (its events stopped, or it is no longer followed)
    reaches `MetricsScraper.wake`: the loop, sleeping through the KV-event interval, needs
    pages at the fast one again (tests/datalayer/test_scraper.py)."""
    cfg, store, index, precise, router, scraper = parts()
    woken: list[str] = []
    scraper.wake = woken.append
    connect(store, index, router, cfg, precise, scraper=scraper)
    precise.precise.attach("a", "m")
    assert woken == []
    precise.precise.detach("a")
    assert woken == ["a"] and not index.is_precise("a")
