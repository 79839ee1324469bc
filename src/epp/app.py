"""`epp serve`: the endpoint picker service.

Wires the pieces together: config -> discovery (an InferencePool watched in Kubernetes, or
the static endpoints and the endpoints file, watched) -> endpoint store -> metrics scraper
-> prefix index + scheduler -> router -> ext_proc gRPC server; plus an HTTP server for
Prometheus (/metrics) and probes (/healthz, /ready).

The data flows one way. Nothing subscribes itself: `epp.wiring.connect` connects the
endpoint store's events to their readers (scraper, prefix index, precise mode, router, in
that order) and the router's decisions to precise mode; discovery delivers endpoints to
`store.sync` and models to `router.set_model_table`; with `replicas.peers`, ReplicaSync
shares the router's decisions with the peer replicas and applies theirs here.

This module builds the components and runs their lifecycle (start, drain, stop, the
maintenance loop); `epp.serving` holds the command line (`args`), the endpoint and Lease
sources (`sources`), the HTTP pages (`http`) and the signal handling (`signals`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from epp.addresses import format_host_port
from epp.config import EppConfig
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.extproc.server import (
    ExternalProcessor,
    HealthState,
    build_grpc_server,
    build_health_server,
)
from epp.kernels import KERNELS
from epp.leader import LeaderElectionError, LeaderElector, LeaseTimings
from epp.observability.logs import configure_logging
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.replicas import ReplicaSync
from epp.replicas.auth import SecretError
from epp.routing import Router
from epp.scheduling.registry import ScorerRegistry
from epp.scheduling.scheduler import Scheduler
from epp.serving.args import build_parser as build_parser  # re-exported: the command line
from epp.serving.args import config_from_args as config_from_args
from epp.serving.args import our_flag_names as our_flag_names
from epp.serving.args import parse_serve_args
from epp.serving.http import endpoint_rows, start_debug_pages, web_app
from epp.serving.signals import serve_until_signalled
from epp.serving.sources import Discovery as Discovery
from epp.serving.sources import make_discovery, make_leader_elector
from epp.tls import TlsError
from epp.tokenization import TokenizerRegistry
from epp.tokenization.engine import EngineTokenizer
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.protocol import Tokenizer
from epp.upstream_flags import FlagError
from epp.wiring import connect as connect  # re-exported: benchmarks and tests wire with it

log = structlog.get_logger("epp.app")


HEALTH_REFRESH_S = 0.25
DRAIN_POLL_S = 0.05


@dataclass
class EppService:
    """A running EPP; `start()`/`stop()` for tests, `run_until_stopped()` for the CLI."""

    config: EppConfig
    registry: ScorerRegistry | None = None  # add custom scorers here before start
    # For models without a `tokenizers:` entry (default: the byte-level estimate).
    tokenizer: Tokenizer | None = None
    # The Kubernetes API client for pool discovery (default: in-cluster or kubeconfig);
    # tests pass one pointed at a stand-in API server.
    kube_client: Any = None
    # Leader election's timings (epp/leader.py; default controller-runtime's, as upstream);
    # tests shorten them.
    lease_timings: LeaseTimings | None = None

    def __post_init__(self) -> None:
        config = self.config
        self.metrics = EppMetrics()
        self.store = EndpointStore.for_config(config)
        self.index = PrefixIndex.from_config(
            config.prefix,
            predicted_ttl_s=config.kv_events.predicted_ttl_s,
            predicted_max_s=config.kv_events.predicted_max_s,
            clock=self.store.now,
        )
        # KV events (precise mode): subscribers start with the service (start()).
        self.precise = PreciseMode(config.kv_events, self.index, config.prefix.block_size)
        self.scheduler = Scheduler(config.scheduling, self.registry)
        self.router = self._router()
        # A pod whose KV state arrives as events needs its page less often.
        self.scraper = MetricsScraper(
            self.store, config.datalayer, kv_events_followed=self.precise.owns_entries
        )
        connect(self.store, self.index, self.router, config, self.precise, scraper=self.scraper)
        # Peer replicas share their decisions (epp/replicas); without peers nothing listens.
        self.replicas = (
            ReplicaSync(config, self.store, self.index, self.scheduler, self.router, self.metrics)
            if config.replicas.peers
            else None
        )
        self.discovery: Discovery | None = None
        # With discovery.leader_election: this replica's bid for the Lease (start()).
        self.leader: LeaderElector | None = None
        self._watch_metrics()
        self.health = HealthState(leader_election=config.discovery.leader_election)
        self.grpc_port = 0
        self.grpc_health_port = 0  # the health-only server's (server.grpc_health_port)
        self.metrics_port = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._web_runner: web.AppRunner | None = None
        self._debug_runner: web.AppRunner | None = None
        self.debug_address: str | None = None  # host:port of the debug pages (None: off)

    def _router(self) -> Router:
        config = self.config
        tokenizers = TokenizerRegistry.from_config(
            config.tokenizers, fallback=self.tokenizer or ByteEstimateTokenizer()
        )
        router = Router(
            config,
            self.store,
            self.index,
            self.scheduler,
            tokenizers,
            self.metrics,
            debug=config.log_level in ("debug", "trace"),
        )
        # Models whose tokenizer is the engine (`source: engine`); None: nothing awaits.
        router.engine_tokenizer = EngineTokenizer.from_config(
            config.tokenizers, self.store.all, self.metrics.registry
        )
        return router

    def _watch_metrics(self) -> None:
        """What /metrics reads at each scrape (docs/metrics.md), and the bounded labels."""
        config, metrics = self.config, self.metrics
        metrics.watch(self.store.all, self.index.blocks)
        metrics.watch_floor(self.store.floor_stats)
        metrics.watch_kv_events(
            self.precise.stats,
            lambda: self.precise.subscribers,
            lambda: self.index.predictions_capped,
        )
        self._stale_seen = (0, 0)  # precise stale-routing counts already exported
        # Names the operator configured keep their own label series (observability/labels.py).
        metrics.allow_labels(
            models=[*config.adapters, *config.adapters.values(), *config.flow_control.priorities]
            + [e.model for e in config.endpoints if e.model],
            adapters=config.adapters,
        )
        # The limits the alert rules compare with, and discovery's state (nothing while
        # the config lists the endpoints).
        sched = config.scheduling
        metrics.set_limits(max_queue=sched.max_queue, health_threshold=sched.health_threshold)
        metrics.watch_discovery(lambda: self.discovery.state() if self.discovery else None)

    # Set by drain(); a class default so that the wiring in __post_init__ need not know.
    _draining = False

    @property
    def ready(self) -> bool:
        """HTTP /ready: endpoints known and scraped once, not draining."""
        if self._draining or not self.leading:
            return False
        return len(self.store) > 0 and self.scraper.first_round.is_set()

    @property
    def leading(self) -> bool:
        """Without leader election, always. With it, while this replica holds the Lease
        (epp/leader.py): `ready` and `serving` need it, as the upstream EPP's readiness,
        "" and ext_proc health do. A standby still routes whatever reaches it, as
        upstream's (its ext_proc server runs outside leader election, on a datastore kept
        populated on every replica): only its health says it is not the one to use."""
        if self.leader is None:
            return not self.config.discovery.leader_election
        return self.leader.is_leader

    @property
    def serving(self) -> bool:
        """What the gRPC health names other than `liveness` answer (READY_SERVICES in
        epp/extproc/server.py): discovery delivered its first list and, if it holds pods,
        they were scraped once; the InferencePool exists; not draining. Unlike `ready`
        (HTTP /ready), a pool with no pod is serving, as the upstream EPP answers it.
        With leader election, only while this replica leads (`leading`)."""
        if self._draining or not self.leading:
            return False
        if self.discovery is not None:
            state = self.discovery.state()
            if state.last_sync_unix is None or state.pool_found is False:
                return False
        return len(self.store) == 0 or self.scraper.first_round.is_set()

    async def start(self) -> None:
        await self._start_sources()
        await self.health.set(live=True, ready=False)
        await self._start_servers()
        await self.scraper.start()
        await self.precise.start()
        self._tasks.append(asyncio.create_task(self._maintain(), name="health-refresh"))
        self._tasks.append(self.metrics.loop_lag.start())  # cancelled in stop() with the rest
        for task in self._tasks:
            task.add_done_callback(self._background_task_ended)
        server = self.config.server
        log.info(
            "epp_started",
            grpc=format_host_port(server.grpc_host, self.grpc_port),
            grpc_health=format_host_port(server.grpc_host, self.grpc_health_port),
            metrics=format_host_port(server.metrics_host, self.metrics_port),
            endpoints=len(self.store),
            weights=self.scheduler.weights,
            kernels=KERNELS,  # compiled or pure-Python hot loops (epp.kernels)
        )

    async def _start_sources(self) -> None:
        """The Lease, the endpoints (discovery's first list) and the peers' history."""
        self.discovery, self.kube_client = make_discovery(
            self.config, self.store, self.router, self.kube_client
        )
        # Before anything binds: a bad Lease name stops here.
        self.leader = make_leader_elector(self.config, self.kube_client, self.lease_timings)
        if self.leader is not None:
            await self.leader.start()
        if self.discovery is None:
            self.store.sync(self.config.endpoints)
        else:
            await self.discovery.start()
        if self.replicas is not None:
            await self.replicas.start()  # before readiness: peers' history comes in early

    async def _start_servers(self) -> None:
        """ext_proc and gRPC health, the metrics port, the debug pages."""
        server = self.config.server
        processor = ExternalProcessor(self.router, server, self.metrics)
        self.routing_streams = processor.streams  # what drain() waits on
        # Both bound before either starts: a port in use leaves no server running.
        self._grpc, self.grpc_port = build_grpc_server(processor, self.health, server)
        self._health_grpc, self.grpc_health_port = build_health_server(self.health, server)
        await self._grpc.start()
        await self._health_grpc.start()
        self._web_runner = web.AppRunner(self._web_app(), access_log=None)
        await self._web_runner.setup()
        await web.TCPSite(self._web_runner, server.metrics_host, server.metrics_port).start()
        self.metrics_port = self._web_runner.addresses[0][1]  # (host, port) of the site
        self._debug_runner, self.debug_address = await start_debug_pages(self)

    async def drain(self) -> None:
        """Stop being ready at once; keep routing until quiet or the drain timeout.

        Readiness (/ready, gRPC `readiness` and the ext_proc service) goes NOT_SERVING so
        that health-checking gateways and Kubernetes move new requests elsewhere, while
        the gRPC server keeps answering new and open streams. It ends after
        `server.drain_timeout_s`, or earlier once no routing stream has been open for
        `server.drain_quiet_s` since readiness dropped. Requests already routed do not
        depend on this process (the routing stream ends once routed); only the observer
        streams, which fail open, are cut by the stop that follows."""
        loop = asyncio.get_running_loop()
        server = self.config.server
        started = loop.time()
        self._draining = True
        await self.health.set(live=True, ready=False)
        # As upstream on SIGTERM: the Lease is given up at once, so that a standby leads
        # (and turns Ready) within a retry period while this replica drains.
        released = asyncio.ensure_future(self.leader.stop()) if self.leader else None
        log.info("epp_draining", timeout_s=server.drain_timeout_s, quiet_s=server.drain_quiet_s)
        streams = self.routing_streams
        while (elapsed := loop.time() - started) < server.drain_timeout_s:
            if min(streams.quiet_for(), elapsed) >= server.drain_quiet_s:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        if released is not None:
            await released
        log.info("epp_drained", after_s=round(loop.time() - started, 3), open=streams.open)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.leader is not None:
            await self.leader.stop()  # releases the Lease (once: drain() may have)
        await self.health.set(live=False, ready=False)
        if self.discovery is not None:
            await self.discovery.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            # One that ended with an exception was reported then (_background_task_ended).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.scraper.stop()
        await self.precise.close()
        await self._grpc.stop(grace_s)
        await self._health_grpc.stop(None)
        if self.router.engine_tokenizer is not None:
            await self.router.engine_tokenizer.close()  # after the last routed stream
        if self.replicas is not None:
            await self.replicas.stop()
        if self._web_runner is not None:
            await self._web_runner.cleanup()
        if self._debug_runner is not None:
            await self._debug_runner.cleanup()
        log.info("epp_stopped")

    async def _maintain(self) -> None:
        """Staleness grows with time alone; readiness follows the first scrape round."""
        was = (False, False)
        steps: tuple[tuple[str, Callable[[], None]], ...] = (
            ("health-refresh", self.store.refresh_health),  # also expires reservations
            ("queue-retry", self.router.tick),  # retry waiting requests, settle reservations
            ("precise-stale", self._check_precise_stale),
        )
        errors = self.metrics.background
        while True:
            # Each step survives the others' exceptions and its own (counted, logged at
            # most once a minute per step): this loop ends only when cancelled.
            for step, run in steps:
                try:
                    run()
                except Exception as exc:
                    errors.failed(step, exc)
            try:
                now = (self.ready, self.serving)
                if now != was:
                    await self.health.set(live=True, ready=now[1])
                    was = now  # after the set: a failed one is tried again
                    log.info("readiness_changed", ready=now[0], serving=now[1])
            except Exception as exc:
                errors.failed("readiness", exc)
            await asyncio.sleep(HEALTH_REFRESH_S)

    def _background_task_ended(self, task: asyncio.Task[None]) -> None:
        """Only stop() ends these tasks: any other end says so, in the log and the count."""
        if task.cancelled():
            return
        error = task.exception() or RuntimeError(f"background task {task.get_name()} returned")
        self.metrics.background.failed(f"task:{task.get_name()}", error)

    def _check_precise_stale(self) -> None:
        """Settle due stale-routing claims of precise pods; export what is new."""
        check = self.precise.precise
        check.poll(self.store.now())
        stale, checked = check.stale.stale, check.stale.checked
        seen_stale, seen_checked = self._stale_seen
        if stale > seen_stale:
            self.metrics.stale.stale.inc(stale - seen_stale)
        if checked > seen_checked:
            self.metrics.stale.checked.inc(checked - seen_checked)
        self._stale_seen = (stale, checked)

    def _web_app(self) -> web.Application:
        return web_app(self)

    def _endpoint_rows(self) -> list[dict[str, Any]]:
        return endpoint_rows(self.store, self.index, self.precise)

    async def run_until_stopped(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain and stop; a second signal stops at once."""
        await serve_until_signalled(self)


def main(argv: list[str]) -> int:
    try:
        args, upstream = parse_serve_args(argv)
        config = config_from_args(args, upstream)
    except FlagError as exc:
        print(f"epp serve: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"epp serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, fmt=config.log_format)
    upstream.report(log)
    if config.server.workers > 1:
        from epp.serving.workers import WorkersError, run_workers

        try:
            return run_workers(config)  # worker processes, each serve_config (below)
        except WorkersError as exc:
            print(f"epp serve: invalid configuration: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # a port taken
            log.error("epp_failed", error=str(exc))
            return 1
    return serve_config(config)


def serve_config(config: EppConfig) -> int:
    """One EPP process serving `config` until told to stop (`epp serve`, or a worker)."""
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is optional on some platforms
        runner = asyncio.run
    try:
        runner(EppService(config).run_until_stopped())
    except (OSError, TlsError, SecretError, LeaderElectionError) as exc:
        # A port taken, a file that cannot serve, no Lease name.
        log.error("epp_failed", error=str(exc))
        return 1
    return 0
