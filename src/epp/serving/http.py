"""The service's HTTP pages: Prometheus /metrics and the probes (/healthz, /ready) on the
metrics port, and the debug pages on a loopback address only.

/metrics is collected on the loop and encoded in a worker thread (`EppMetrics.render`):
the loop owns what the collectors read, and the encoding is most of a scrape's CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from epp.addresses import format_host_port
from epp.observability.debug_pages import debug_routes, is_loopback

if TYPE_CHECKING:
    from epp.app import EppService
    from epp.datalayer.kv_events_wiring import PreciseMode
    from epp.datalayer.store import EndpointStore
    from epp.prefix.index import PrefixIndex

log = structlog.get_logger("epp.app")


def web_app(service: EppService) -> web.Application:
    """The metrics port's pages (and the debug pages when that port is loopback)."""
    app = web.Application()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=await service.metrics.render(), content_type="text/plain")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def ready(_: web.Request) -> web.Response:
        is_ready = service.ready
        return web.Response(
            text="ready" if is_ready else "not ready", status=200 if is_ready else 503
        )

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/ready", ready)
    if service.config.server.debug_port is not None and debug_shares_metrics(service):
        app.add_routes(service_debug_routes(service))
    return app


def debug_shares_metrics(service: EppService) -> bool:
    """A metrics port on a loopback address is as private as the debug port would be."""
    return is_loopback(service.config.server.metrics_host)


async def start_debug_pages(service: EppService) -> tuple[web.AppRunner | None, str | None]:
    """The debug pages on a loopback address only (server.debug_host, debug_port): they
    show which pod holds which prefix, and cost routing-loop time. Returns the runner
    this started (None: none) and the pages' host:port (None: off)."""
    server = service.config.server
    if server.debug_port is None:
        return None, None
    if debug_shares_metrics(service):
        return None, format_host_port(server.metrics_host, service.metrics_port)
    app = web.Application()
    app.add_routes(service_debug_routes(service))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, server.debug_host, server.debug_port).start()
    except OSError as err:  # optional pages never stop the service
        await runner.cleanup()
        log.warning("debug_pages_unavailable", host=server.debug_host, error=str(err))
        return None, None
    address = format_host_port(server.debug_host, runner.addresses[0][1])
    if is_loopback(server.debug_host):
        log.info("debug_pages", address=address)
    else:
        log.warning("debug_pages_exposed", address=address)
    return runner, address


def service_debug_routes(service: EppService) -> list[web.RouteDef]:
    index, precise = service.index, service.precise

    def pod_index(pod: str) -> dict[str, Any]:
        return {
            "mode": precise.mode_of(pod),
            "blocks": index.blocks(pod),
            "capacity": index.capacity(pod),
        }

    return debug_routes(
        lambda: endpoint_rows(service.store, index, precise),
        index.pods,
        pod_index,
        index.engine_block_slices,
    )


def endpoint_rows(
    store: EndpointStore, index: PrefixIndex, precise: PreciseMode
) -> list[dict[str, Any]]:
    """/debug/endpoints: one row per known pod."""
    return [
        {
            "name": e.name,
            "address": e.address,
            "model": e.model,
            "health": round(e.health, 3),
            "queue_depth": e.queue_depth,
            "kv_usage": e.kv_usage,
            "in_flight": e.in_flight,
            "in_flight_tokens": e.in_flight_tokens,
            "concurrency": e.concurrency,
            "running_slots": e.slots,
            "load": round(e.load, 3),
            "excluded": e.excluded,
            "gauges_frozen": e.gauges_frozen,
            "error_rate": round(e.error_rate, 3),
            "adapters": sorted(e.adapters),
            "prefix_blocks": index.blocks(e.name),
            "index_mode": precise.mode_of(e.name),
            "kv_events": kv_events_state(precise, e.name),
            "scrape_failures": e.consecutive_failures,
            # The server process's start time (process_start_time_seconds):
            # a later one is a restart (entries dropped, then resynced).
            "start_time": e.metrics.start_time if e.metrics else None,
            "last_error": e.last_error,
        }
        for e in store.all()
    ]


def kv_events_state(precise: PreciseMode, pod: str) -> dict[str, Any] | None:
    """The pod's KV-event subscriber as /debug/endpoints shows it (None: not followed)."""
    sub = precise.subscriber(pod)
    if sub is None:
        return None
    state = sub.state
    return {
        "endpoint": sub.endpoint,
        "replay": sub.replay_endpoint,
        "mode": sub.mode,
        "connected": state.connected,
        "attached": state.attached,
        "next_seq": state.next_seq,
        "messages": state.messages,
        "replayed": state.replayed,
        "gaps": state.gaps,
        "restarts": state.restarts,
        "resyncs": state.resyncs,
        "replay_failures": state.replay_failures,
        "disconnects": state.disconnects,
    }
