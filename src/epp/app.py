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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog
from aiohttp import web

from epp.addresses import format_host_port
from epp.config import EppConfig, load_config, load_endpoints_file
from epp.datalayer.discovery.file import EndpointsFileWatcher
from epp.datalayer.discovery.state import DiscoveryState
from epp.datalayer.kv_events_wiring import PreciseMode
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.store import EndpointStore
from epp.extproc.server import (
    ExternalProcessor,
    HealthState,
    build_grpc_server,
    build_health_server,
)
from epp.leader import LeaderElectionError, LeaderElector, LeaseTimings
from epp.observability.debug_pages import debug_routes, is_loopback
from epp.observability.logs import configure_logging
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.replicas import ReplicaSync
from epp.replicas.auth import SecretError
from epp.routing import Router
from epp.scheduling.registry import ScorerRegistry
from epp.scheduling.scheduler import Scheduler
from epp.tls import TlsError
from epp.tokenization import TokenizerRegistry
from epp.tokenization.engine import EngineTokenizer
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.protocol import Tokenizer
from epp.upstream_flags import FlagError, UpstreamArgs, read_config_source, translate
from epp.wiring import connect

log = structlog.get_logger("epp.app")


class Discovery(Protocol):
    """KubernetesDiscovery or EndpointsFileWatcher."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def state(self) -> DiscoveryState: ...


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
        self.router = Router(
            config,
            self.store,
            self.index,
            self.scheduler,
            TokenizerRegistry.from_config(
                config.tokenizers, fallback=self.tokenizer or ByteEstimateTokenizer()
            ),
            self.metrics,
            debug=config.log_level in ("debug", "trace"),
        )
        # Models whose tokenizer is the engine (`source: engine`); None: nothing awaits.
        self.router.engine_tokenizer = EngineTokenizer.from_config(
            config.tokenizers, self.store.all, self.metrics.registry
        )
        self.scraper = MetricsScraper(self.store, config.datalayer)
        connect(self.store, self.index, self.router, config, self.precise, scraper=self.scraper)
        # Peer replicas share their decisions (epp/replicas); without peers nothing listens.
        self.replicas = (
            ReplicaSync(config, self.store, self.index, self.scheduler, self.router, self.metrics)
            if config.replicas.peers
            else None
        )
        self.metrics.watch(self.store.all, self.index.blocks)
        self.metrics.watch_floor(self.store.floor_stats)
        self.metrics.watch_kv_events(
            self.precise.stats,
            lambda: self.precise.subscribers,
            lambda: self.index.predictions_capped,
        )
        self._stale_seen = (0, 0)  # precise stale-routing counts already exported
        # Names the operator configured keep their own label series (observability/labels.py).
        self.metrics.allow_labels(
            models=[*config.adapters, *config.adapters.values(), *config.flow_control.priorities]
            + [e.model for e in config.endpoints if e.model],
            adapters=config.adapters,
        )
        self.discovery: Discovery | None = None
        # With discovery.leader_election: this replica's bid for the Lease (start()).
        self.leader: LeaderElector | None = None
        # Observability (docs/metrics.md): the limits the alert rules compare with, and
        # discovery's state read at each scrape (nothing while the config lists endpoints).
        sched = config.scheduling
        self.metrics.set_limits(max_queue=sched.max_queue, health_threshold=sched.health_threshold)
        self.metrics.watch_discovery(lambda: self.discovery.state() if self.discovery else None)
        self.health = HealthState(leader_election=config.discovery.leader_election)
        self.grpc_port = 0
        self.grpc_health_port = 0  # the health-only server's (server.grpc_health_port)
        self.metrics_port = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._web_runner: web.AppRunner | None = None
        self._debug_runner: web.AppRunner | None = None
        self.debug_address: str | None = None  # host:port of the debug pages (None: off)

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

    def _discovery(self) -> Discovery | None:
        """Where endpoints come from; None: the static list in the config, fixed."""
        config = self.config.discovery
        if config.pool_name or config.endpoint_selector:
            # Imported here: the Kubernetes client loads only when a pool is configured.
            from epp.datalayer.discovery.kubernetes import (
                KubernetesDiscovery,
                default_namespace,
                make_api_client,
            )

            client = self.kube_client
            if client is None:
                client = make_api_client(str(config.kubeconfig) if config.kubeconfig else None)
                self.kube_client = client  # leader election's too
            from epp.datalayer.discovery.pool import MetricsLocation, standalone_pool

            standalone = None
            if config.endpoint_selector:
                standalone = standalone_pool(
                    "standalone", config.endpoint_selector, config.target_ports
                )
            return KubernetesDiscovery(
                client,
                config.pool_name or "standalone",
                config.pool_namespace or default_namespace(),
                on_endpoints=self.store.sync,
                on_models=self.router.set_model_table,
                read_models=config.read_models,
                pool_group=config.pool_group,
                standalone=standalone,
                metrics=MetricsLocation(
                    self.config.datalayer.metrics_scheme,
                    self.config.datalayer.metrics_port,
                    self.config.datalayer.metrics_path,
                ),
            )
        if self.config.endpoints_file is not None:
            return EndpointsFileWatcher(
                self.config.endpoints_file,
                self.store.sync,
                static=self.config.endpoints,
                interval_s=config.file_poll_s,
            )
        return None

    def _leader_elector(self) -> LeaderElector | None:
        """With discovery.leader_election: a bid for the Lease in the pool's namespace,
        named as upstream names it, on discovery's API client."""
        config = self.config.discovery
        if not config.leader_election:
            return None
        from epp.datalayer.discovery.kubernetes import default_namespace
        from epp.leader import KubernetesLeases, holder_identity, lease_name

        namespace = config.pool_namespace or default_namespace()
        pod = os.environ.get("POD_NAME") or socket.gethostname()  # a Pod's host name is its name
        name = config.leader_election_lease or lease_name(namespace, config.pool_name, pod)
        return LeaderElector(
            KubernetesLeases(self.kube_client),
            namespace,
            name,
            holder_identity(pod),
            timings=self.lease_timings,
        )

    async def start(self) -> None:
        self.discovery = self._discovery()
        self.leader = self._leader_elector()  # before anything binds: a bad name stops here
        if self.leader is not None:
            await self.leader.start()
        if self.discovery is None:
            self.store.sync(self.config.endpoints)
        else:
            await self.discovery.start()
        if self.replicas is not None:
            await self.replicas.start()  # before readiness: peers' history comes in early
        await self.health.set(live=True, ready=False)
        processor = ExternalProcessor(self.router, self.config.server, self.metrics)
        self.routing_streams = processor.streams  # what drain() waits on
        # Both bound before either starts: a port in use leaves no server running.
        self._grpc, self.grpc_port = build_grpc_server(processor, self.health, self.config.server)
        self._health_grpc, self.grpc_health_port = build_health_server(
            self.health, self.config.server
        )
        await self._grpc.start()
        await self._health_grpc.start()
        self._web_runner = web.AppRunner(self._web_app(), access_log=None)
        await self._web_runner.setup()
        site = web.TCPSite(
            self._web_runner, self.config.server.metrics_host, self.config.server.metrics_port
        )
        await site.start()
        self.metrics_port = self._web_runner.addresses[0][1]  # (host, port) of the site
        await self._start_debug_pages()
        await self.scraper.start()
        await self.precise.start()
        self._tasks.append(asyncio.create_task(self._maintain(), name="health-refresh"))
        self._tasks.append(self.metrics.loop_lag.start())  # cancelled in stop() with the rest
        for task in self._tasks:
            task.add_done_callback(self._background_task_ended)
        log.info(
            "epp_started",
            grpc=format_host_port(self.config.server.grpc_host, self.grpc_port),
            grpc_health=format_host_port(self.config.server.grpc_host, self.grpc_health_port),
            metrics=format_host_port(self.config.server.metrics_host, self.metrics_port),
            endpoints=len(self.store),
            weights=self.scheduler.weights,
        )

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
        app = web.Application()

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.metrics.exposition(), content_type="text/plain")

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def ready(_: web.Request) -> web.Response:
            return web.Response(
                text="ready" if self.ready else "not ready", status=200 if self.ready else 503
            )

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/ready", ready)
        if self.config.server.debug_port is not None and self._debug_shares_metrics():
            app.add_routes(self._debug_routes())
        return app

    def _debug_shares_metrics(self) -> bool:
        """A metrics port on a loopback address is as private as the debug port would be."""
        return is_loopback(self.config.server.metrics_host)

    async def _start_debug_pages(self) -> None:
        """The debug pages on a loopback address only (server.debug_host, debug_port): they
        show which pod holds which prefix, and cost routing-loop time."""
        server = self.config.server
        if server.debug_port is None:
            return
        if self._debug_shares_metrics():
            self.debug_address = format_host_port(server.metrics_host, self.metrics_port)
            return
        app = web.Application()
        app.add_routes(self._debug_routes())
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, server.debug_host, server.debug_port).start()
        except OSError as err:  # optional pages never stop the service
            await runner.cleanup()
            log.warning("debug_pages_unavailable", host=server.debug_host, error=str(err))
            return
        self._debug_runner = runner
        port = runner.addresses[0][1]
        self.debug_address = format_host_port(server.debug_host, port)
        if is_loopback(server.debug_host):
            log.info("debug_pages", address=self.debug_address)
        else:
            log.warning("debug_pages_exposed", address=self.debug_address)

    def _debug_routes(self) -> list[web.RouteDef]:
        def pod_index(pod: str) -> dict[str, Any]:
            return {
                "mode": self.precise.mode_of(pod),
                "blocks": self.index.blocks(pod),
                "capacity": self.index.capacity(pod),
            }

        return debug_routes(
            self._endpoint_rows, self.index.pods, pod_index, self.index.engine_block_slices
        )

    def _endpoint_rows(self) -> list[dict[str, Any]]:
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
                "prefix_blocks": self.index.blocks(e.name),
                "index_mode": self.precise.mode_of(e.name),
                "kv_events": self._kv_events_state(e.name),
                "scrape_failures": e.consecutive_failures,
                # The server process's start time (process_start_time_seconds):
                # a later one is a restart (entries dropped, then resynced).
                "start_time": e.metrics.start_time if e.metrics else None,
                "last_error": e.last_error,
            }
            for e in self.store.all()
        ]

    def _kv_events_state(self, pod: str) -> dict[str, Any] | None:
        sub = self.precise.subscriber(pod)
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

    async def run_until_stopped(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain and stop; a second signal stops at once."""
        signals = 0
        stop, hurry = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            (stop if signals == 1 else hurry).set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        fallbacks = self.config.scheduling.fallbacks
        if fallbacks > 0:
            # The EPP cannot see the gateway's config: say once what a list needs.
            log.warning(
                "fallback_list_needs_override_host",
                fallbacks=fallbacks,
                detail="the destination is a comma list; only a gateway that walks it "
                "(Envoy override_host) serves it, an ORIGINAL_DST cluster answers 503",
            )
        await self.start()
        try:
            await stop.wait()
            drain = asyncio.ensure_future(self.drain())
            hurried = asyncio.ensure_future(hurry.wait())
            await asyncio.wait({drain, hurried}, return_when=asyncio.FIRST_COMPLETED)
            for task in (drain, hurried):
                task.cancel()
        finally:
            # Short grace: routing streams still open finish; observers are cut (fail-open).
            await self.stop(grace_s=1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp serve",
        description="Serve the endpoint picker: Envoy ext_proc over gRPC, Prometheus metrics over HTTP.",
        epilog="The upstream EPP's flags (GIE, llm-d router: -poolName, --pool-group, -v 4, "
        "--zap-encoder, --config-file, --secure-serving, --tracing, ...) are accepted in Go's "
        "flag syntax: the supported ones are mapped, the others named in one warning "
        '(README, "epp serve flags").',
        allow_abbrev=False,  # a prefix of a flag is not that flag: upstream's never are
    )
    parser.add_argument("--config", type=Path, help="YAML configuration (see README)")
    parser.add_argument(
        "--endpoints", type=Path, help="static discovery file: endpoints: [...] (watched)"
    )
    parser.add_argument(
        "--pool-name", help="Kubernetes discovery: the InferencePool whose pods to route to"
    )
    parser.add_argument(
        "--pool-namespace", help="the pool's namespace (default: the EPP pod's own)"
    )
    parser.add_argument(
        "--kubeconfig", type=Path, help="outside a cluster: the kubeconfig (default: $KUBECONFIG)"
    )
    parser.add_argument("--grpc-host")
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument(
        "--grpc-health-port", type=int, help="gRPC health, plaintext (default 9003; 0: any free)"
    )
    parser.add_argument("--metrics-host")
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument(
        "--plaintext",
        action="store_true",
        default=None,
        help="serve the gRPC port without TLS (server.secure_serving: false); the default is "
        "TLS, with a self-signed certificate unless server.tls gives one",
    )
    parser.add_argument(
        "--log-level",
        choices=["trace", "debug", "info", "warning", "error"],
        help="default: info, or EPP_LOG_LEVEL",
    )
    return parser


def our_flag_names(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The parser's long flags without their dashes (what `translate` passes through)."""
    return frozenset(
        opt[2:] for action in parser._actions for opt in action.option_strings if opt[:2] == "--"
    )


def parse_serve_args(argv: list[str]) -> tuple[argparse.Namespace, UpstreamArgs]:
    """`epp serve`'s arguments: ours, and the upstream EPP's (epp/upstream_flags/).
    Raises FlagError for a malformed upstream flag; argparse exits on anything unknown."""
    parser = build_parser()
    upstream = translate(argv, our_flag_names(parser))
    return parser.parse_args(upstream.ours), upstream


def _merged(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (the config's sections are mappings)."""
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for section, values in top.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


def config_from_args(args: argparse.Namespace, upstream: UpstreamArgs | None = None) -> EppConfig:
    """The configuration: the file (--config, or an upstream --config-file/--config-text in
    our format), then the upstream flags, then ours; EPP_LOG_LEVEL when no flag sets it."""
    upstream = upstream or UpstreamArgs()
    server = {
        key: value
        for key, value in (
            ("grpc_host", args.grpc_host),
            ("grpc_port", args.grpc_port),
            ("grpc_health_port", args.grpc_health_port),
            ("metrics_host", args.metrics_host),
            ("metrics_port", args.metrics_port),
        )
        if value is not None
    }
    if args.plaintext:
        server["secure_serving"] = False
    ours: dict = {"server": server} if server else {}
    level = args.log_level or upstream.log_level or os.environ.get("EPP_LOG_LEVEL")
    if level:
        ours["log_level"] = level
    if upstream.log_format:
        ours["log_format"] = upstream.log_format
    discovery = {
        key: value
        for key, value in (
            ("pool_name", args.pool_name),
            ("pool_namespace", args.pool_namespace),
            ("kubeconfig", args.kubeconfig),
        )
        if value is not None
    }
    if discovery:
        ours["discovery"] = discovery
    if args.endpoints is not None:
        ours["endpoints_file"] = args.endpoints.absolute()
    overrides = _merged(upstream.overrides, ours)
    path: Path | None = args.config
    data, upstream.unapplied_config = read_config_source(upstream)
    if data is not None:
        if args.config is not None:
            raise ValueError(
                "--config and --config-file/--config-text both give a configuration: keep one"
            )
        if upstream.config_file is None:  # --config-text: its content is the base
            overrides = _merged(data, overrides)
        path = upstream.config_file
    config = load_config(path, overrides)
    if config.endpoints_file is not None:
        load_endpoints_file(config.endpoints_file)  # a bad file fails now, with its path
    # `epp serve` has the built-in scorers only: a misspelled weight fails here, in one line.
    ScorerRegistry().check(config.scheduling)
    return config


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
