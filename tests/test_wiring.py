"""epp.wiring: the endpoint store has one listener, which hands each event to the scraper,
the prefix index, precise mode and the router in that order (the data flow the module
states), whatever order the parts were built in.

Real parts (store, scraper, index, precise mode, router); each one's entry point is
wrapped to record the call, then runs as it would."""

from __future__ import annotations

from helpers import config

from epp.config import EndpointConfig
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.wiring import connect


def test_each_store_event_reaches_scraper_index_precise_mode_then_router():
    cfg = config()
    store = EndpointStore.for_config(cfg)
    index = PrefixIndex.from_config(cfg.prefix)
    precise = PreciseMode(cfg.kv_events, index, cfg.prefix.block_size)
    router = Router(
        cfg, store, index, Scheduler(cfg.scheduling), ByteEstimateTokenizer(), EppMetrics()
    )
    scraper = MetricsScraper(store, cfg.datalayer)
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
    cfg = config()
    store = EndpointStore.for_config(cfg)
    index = PrefixIndex.from_config(cfg.prefix)
    precise = PreciseMode(cfg.kv_events, index, cfg.prefix.block_size)
    router = Router(
        cfg, store, index, Scheduler(cfg.scheduling), ByteEstimateTokenizer(), EppMetrics()
    )
    connect(store, index, router, cfg, precise)
    assert router.hooks.before_record == [precise.precise.dispatched]
    assert router.hooks.completed == [precise.precise.completed]
