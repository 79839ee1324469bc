"""`epp bench workers`: one `epp serve --workers N` behind one real Envoy, one port.

Each scene starts fresh simulated pods (vllm_sim), one EPP (`epp serve --workers N`, its
workers sharing grpc_port through SO_REUSEPORT) and a real Envoy from `epp envoy-config
--epp-port` (`--concurrency` worker threads, so that many HTTP/2 connections to the EPP):

- **throughput**: zero-time pods, a 512-word completion, a closed loop at
  `--concurrency` clients after a warm-up: requests/s through Envoy, the workers' CPU per
  decision (from /proc, all workers summed), decisions per EPP CPU-second, and how the
  decisions split over the workers (each worker's own /metrics: the kernel balances per
  connection, so this is the balance the real Envoy gets).
- **quality**: the demo's multi-turn, shared-system-prompt chat workload
  (epp_demo.workload, the pods of `epp bench replicas`): the pods' prefix-cache hit rate,
  TTFT, and the split; for 1 worker, 2 workers sharing their decisions, 2 not sharing
  (`server.worker_sharing: false`).

    .venv/bin/epp bench workers --out docs/benchmarks/workers.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from epp.envoy_config import render
from epp_bench.picker.overhead import ZERO_TIME_PODS, _cpu_seconds, _drive, _words
from epp_bench.picker.replicas import MODEL, SIM_ARGS, PodStack, _get, _Proc, _wait
from epp_demo.client import run_workload, scrape_pod_metrics
from epp_demo.workload import WorkloadSpec, generate
from epp_harness.stack import HOST, free_ports
from epp_harness.stats import percentile, prefix_hit_rate


def _consecutive_free(count: int, taken: set[int]) -> int:
    """A base port with `count` free ports from it (worker i's metrics on base + i), none
    of them in `taken`, below Linux's ephemeral range (32768-): an outgoing connection's
    source port cannot take one before the worker binds it."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000)
        if base + count > 65535 or taken & set(range(base, base + count)):
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sock.bind((HOST, port))
                sockets.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


def worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes, from /proc (not multiprocessing's resource
    tracker, its other child)."""
    children: list[int] = []
    for task in Path(f"/proc/{supervisor}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    children.append(int(pid))
    return sorted(children)


def metric_total(page: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name + "{" if labels else name + " ") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class WorkersStack(PodStack):
    """Pods, one `epp serve --workers N` and one Envoy on 127.0.0.1; stopped on exit."""

    def __init__(
        self,
        work: Path,
        pods: int,
        workers: int,
        *,
        sharing: bool = True,
        sim_args: tuple[str, ...] = SIM_ARGS,
        envoy_threads: int = 2,
        log_level: str = "warning",  # the EPP's: "info" logs each decision
    ) -> None:
        super().__init__(work, pods, sim_args)
        self.workers, self.sharing, self.envoy_threads = workers, sharing, envoy_threads
        self.log_level = log_level
        self.metrics_ports: list[int] = []
        self.epp: _Proc | None = None
        self.grpc_port = 0

    def _start(self) -> None:
        self._start_pods()
        self.start_epp()
        self._start_envoy()

    def start_epp(self) -> None:
        config = self.work / "epp.yaml"
        server = {"debug_port": None, "worker_sharing": self.sharing}
        config.write_text(yaml.safe_dump({"server": server}))
        self.grpc_port = _consecutive_free(1, set())
        health = _consecutive_free(1, {self.grpc_port})
        base = _consecutive_free(self.workers, {self.grpc_port, health})
        self.metrics_ports = [base + i for i in range(self.workers)]
        argv = [
            sys.executable, "-m", "epp", "serve",
            "--config", str(config), "--endpoints", str(self.work / "endpoints.yaml"),
            "--grpc-host", HOST, "--grpc-port", str(self.grpc_port),
            "--grpc-health-port", str(health),
            "--metrics-host", HOST, "--metrics-port", str(base),
            "--workers", str(self.workers), "--log-level", self.log_level,
        ]  # fmt: skip
        self.epp = self._spawn("epp", argv)
        for port in self.metrics_ports:
            _wait(lambda p=port: _get(f"http://{HOST}:{p}/ready")[0] == 200, f"worker on {port}")

    def _start_envoy(self) -> None:
        listen, admin = free_ports(2)
        config = render(
            mode="epp",
            listen_port=listen,
            admin_port=admin,
            epp_port=self.grpc_port,
            pods=self.pods,
        )
        self._run_envoy(config, listen, threads=self.envoy_threads)

    def worker_metric(self, name: str, labels: str = "") -> list[float]:
        """Each worker's value of `name`, from its own /metrics port."""
        return [
            metric_total(
                _get(f"http://{HOST}:{p}/metrics")[1].decode(errors="replace"), name, labels
            )
            for p in self.metrics_ports
        ]

    def decisions(self) -> list[float]:
        return self.worker_metric("epp_routing_decisions_total", 'result="routed"')

    def epp_cpu_s(self) -> float:
        """CPU seconds of the supervisor and its workers so far."""
        assert self.epp is not None
        pids = [self.epp.popen.pid, *worker_pids(self.epp.popen.pid)]
        return sum(_cpu_seconds(pid) for pid in pids)


@dataclass
class ThroughputResult:
    workers: int
    concurrency: int
    requests: int
    failed: int
    seconds: float
    requests_per_s: float
    epp_cpu_us_per_decision: float
    decisions_per_epp_cpu_s: float
    per_worker: list[float] = field(default_factory=list)


def run_throughput(
    work: Path, workers: int, concurrency: int, requests: int, envoy_threads: int
) -> ThroughputResult:
    body = json.dumps(
        {"model": MODEL, "prompt": _words(random.Random(1), 512), "max_tokens": 1}
    ).encode()
    sim_args = tuple(shlex.split(ZERO_TIME_PODS))
    with WorkersStack(work, 4, workers, sim_args=sim_args, envoy_threads=envoy_threads) as stack:
        url = f"{stack.envoy_url}/v1/completions"
        asyncio.run(_drive(url, concurrency, max(requests // 10, 50), body))  # warm-up
        decided = stack.decisions()
        cpu = stack.epp_cpu_s()
        _, failed, seconds = asyncio.run(_drive(url, concurrency, requests, body))
        cpu = stack.epp_cpu_s() - cpu
        per_worker = [a - b for a, b in zip(stack.decisions(), decided, strict=True)]
    total = sum(per_worker) or 1.0
    return ThroughputResult(
        workers=workers,
        concurrency=concurrency,
        requests=requests,
        failed=failed,
        seconds=seconds,
        requests_per_s=requests / seconds,
        epp_cpu_us_per_decision=cpu / total * 1e6,
        decisions_per_epp_cpu_s=total / cpu if cpu > 0 else 0.0,
        per_worker=per_worker,
    )


def run_balance(work: Path, envoy_threads: int, runs: int, requests: int = 256) -> list[float]:
    """The busier worker's share of `requests` decisions, over `runs` fresh stacks (each
    run: new Envoy connections, so a new draw of the kernel's per-connection hash)."""
    body = json.dumps({"model": MODEL, "prompt": _words(random.Random(2), 64), "max_tokens": 1})
    sim_args = tuple(shlex.split(ZERO_TIME_PODS))
    shares: list[float] = []
    for run in range(runs):
        with WorkersStack(
            work / f"balance-{envoy_threads}-{run}", 2, 2, sim_args=sim_args,
            envoy_threads=envoy_threads,
        ) as stack:  # fmt: skip
            before = stack.decisions()
            url = f"{stack.envoy_url}/v1/completions"
            asyncio.run(_drive(url, 32, requests, body.encode()))
            split = [a - b for a, b in zip(stack.decisions(), before, strict=True)]
        shares.append(max(split) / (sum(split) or 1.0))
    return shares


@dataclass
class QualityResult:
    name: str
    requests: int
    failed: int
    hit_rate: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    pod_switches: int
    per_worker: list[float] = field(default_factory=list)


def run_quality(
    name: str, work: Path, spec: WorkloadSpec, concurrency: int, workers: int, sharing: bool,
    envoy_threads: int,
) -> QualityResult:  # fmt: skip
    with WorkersStack(work, 4, workers, sharing=sharing, envoy_threads=envoy_threads) as stack:
        workload = generate(spec)
        urls = {f"pod-{i}": f"http://{a}/metrics" for i, a in enumerate(stack.pods)}
        before = asyncio.run(scrape_pod_metrics(urls))
        records = asyncio.run(run_workload(stack.envoy_url, workload, concurrency=concurrency))
        after = asyncio.run(scrape_pod_metrics(urls))
        per_worker = stack.decisions()
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    switches = 0
    last: dict[int, str | None] = {}
    for r in records:
        previous = last.get(r.conversation_id)
        if r.turn_index > 0 and previous is not None and r.pod != previous:
            switches += 1
        last[r.conversation_id] = r.pod
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    return QualityResult(
        name=name,
        requests=len(records),
        failed=len(records) - len(ok),
        hit_rate=prefix_hit_rate(before, after),
        ttft_p50_ms=None if p50 is None else p50 * 1000,
        ttft_p99_ms=None if p99 is None else p99 * 1000,
        pod_switches=switches,
        per_worker=per_worker,
    )


def _split(values: list[float]) -> str:
    total = sum(values) or 1.0
    return " / ".join(f"{v:.0f} ({v / total:.0%})" for v in values)


def _opt(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_page(
    throughput: list[ThroughputResult],
    quality: list[QualityResult],
    command: str,
    commit: str,
    balance: dict[int, list[float]] | None = None,
) -> str:
    lines = [
        "# `epp serve --workers N`: decisions per second and routing quality",
        "",
        f"Measured by `.venv/bin/{command}` at commit {commit}, on this 2-core machine shared",
        "with the pods, Envoy and the client (and other work): compare rows of one run.",
        "",
        "## Throughput (zero-time pods, 512-word completions, closed loop)",
        "",
        "| workers | concurrency | requests | failed | requests/s | EPP CPU per decision (us) "
        "| decisions per EPP CPU-second | decisions per worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in throughput:
        lines.append(
            f"| {t.workers} | {t.concurrency} | {t.requests} | {t.failed} | {t.requests_per_s:.0f}"
            f" | {t.epp_cpu_us_per_decision:.0f} | {t.decisions_per_epp_cpu_s:.0f}"
            f" | {_split(t.per_worker)} |"
        )
    lines += [
        "",
        "## Routing quality (the demo's multi-turn chat workload)",
        "",
        "| scene | requests | failed | pods' prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) "
        "| turns moved to another pod | decisions per worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for q in quality:
        lines.append(
            f"| {q.name} | {q.requests} | {q.failed} | {_opt(q.hit_rate, '.1%')}"
            f" | {_opt(q.ttft_p50_ms, '.0f')} | {_opt(q.ttft_p99_ms, '.0f')}"
            f" | {q.pod_switches} | {_split(q.per_worker)} |"
        )
    if balance:
        lines += [
            "",
            "## Balance over 2 workers (SO_REUSEPORT, per Envoy connection)",
            "",
            "Each run a fresh stack, 256 requests at 32 clients: the busier worker's share.",
            "",
            "| Envoy threads | runs | busier worker's share per run | runs with one worker idle |",
            "|---|---|---|---|",
        ]
        for threads, shares in balance.items():
            idle = sum(1 for share in shares if share >= 0.999)
            cells = ", ".join(f"{share:.0%}" for share in shares)
            lines.append(f"| {threads} | {len(shares)} | {cells} | {idle} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp bench workers", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="throughput: requests")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput: clients")
    parser.add_argument("--envoy-threads", type=int, default=2, help="Envoy --concurrency")
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--chat-concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument(
        "--balance-runs", type=int, default=0, help="balance: fresh stacks per Envoy thread count"
    )
    parser.add_argument(
        "--balance-threads", default="2,8", help="balance: Envoy thread counts (comma list)"
    )
    parser.add_argument("--work-dir", type=Path, help="keep logs and configs here")
    parser.add_argument("--out", type=Path, help="write the markdown page here")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as cleanup:
        work = args.work_dir or Path(
            cleanup.enter_context(tempfile.TemporaryDirectory(prefix="epp-workers-"))
        )
        throughput = []
        for workers in (1, 2):
            throughput.append(
                run_throughput(
                    work / f"tput-{workers}", workers, args.concurrency, args.requests,
                    args.envoy_threads,
                )
            )  # fmt: skip
            print(f"  throughput, {workers} worker(s): done", file=sys.stderr, flush=True)
        quality = []
        if not args.skip_quality:
            spec = WorkloadSpec(seed=args.seed, conversations=args.conversations, turns=args.turns)
            for name, count, sharing in (
                ("1 worker", 1, True),
                ("2 workers, sharing", 2, True),
                ("2 workers, not sharing", 2, False),
            ):
                quality.append(
                    run_quality(
                        name, work / name.replace(" ", "-").replace(",", ""), spec,
                        args.chat_concurrency, count, sharing, args.envoy_threads,
                    )
                )  # fmt: skip
                print(f"  quality, {name}: done", file=sys.stderr, flush=True)
        balance = {
            int(threads): run_balance(work, int(threads), args.balance_runs)
            for threads in args.balance_threads.split(",")
            if args.balance_runs > 0
        }
    command = (
        f"epp bench workers --balance-runs {args.balance_runs}"
        f" --balance-threads {args.balance_threads} --requests {args.requests} --concurrency {args.concurrency}"
        f" --envoy-threads {args.envoy_threads} --conversations {args.conversations}"
        f" --turns {args.turns} --chat-concurrency {args.chat_concurrency} --seed {args.seed}"
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    page = render_page(throughput, quality, command, commit or "unknown", balance)
    print(page)
    if args.out is not None:
        args.out.write_text(page)
    return 0
