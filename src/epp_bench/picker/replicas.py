"""`epp bench replicas`: several EPP replicas behind one real Envoy.

Each scene starts fresh simulated pods, its EPP replicas (`epp serve`) and a real Envoy,
and drives the demo's multi-turn, shared-system-prompt chat workload (epp_demo.workload)
through Envoy:

- **1 replica**: the single EPP, Envoy's default config (`epp envoy-config --epp-port`);
- **2 replicas, not sharing**: two independent EPPs behind one ext_proc cluster
  (`epp envoy-config --epp-address A --epp-address B`): each one knows only the
  decisions it made;
- **2 replicas, sharing**: the same, with `replicas.peers` set: each sends its decisions
  to the other (epp/replicas).

Reported per scene: the pods' own prefix-cache hit rate, TTFT p50/p90/p99, requests per pod,
how many turns were served by another pod than the turn before them in their conversation,
and the routing decisions each replica made.

Then the failover scenes, on 2 sharing replicas under steady load (closed loop, each
client runs conversations back to back): one replica is killed (SIGKILL) or stopped
(SIGTERM, it drains) mid-run. Reported: requests that failed, when (relative to the
signal), and that traffic went on.

    .venv/bin/epp bench replicas --out docs/benchmarks/replicas.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import yaml

from epp.envoy_config import render
from epp_demo.client import run_workload, scrape_pod_metrics
from epp_demo.workload import (
    Conversation,
    Workload,
    WorkloadSpec,
    chat_request_body,
    generate,
    turn_messages,
)
from epp_harness.sse import read_stream
from epp_harness.stack import HOST, envoy_binary, free_ports, log_tail
from epp_harness.stats import percentile, prefix_hit_rate

MODEL = "sim-llama-8b"
# The demo's pods (epp_demo.cli.DEMO_SIM_ARGS): 8 running slots, 300 KV blocks each, so a
# system-prompt group split over two pods costs cache room as well as a cold prefill.
SIM_ARGS = (
    "--num-gpu-blocks", "300",
    "--max-num-seqs", "8",
    "--prefill-overhead-ms", "2",
    "--prefill-per-token-ms", "0.2",
    "--decode-per-token-ms", "2",
)  # fmt: skip
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
STARTUP_TIMEOUT_S = 30.0
# Failover scene with a hung replica (SIGSTOP): what a client waits before giving up.
HUNG_TIMEOUT_S = 5.0


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with _DIRECT.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _wait(predicate, what: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait()


@dataclass
class Replica:
    grpc_port: int
    metrics_port: int
    peer_port: int
    proc: _Proc | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    def metric(self, name: str, labels: str = "") -> float:
        _, page = _get(f"http://{HOST}:{self.metrics_port}/metrics")
        total = 0.0
        for line in page.decode(errors="replace").splitlines():
            if line.startswith(name + "{" if labels else name + " ") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


class PodStack:
    """Simulated pods (and whatever a subclass starts after them) on 127.0.0.1, each a
    process logging to `work`; everything stopped on exit, also when start-up fails."""

    def __init__(self, work: Path, pods: int, sim_args: Sequence[str] = SIM_ARGS) -> None:
        self.work = work
        self.pod_count = pods
        self.sim_args = tuple(sim_args)
        self.procs: list[_Proc] = []
        self.pods: list[str] = []
        self.envoy_url = ""

    def _run_envoy(self, config: str, listen: int, threads: int) -> None:
        """Envoy on `config` (listening on `listen`), once it routes a request."""
        path = self.work / "envoy.yaml"
        path.write_text(config)
        argv = [
            envoy_binary(), "-c", str(path), "--disable-hot-restart",
            "--concurrency", str(threads), "--log-level", "warning",
        ]  # fmt: skip
        envoy = self._spawn("envoy", argv)
        self.envoy_url = f"http://{HOST}:{listen}"
        try:
            _wait(lambda: _get(f"{self.envoy_url}/v1/models")[0] == 200, "Envoy routing")
        except RuntimeError:
            raise RuntimeError(f"Envoy did not route:\n{log_tail(envoy.log)}") from None

    def _spawn(self, name: str, argv: Sequence[str]) -> _Proc:
        log = self.work / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        proc = _Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def _start(self) -> None:
        self._start_pods()

    def _start_pods(self) -> None:
        """The pods, healthy, and `endpoints.yaml` listing them for `epp serve`."""
        self.work.mkdir(parents=True, exist_ok=True)
        for i, port in enumerate(free_ports(self.pod_count)):
            argv = [
                sys.executable, "-m", "vllm_sim", "--host", HOST, "--port", str(port),
                "--name", f"pod-{i}", "--model", MODEL, *self.sim_args,
            ]  # fmt: skip
            self._spawn(f"pod-{i}", argv)
            self.pods.append(f"{HOST}:{port}")
        for address in self.pods:
            _wait(lambda a=address: _get(f"http://{a}/health")[0] == 200, f"pod {address}")
        endpoints = [
            {"name": f"pod-{i}", "address": a, "metrics_url": f"http://{a}/metrics"}
            for i, a in enumerate(self.pods)
        ]
        (self.work / "endpoints.yaml").write_text(yaml.safe_dump({"endpoints": endpoints}))


class Stack(PodStack):
    """Pods, EPP replicas and one Envoy on 127.0.0.1; everything stopped on exit."""

    def __init__(
        self, work: Path, pods: int, replicas: int, share: bool, envoy: str = "default"
    ) -> None:
        super().__init__(work, pods)
        self.envoy_variant = envoy
        self.replica_count = replicas
        self.share = share
        self.replicas: list[Replica] = []

    def _start(self) -> None:
        self._start_pods()
        ports = free_ports(3 * self.replica_count)
        self.replicas = [
            Replica(ports[3 * i], ports[3 * i + 1], ports[3 * i + 2])
            for i in range(self.replica_count)
        ]
        for i in range(self.replica_count):
            self.start_replica(i)
        for replica in self.replicas:
            _wait(lambda r=replica: self.ready(r), f"EPP on {replica.grpc_port}")
        self._start_envoy()

    def replica_config(self, index: int) -> dict[str, Any]:
        replica = self.replicas[index]
        if not self.share:
            return {}
        peers = [f"{HOST}:{r.peer_port}" for j, r in enumerate(self.replicas) if j != index]
        return {"replicas": {"peers": peers, "listen_host": HOST, "listen_port": replica.peer_port}}

    def start_replica(self, index: int) -> None:
        replica = self.replicas[index]
        config = self.work / f"epp-{index}.yaml"
        config.write_text(yaml.safe_dump(self.replica_config(index)))
        argv = [
            sys.executable, "-m", "epp", "serve",
            "--config", str(config), "--endpoints", str(self.work / "endpoints.yaml"),
            "--grpc-host", HOST, "--grpc-port", str(replica.grpc_port),
            "--metrics-host", HOST, "--metrics-port", str(replica.metrics_port),
            "--grpc-health-port", "0",  # any free port: the replicas share one host
            "--log-level", "warning",
        ]  # fmt: skip
        replica.proc = self._spawn(f"epp-{index}", argv)

    @staticmethod
    def ready(replica: Replica) -> bool:
        return _get(f"http://{HOST}:{replica.metrics_port}/ready")[0] == 200

    def _start_envoy(self) -> None:
        listen, admin = free_ports(2)
        if self.replica_count == 1:
            config = render(
                mode="epp",
                listen_port=listen,
                admin_port=admin,
                epp_port=self.replicas[0].grpc_port,
                pods=self.pods,
            )
        else:
            config = render(
                mode="epp",
                listen_port=listen,
                admin_port=admin,
                epp_addresses=[r.address for r in self.replicas],
                pods=self.pods,
            )
            if self.envoy_variant == "bare":
                config = bare_envoy(config)
        self._run_envoy(config, listen, threads=1)
        if self.replica_count > 1:
            # gRPC readiness follows /ready within 0.25 s, so a first health check can
            # fail: start the load once Envoy sees every replica healthy.
            _wait(lambda: self._envoy_healthy(f"http://{HOST}:{admin}"), "replicas healthy")

    def _envoy_healthy(self, admin: str) -> bool:
        _, page = _get(f"{admin}/clusters")
        flags = [
            line
            for line in page.decode(errors="replace").splitlines()
            if line.startswith("epp::") and "::health_flags::" in line
        ]
        return len(flags) == self.replica_count and all(f.endswith("::healthy") for f in flags)

    def metrics_urls(self) -> dict[str, str]:
        return {f"pod-{i}": f"http://{a}/metrics" for i, a in enumerate(self.pods)}


def bare_envoy(config: str) -> str:
    """The replicas' Envoy config without what makes a death cheap: the routing stream's
    retry on another replica, outlier ejection and the raised retry limit (the health
    checks stay). For the comparison row of the failover table."""
    tree = yaml.safe_load(config)
    listener = tree["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["typed_config"]["grpc_service"].pop("retry_policy")
    for cluster in tree["static_resources"]["clusters"]:
        if cluster["name"] == "epp":
            cluster.pop("outlier_detection")
            cluster.pop("circuit_breakers")
    return yaml.safe_dump(tree, sort_keys=False)


# -- scenes (a)-(c) -----------------------------------------------------------------------
@dataclass
class SceneResult:
    name: str
    requests: int
    failed: int
    duration_s: float
    hit_rate: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    per_pod: dict[str, int]
    pod_switches: int  # turns served by another pod than their conversation's turn before
    per_replica: list[float] = field(default_factory=list)  # routing decisions made


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def run_scene(
    name: str, work: Path, spec: WorkloadSpec, concurrency: int, replicas: int, share: bool
) -> SceneResult:
    with Stack(work, 4, replicas, share) as stack:
        workload = generate(spec)
        urls = stack.metrics_urls()
        before = asyncio.run(scrape_pod_metrics(urls))
        started = time.monotonic()
        records = asyncio.run(run_workload(stack.envoy_url, workload, concurrency=concurrency))
        duration = time.monotonic() - started
        after = asyncio.run(scrape_pod_metrics(urls))
        per_replica = [
            r.metric("epp_routing_decisions_total", 'result="routed"') for r in stack.replicas
        ]
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_pod = Counter(r.pod or "?" for r in ok)
    switches = 0
    last: dict[int, str | None] = {}
    for r in records:  # sorted by conversation, then turn
        previous = last.get(r.conversation_id)
        if r.turn_index > 0 and previous is not None and r.pod != previous:
            switches += 1
        last[r.conversation_id] = r.pod
    return SceneResult(
        name=name,
        requests=len(records),
        failed=len(records) - len(ok),
        duration_s=duration,
        hit_rate=prefix_hit_rate(before, after),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p90_ms=_ms(percentile(ttfts, 90)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        per_pod=dict(sorted(per_pod.items())),
        pod_switches=switches,
        per_replica=per_replica,
    )


# -- failover -----------------------------------------------------------------------------
@dataclass
class Sent:
    start_s: float  # since the signal (negative: before it)
    status: int
    error: str | None


@dataclass
class FailoverResult:
    name: str
    signal: str
    requests: int
    failed: int
    failed_after_signal: list[float]  # start times of the failed requests, since the signal
    errors: dict[str, int]
    ok_after_signal: int  # requests sent after the signal that succeeded
    ok_last_second: int  # ... in the last second of the run: traffic went on

    @property
    def window_s(self) -> float:
        if not self.failed_after_signal:
            return 0.0
        return max(self.failed_after_signal) - min(self.failed_after_signal)


async def _steady_load(
    url: str,
    workload: Workload,
    clients: int,
    duration_s: float,
    signal_at_s: float,
    on_signal,
    request_timeout_s: float = 60.0,
) -> tuple[list[Sent], float]:
    """`clients` clients, each running conversations back to back for `duration_s`; a
    failed turn ends its conversation (the next one starts). `on_signal` runs (in a
    thread) at `signal_at_s`. Returns the requests, with times relative to the signal."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    signalled = start + signal_at_s
    sent: list[Sent] = []
    conversations = iter(workload.conversations * 1000)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    async def converse(session: aiohttp.ClientSession, conversation: Conversation) -> None:
        replies: list[str] = []
        for turn in range(len(conversation.turns)):
            if loop.time() - start > duration_s:
                return
            messages = turn_messages(workload, conversation, turn, replies)
            body = chat_request_body(workload.spec, messages)
            began = loop.time()
            status, error, reply = 0, None, None
            try:
                async with session.post(url, json=body) as response:
                    status = response.status
                    if status != 200:
                        error = f"HTTP {status}"
                    else:
                        stream = await read_stream(response.content, time.monotonic())
                        if stream.error or not stream.done:
                            error = stream.error or "stream cut"
                        else:
                            reply = stream.reply
            except TimeoutError:
                error = f"no answer in {request_timeout_s:g} s"
            except (aiohttp.ClientError, OSError) as exc:
                error = type(exc).__name__
            sent.append(Sent(began - signalled, status, error))
            if reply is None:
                return
            replies.append(reply)

    async def client(session: aiohttp.ClientSession) -> None:
        while loop.time() - start < duration_s:
            await converse(session, next(conversations))

    async def fire() -> None:
        await asyncio.sleep(signal_at_s)
        await asyncio.to_thread(on_signal)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        signal_task = asyncio.ensure_future(fire())
        await asyncio.gather(*(client(session) for _ in range(clients)))
        await signal_task
    return sent, duration_s - signal_at_s


