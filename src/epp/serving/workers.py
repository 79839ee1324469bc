"""`epp serve` with `server.workers` > 1: N EPP worker processes on one node, one port.

Why: one EPP process routes on one core (asyncio, the GIL). Workers multiply the decisions
a node makes per second without another Service, another Envoy cluster or another config.

One port: every worker binds `server.grpc_port` and `server.grpc_health_port` with
SO_REUSEPORT (epp/extproc/server.py: only when workers > 1; one process keeps the loud
failure of a port in use). The kernel hands each new connection to one worker, so the
gateway's config, the Service and the chart's probes stay as they are. The balance is per
connection: Envoy opens one HTTP/2 connection per worker thread (and per TLS/plaintext
cluster), so a gateway with few threads can put most streams on one worker
(docs/benchmarks/workers.md measures it with the real Envoy). Envoy balancing over N local
ports would balance per stream, but every gateway config and the chart's Service would
have to list N ports; the one port is what every gateway already dials.

The clash check kept: before spawning, the supervisor binds both ports itself without
SO_REUSEPORT, so a port another process holds (an EPP with or without workers) still
fails `epp serve` at start, in one line.

Sharing: the workers are each other's peers (epp/replicas) over loopback, on ports the
supervisor picks, authenticated with a secret it generates for this node (a file in a
private temporary directory, removed at exit): each worker's prefix index and load view
include the decisions of the others. `server.worker_sharing: false` turns this off (for
measurement: docs/benchmarks/workers.md). Not with `replicas.peers` yet: a remote
replica would have to reach every worker's peer port.

Ports of the pages: worker i serves /metrics on the i-th port counting from
`metrics_port` that no other setting of this node takes (9090, then 9092 past the debug
pages' 9091, ...): each worker's counters stay whole (a scrape through one port would
reach a random worker); Prometheus scrapes N targets. The debug pages are worker 0's.

Lifecycle: a worker whose first start fails on its own (exit code 1 within
HEALTHY_RUN_S: a port, a file, the config) stops them all, and `epp serve` exits 1 as one
process would. A worker that exits later, or is killed, is restarted after a delay
doubling from RESTART_DELAY_S up to RESTART_DELAY_MAX_S (back to the start once a worker
ran HEALTHY_RUN_S). SIGTERM/SIGINT: each worker is told SIGTERM (each drains as one process
does), the supervisor waits for them; a second signal is passed on (they stop at once),
and after drain_timeout_s plus STOP_GRACE_S the rest are killed. Workers run in their own
process group (a terminal's Ctrl-C reaches the supervisor alone) and get SIGTERM if the
supervisor dies (Linux PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import structlog

from epp.config import EppConfig

log = structlog.get_logger("epp.workers")

RESTART_DELAY_S = 0.5
RESTART_DELAY_MAX_S = 30.0
HEALTHY_RUN_S = 10.0
STOP_GRACE_S = 5.0
POLL_S = 0.1
LOOPBACK = "127.0.0.1"


class WorkersError(ValueError):
    """A worker setup that cannot run: one line for the operator."""


def check_port_free(host: str, port: int, what: str) -> None:
    """Bind without SO_REUSEPORT: fails while any process listens on the port, with or
    without SO_REUSEPORT (what grpc would not tell once every worker sets it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise OSError(
                f"cannot listen on {host}:{port} for {what}: is the port in use? ({exc})"
            ) from None


def hold_port(host: str, port: int) -> socket.socket:
    """A socket bound to the port with SO_REUSEPORT, not listening: it takes no connection
    and keeps the port out of the ephemeral range's reach; the workers bind beside it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports free a moment ago (all held until every one is picked)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def metrics_ports(config: EppConfig) -> list[int]:
    """Worker i's /metrics port: the i-th from metrics_port that no other port setting
    of this node takes (0: each worker picks a free one, logged)."""
    server = config.server
    count = server.workers
    if server.metrics_port == 0:
        return [0] * count
    taken = {server.grpc_port, server.grpc_health_port, config.replicas.listen_port}
    if server.debug_port is not None:
        taken.add(server.debug_port)
    ports: list[int] = []
    port = server.metrics_port
    while len(ports) < count:
        if port > 65535:
            raise WorkersError(
                f"server.workers {count} from metrics_port {server.metrics_port}: past port 65535"
            )
        if port not in taken:
            ports.append(port)
        port += 1
    return ports


@dataclass(slots=True)
class WorkerPlan:
    """What the supervisor decided before spawning: each worker's configuration."""

    configs: list[EppConfig]
    secret_dir: Path | None = None
    # The shared ports, bound (not listening) with SO_REUSEPORT while the workers run: an
    # outgoing connection's ephemeral port cannot take one between a worker's restarts.
    held: list[socket.socket] = field(default_factory=list)

    def close(self) -> None:
        for sock in self.held:
            sock.close()
        self.held.clear()
        if self.secret_dir is not None:
            shutil.rmtree(self.secret_dir, ignore_errors=True)
            self.secret_dir = None


def plan_workers(config: EppConfig) -> WorkerPlan:
    """Each worker's configuration: the shared ports made concrete (0 picks one free port
    for all), the clash checked, metrics ports, debug pages on worker 0, loopback peers
    with a secret generated for this node."""
    server = config.server
    count = server.workers
    if count < 2:
        raise WorkersError("server.workers below 2 needs no supervisor")
    if config.replicas.peers:
        raise WorkersError(
            "server.workers > 1 with replicas.peers is not supported: remote replicas would "
            "need every worker's peer port; run one worker per replica, or no peers"
        )
    grpc_port, health_port = server.grpc_port, server.grpc_health_port
    if grpc_port == 0 or health_port == 0:
        picked = free_ports(2, server.grpc_host)
        grpc_port = grpc_port or picked[0]
        health_port = health_port or picked[1]
    check_port_free(server.grpc_host, grpc_port, "ext_proc (server.grpc_port)")
    check_port_free(server.grpc_host, health_port, "gRPC health (server.grpc_health_port)")
    held = [hold_port(server.grpc_host, grpc_port), hold_port(server.grpc_host, health_port)]
    shared = config.model_copy(
        update={
            "server": server.model_copy(
                update={"grpc_port": grpc_port, "grpc_health_port": health_port}
            )
        }
    )
    pages = metrics_ports(shared)
    plan = WorkerPlan(configs=[], held=held)
    peer_ports: list[int] = []
    secret_file: Path | None = None
    if server.worker_sharing:
        plan.secret_dir = Path(tempfile.mkdtemp(prefix="epp-workers-"))  # mode 0700
        secret_file = plan.secret_dir / "secret"
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        # Not a port planned for a worker's pages (both may come from the ephemeral range).
        peer_ports = [p for p in free_ports(count + len(pages)) if p not in pages][:count]
    for index in range(count):
        server_i = shared.server.model_copy(
            update={
                "metrics_port": pages[index],
                "debug_port": shared.server.debug_port if index == 0 else None,
            }
        )
        update: dict[str, Any] = {"server": server_i}
        if secret_file is not None:
            update["replicas"] = shared.replicas.model_copy(
                update={
                    "peers": [f"{LOOPBACK}:{p}" for j, p in enumerate(peer_ports) if j != index],
                    "listen_host": LOOPBACK,
                    "listen_port": peer_ports[index],
                    "secret_file": secret_file,
                }
            )
        plan.configs.append(shared.model_copy(update=update))
    return plan


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this worker when the supervisor dies (Linux); elsewhere, nothing."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # died before the prctl
        os._exit(0)


def worker_main(index: int, config: EppConfig, parent: int) -> None:
    """One worker process: the whole EPP (`epp.app.EppService`) on its configuration."""
    os.setpgid(0, 0)
    _die_with_parent(parent)
    from epp.app import serve_config
    from epp.observability.logs import configure_logging

    configure_logging(config.log_level, fmt=config.log_format, fields={"worker": index})
    raise SystemExit(serve_config(config))


@dataclass(slots=True)
class _Worker:
    index: int
    config: EppConfig
    process: BaseProcess | None = None
    started: float = 0.0
    delay_s: float = RESTART_DELAY_S
    restart_at: float | None = None
    restarts: int = 0


@dataclass
class WorkerSupervisor:
    """Spawns the planned workers, restarts those that exit, drains all on SIGTERM."""

    plan: WorkerPlan
    restart_delay_s: float = RESTART_DELAY_S
    restart_delay_max_s: float = RESTART_DELAY_MAX_S
    _workers: list[_Worker] = field(default_factory=list)
    _signals: int = 0
    _failed: bool = False

    def __post_init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")  # no inherited loop or threads
        self._workers = [
            _Worker(i, config, delay_s=self.restart_delay_s)
            for i, config in enumerate(self.plan.configs)
        ]

    def _spawn(self, worker: _Worker) -> None:
        process = self._context.Process(
            target=worker_main,
            args=(worker.index, worker.config, os.getpid()),
            name=f"epp-worker-{worker.index}",
        )
        process.start()
        worker.process, worker.started, worker.restart_at = process, time.monotonic(), None
        log.info(
            "worker_started",
            worker=worker.index,
            pid=process.pid,
            metrics_port=worker.config.server.metrics_port,
            restarts=worker.restarts,
        )

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals += 1
        for worker in self._workers:
            if worker.process is not None and worker.process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGTERM)

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            server = self.plan.configs[0].server
            log.info(
                "workers_starting",
                workers=len(self._workers),
                grpc_port=server.grpc_port,
                grpc_health_port=server.grpc_health_port,
                metrics_ports=[w.config.server.metrics_port for w in self._workers],
                sharing=server.worker_sharing,
            )
            for worker in self._workers:
                self._spawn(worker)
            while not self._signals:
                self._supervise()
            stopped = self._stop(server.drain_timeout_s + STOP_GRACE_S)
            return 1 if self._failed else stopped
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.plan.close()

    def _supervise(self) -> None:
        """One round: wait for an exit (or POLL_S), restart what is due."""
        alive = [w.process.sentinel for w in self._workers if w.process is not None]
        wait(alive, timeout=POLL_S)
        now = time.monotonic()
        for worker in self._workers:
            process = worker.process
            if process is not None and process.exitcode is not None and not self._signals:
                ran = now - worker.started
                if worker.restarts == 0 and process.exitcode > 0 and ran < HEALTHY_RUN_S:
                    # Its first start failed on its own (a port, a file, the config):
                    # as one process would, exit 1 rather than retry what will fail again.
                    log.error(
                        "worker_failed_at_start", worker=worker.index, exit_code=process.exitcode
                    )
                    self._failed = True
                    self._on_signal(signal.SIGTERM, None)
                    return
                if ran >= HEALTHY_RUN_S:
                    worker.delay_s = self.restart_delay_s
                worker.restart_at = now + worker.delay_s
                log.warning(
                    "worker_exited",
                    worker=worker.index,
                    exit_code=process.exitcode,
                    ran_s=round(ran, 3),
                    restart_in_s=worker.delay_s,
                )
                worker.delay_s = min(worker.delay_s * 2, self.restart_delay_max_s)
                process.close()
                worker.process = None
            if (
                worker.process is None
                and worker.restart_at is not None
                and now >= worker.restart_at
            ):
                if self._signals:
                    continue
                worker.restarts += 1
                self._spawn(worker)

    def _stop(self, timeout_s: float) -> int:
        """Wait for every worker to drain and exit; kill what is left after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        running = [w.process for w in self._workers if w.process is not None]
        while running and time.monotonic() < deadline:
            wait([p.sentinel for p in running], timeout=POLL_S)
            running = [p for p in running if p.exitcode is None]
        for process in running:
            log.warning("worker_killed", pid=process.pid, after_s=timeout_s)
            process.kill()
            process.join()
        log.info("workers_stopped", killed=len(running))
        return 1 if running else 0  # a worker that did not drain in time says so


def run_workers(config: EppConfig) -> int:
    """`epp serve` with workers > 1: plan (one-line errors raise), supervise until told."""
    plan = plan_workers(config)
    return WorkerSupervisor(plan).run()