def run_failover(
    name: str,
    work: Path,
    spec: WorkloadSpec,
    clients: int,
    sig: signal.Signals,
    duration_s: float,
    signal_at_s: float,
    envoy: str = "default",
) -> FailoverResult:
    with Stack(work, 4, 2, True, envoy) as stack:
        victim = stack.replicas[1]
        assert victim.proc is not None
        proc = victim.proc

        def on_signal() -> None:
            proc.signal(sig)

        # A hung replica's streams hang: the clients give up after a few seconds.
        hung = sig == signal.SIGSTOP
        sent, after = asyncio.run(
            _steady_load(
                f"{stack.envoy_url}/v1/chat/completions",
                generate(spec),
                clients,
                duration_s,
                signal_at_s,
                on_signal,
                request_timeout_s=HUNG_TIMEOUT_S if hung else 60.0,
            )
        )
        if hung:
            proc.signal(signal.SIGKILL)  # a stopped process would ignore SIGTERM
    failed = [s for s in sent if s.error is not None]
    errors = Counter(s.error or "" for s in failed)
    return FailoverResult(
        name=name,
        signal=sig.name,
        requests=len(sent),
        failed=len(failed),
        failed_after_signal=sorted(round(s.start_s, 3) for s in failed),
        errors=dict(errors),
        ok_after_signal=sum(1 for s in sent if s.error is None and s.start_s >= 0),
        ok_last_second=sum(1 for s in sent if s.error is None and s.start_s >= after - 1.0),
    )


# -- report -------------------------------------------------------------------------------
def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render_page(
    groups: list[list[SceneResult]],
    failovers: list[FailoverResult],
    command: str,
    commit: str,
    spec: WorkloadSpec,
    concurrency: int,
    seeds: Sequence[int],
) -> str:
    """`groups`: per scene, one result per seed (cells show them as `a / b`)."""
    lines = [
        "# Several EPP replicas behind one Envoy",
        "",
        f"_Generated by `{command}` at commit `{commit}`; 2-core machine, everything on"
        " 127.0.0.1: real Envoy 1.40 (`--concurrency 1`), `epp serve` replicas with default"
        " settings (`replicas.peers` when sharing), 4 fresh simulated pods per scene"
        " (`epp sim`, the demo's: 8 running slots, 300 KV blocks of 16 tokens)._",
        "",
        f"Workload: the demo's chat ({spec.conversations} conversations x {spec.turns} turns,"
        f" {spec.system_prompts} shared system prompts of {spec.system_prompt_tokens} tokens,"
        f" streaming, {concurrency} conversations at once, seeds"
        f" {' and '.join(str(x) for x in seeds)}: each cell reads `seed {seeds[0]}"
        + "".join(f" / seed {x}" for x in seeds[1:])
        + "`; the failover scenes use the first). Each turn"
        " resends the whole history, so the pod that served turn k holds most of turn k+1.",
        "",
        "## The design, in short",
        "",
        "Envoy balances ext_proc streams over the replicas (least request), so the turns"
        " of one conversation reach different replicas. A replica that knows only its own"
        " decisions finds no prefix for a turn another replica routed, and counts only its"
        " own share of each pod's load between scrapes: that is why the field runs one"
        " replica. Here each replica sends every decision to its peers (`epp/replicas`:"
        " the pod, the block hashes it recorded, the prompt's size and match, the uncached"
        " tokens, the time; msgpack frames over one TCP connection per peer). The receiver"
        " records the hashes for that pod in its prefix index, counts the dispatch in the"
        " pod's load until a page scraped after its arrival shows it, and grows the pod's"
        " prefill lane. Response ends seen by another replica's observer stream are"
        " forwarded to the replica that routed the request (Envoy balances the observer"
        " stream apart from the routing stream). Routing never waits on a peer: frames are"
        " queued, and a slow or absent peer loses the oldest. A replica seen for the first"
        " time (a new or restarted one) gets the last `replicas.history` (4,096) decisions"
        " first. Receiving a decision costs about 28 us (117 blocks, in process), against"
        " some 300-500 us for the decision itself.",
        "",
        "## Hit rate and TTFT: 1 replica, 2 without sharing, 2 sharing",
        "",
        "| | " + " | ".join(g[0].name for g in groups) + " |",
        "|---|" + "---:|" * len(groups),
    ]

    def row(label: str, cell) -> None:
        cells = [" / ".join(cell(s) for s in group) for group in groups]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("requests failed", lambda s: str(s.failed))
    row(
        "prefix cache hit rate (pods)",
        lambda s: "-" if s.hit_rate is None else f"{s.hit_rate * 100:.1f}%",
    )
    row("TTFT p50 (ms)", lambda s: _fmt_ms(s.ttft_p50_ms))
    row("TTFT p90 (ms)", lambda s: _fmt_ms(s.ttft_p90_ms))
    row("TTFT p99 (ms)", lambda s: _fmt_ms(s.ttft_p99_ms))
    row("wall time (s)", lambda s: f"{s.duration_s:.1f}")
    row("turns on another pod than the turn before", lambda s: str(s.pod_switches))
    row(
        "decisions per replica",
        lambda s: "+".join(f"{n:.0f}" for n in s.per_replica),
    )
    pods = sorted({p for g in groups for s in g for p in s.per_pod})
    for pod in pods:
        row(f"requests on {pod}", lambda s, pod=pod: str(s.per_pod.get(pod, 0)))
    lines += [
        "",
        "- **Hit rate**: the pods' own counters, the increase of"
        " `vllm:prefix_cache_hits_total` over that of `vllm:prefix_cache_queries_total`,"
        " summed over the pods.",
        "- **Turns on another pod**: a turn whose conversation's previous turn was served by"
        " a different pod (it finds its history cold). With sharing a few can remain: two"
        " replicas placing new prompts within the same millisecond (see Limits), or load"
        " moving a conversation, as it can with one replica.",
        '- **Decisions per replica**: `epp_routing_decisions_total{result="routed"}` of'
        " each replica; Envoy balances routing streams over the replicas (least request).",
        "",
        "## A replica dies under load",
        "",
        "Two sharing replicas behind the Envoy config of `epp envoy-config --epp-address A"
        " --epp-address B`, steady load (each client runs conversations back to back,"
        " streaming; a failed turn ends its conversation). One replica gets the signal"
        " halfway through. The row *without retry and ejection* is the same config with the"
        " routing stream's `retry_policy`, the outlier ejection and the raised retry limit"
        " removed (health checks kept).",
        "",
        "What the generated config does when a replica dies, and why:",
        "",
        "- the routing filter's gRPC stream has a `retry_policy` (connect-failure,"
        " refused-stream, reset, unavailable; another host each time): a stream that"
        " cannot start on the dead replica starts on the other;",
        "- outlier detection ejects a replica at its first gateway failure (its"
        " enforcement defaults to 0%, so it must be set), before the next health check:"
        " least request would otherwise keep choosing the dead replica, which has no"
        " open streams;",
        "- Envoy's default of 3 retries in flight per cluster is raised: the streams beyond"
        " it failed;",
        "- gRPC health checks of `readiness` every 0.5 s take a dead or draining replica"
        " out, and a restarted one back in; no panic mode (by default Envoy balances over"
        " every host, the dead included, once half of them are unhealthy).",
        "",
        "What can still fail: a request whose routing answer was being written at the"
        " instant of the kill. Envoy retries a stream only before its first answer, and"
        " in `FULL_DUPLEX_STREAMED` the answer is the destination followed by the body, so a"
        " kill between the two costs that request (HTTP 500). The end-to-end test"
        " (`tests/e2e/test_replicas_e2e.py`: 4 clients on fast pods, SIGKILL of one of 2"
        " replicas) allows one such failure per kill. While this was written it saw one in"
        " 2 of 9 runs with 20 ms between a client's requests (about 150 requests/s), none"
        " in 12 runs with 50 ms (its setting). SIGTERM drains: readiness goes"
        " NOT_SERVING at once, the health check takes the replica out within 0.5 s, and the"
        " replica keeps routing what still comes until quiet.",
        "",
        "A hung replica (SIGSTOP: alive, answering nothing) is worse than a dead one: the"
        " requests Envoy sends it before a health check times out (0.25 s, every 0.5 s)"
        f" hang. In `FULL_DUPLEX_STREAMED` neither a retry nor the ext_proc timeouts end"
        f" them (README, Failure modes); the clients here give up after {HUNG_TIMEOUT_S:g} s,"
        " which also slows their later requests. Least request sends the hung replica"
        " fewer streams as its open ones pile up.",
        "",
    ]
    kills = [f for f in failovers if f.signal == "SIGKILL" and "without" not in f.name]
    bare = [f for f in failovers if f.signal == "SIGKILL" and "without" in f.name]
    if kills:
        per_kill = ", ".join(str(f.failed) for f in kills)
        lines += [
            f"**SIGKILL of one of 2 replicas: {sum(f.failed for f in kills)} failed requests"
            f" in {len(kills)} kills** (per kill: {per_kill}; at most"
            f" {max(f.failed for f in kills)})."
            + (
                f" Without the retry and ejection settings: {sum(f.failed for f in bare)} in"
                f" {len(bare)} kills (per kill: {', '.join(str(f.failed) for f in bare)})."
                if bare
                else ""
            ),
            "",
        ]
    lines += [
        "| scene | requests | failed | failed requests started (s after the signal) |"
        " errors | ok after the signal | ok in the last second |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for f in failovers:
        times = ", ".join(f"{t:+.3f}" for t in f.failed_after_signal[:12]) or "-"
        if len(f.failed_after_signal) > 12:
            times += f", ... (window {f.window_s:.3f} s)"
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(f.errors.items())) or "-"
        lines.append(
            f"| {f.name} | {f.requests} | {f.failed} | {times} | {errors}"
            f" | {f.ok_after_signal} | {f.ok_last_second} |"
        )
    lines += [
        "",
        "## Limits",
        "",
        "- Not a consensus: two replicas choosing within the same millisecond do not see"
        " each other's choice (two new prompts can land on one pod); the next decision"
        " sees both.",
        "- A peer's dispatch counts in a pod's load from its arrival here until a page"
        " fetched after that shows it (at most `replicas.load_ttl_s`, 5 s, while no page"
        " comes). Only the replica that routed a request hears of its end.",
        "- The peer port has no authentication: what it reads is bounded and validated"
        " (a malformed frame closes that connection), but anyone who can reach it can send"
        " well-formed decisions. Keep it inside the cluster; a NetworkPolicy that lets only"
        " EPP pods reach it is not shipped.",
        "- Behind a Gateway controller (Envoy Gateway and the InferencePool's"
        " `endpointPickerRef`), the ext_proc cluster is the controller's: its health checks"
        " and retries decide what a replica's death costs. Not run here.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp bench replicas", description=__doc__)
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument(
        "--seeds", default="0,1", help="workload seeds of the sharing scenes (comma list)"
    )
    parser.add_argument("--clients", type=int, default=8, help="failover: clients at once")
    parser.add_argument("--failover-s", type=float, default=8.0, help="failover: run length")
    parser.add_argument("--kill-runs", type=int, default=3, help="failover: SIGKILL runs")
    parser.add_argument("--work-dir", type=Path, help="keep logs and configs here")
    parser.add_argument("--out", type=Path, help="write the markdown page here")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    specs = [
        WorkloadSpec(seed=seed, conversations=args.conversations, turns=args.turns)
        for seed in seeds
    ]
    spec = specs[0]
    with contextlib.ExitStack() as cleanup:
        if args.work_dir is not None:
            work = args.work_dir
        else:
            import tempfile

            work = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="epp-replicas-")))
        kinds = [
            ("1 replica", "one", 1, False),
            ("2 replicas, not sharing", "two", 2, False),
            ("2 replicas, sharing", "shared", 2, True),
        ]
        groups = [
            [
                run_scene(name, work / f"{folder}-{s.seed}", s, args.concurrency, count, share)
                for s in specs
            ]
            for name, folder, count, share in kinds
        ]
        signal_at = args.failover_s / 2
        failovers = [
            run_failover(
                f"SIGKILL one of 2, run {i + 1}", work / f"kill-{i}", spec, args.clients,
                signal.SIGKILL, args.failover_s, signal_at,
            )
            for i in range(args.kill_runs)
        ]  # fmt: skip
        failovers += [
            run_failover(
                f"SIGKILL, Envoy without retry and ejection, run {i + 1}", work / f"bare-{i}",
                spec, args.clients, signal.SIGKILL, args.failover_s, signal_at, envoy="bare",
            )
            for i in range(args.kill_runs)
        ]  # fmt: skip
        failovers += [
            run_failover(
                "SIGTERM one of 2 (drain)", work / "term", spec, args.clients, signal.SIGTERM,
                args.failover_s, signal_at,
            ),
            run_failover(
                "SIGSTOP one of 2 (hung)", work / "stop", spec, args.clients, signal.SIGSTOP,
                args.failover_s, signal_at,
            ),
        ]  # fmt: skip
    command = (
        f"epp bench replicas --conversations {args.conversations} --turns {args.turns}"
        f" --concurrency {args.concurrency} --seeds {args.seeds} --clients {args.clients}"
        f" --failover-s {args.failover_s:g} --kill-runs {args.kill_runs}"
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    page = render_page(
        groups, failovers, command, commit or "unknown", spec, args.concurrency, seeds
    )
    print(page)
    if args.out is not None:
        args.out.write_text(page)
    if args.json is not None:
        payload = {
            "scenes": [asdict(s) for g in groups for s in g],
            "failovers": [asdict(f) for f in failovers],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"rerun: .venv/bin/{command}")
    return 0
