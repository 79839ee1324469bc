"""Live benchmark runner: each router in front of fresh simulated pods, real traffic.

For every (rate, router) pair: start N brand-new `epp sim` pods and the router in front
of them (so every router starts cold), let the stack idle for a moment to measure what it
costs at rest, then drive the workload through the router with our open-loop client or
with inference-perf, and collect a `RunResult` (mode "live"):

- per request: TTFT, latency, tokens, cached tokens, serving pod (our client);
- the pods' own prefix-cache hit rate (counter deltas summed over the pods);
- CPU of every process from /proc, in cores, including the machine's total and whatever
  other programs used, so that a CPU-bound run is visible as such;
- the pods' occupancy (running and waiting requests, sampled every second), so that a
  run where the simulated GPUs were full is visible as such;
- for the EPP: CPU per routing decision (process CPU / decisions it reports), and its own
  scoring latency and cache-match figures.

Every process is stopped after each run, also on failure or Ctrl-C (LocalStack).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from epp_bench.live.bench_dir import BenchDir
from epp_bench.live.client import ClientLimits, ClientRun, run_open_loop
from epp_bench.live.cpu import CpuUsage, machine_cpu, snapshot, usage_between
from epp_bench.live.decisions import engine_stale, read_decisions
from epp_bench.live.inference_perf import (
    InferencePerfRun,
    load_from_workload,
    run_inference_perf_async,
    summary_fields,
)
from epp_bench.live.routers import RouterSpec, RunningRouter, running_router
from epp_bench.live.sampler import (
    Occupancy,
    hit_rate,
    new_session,
    pod_ttft_mean_s,
    sample_occupancy,
    scrape_epp_stats,
    scrape_pods,
)
from epp_bench.workloads import catalog as workloads
from epp_bench.workloads.types import BenchRequest, RequestOutcome, RunResult, Workload
from epp_harness.stack import StackError
from vllm_sim import cli as sim_cli
from vllm_sim.server import SimPodConfig

ClientKind = Literal["ours", "inference-perf"]

# Chosen so that on 2 cores the simulated GPUs fill up long before the CPU does (measured:
# docs/benchmarks/live.md): 4 running slots per pod and a slow decode (10 ms/token), so a
# request holds its slot ~1.4 s while costing the CPU only ~100 SSE chunks; 0.2 ms per
# uncached prompt token, so a miss on a 1,800-token prompt takes ~0.36 s of the pod's
# shared prefill lane against ~0.07 s for a hit. 2,048 KV blocks per pod hold 32k tokens:
# the 30 system prompts of shared-prefix-small (45k tokens) fit in the cluster only if the
# router partitions them.
DEFAULT_SIM_ARGS: tuple[str, ...] = (
    "--max-num-seqs", "4",
    "--num-gpu-blocks", "2048",
    "--prefill-overhead-ms", "5",
    "--prefill-per-token-ms", "0.2",
    "--decode-per-token-ms", "10",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class LiveSettings:
    workload: str = "shared-prefix-small"
    rates: tuple[float, ...] = (4.0, 8.0, 10.0)
    pods: int = 4
    sim_args: tuple[str, ...] = DEFAULT_SIM_ARGS
    duration_s: float = 90.0  # arrivals after this are dropped; also bounds inference-perf
    drain_s: float = 60.0  # after the last arrival, for requests still in flight
    max_in_flight: int = 256
    request_timeout_s: float = 60.0
    idle_probe_s: float = 2.0
    seed: int = 0
    epp_args: tuple[str, ...] = ()
    # Every pod publishes KV events, whatever the router (the same pods for all of them).
    kv_events: bool = False
    block_size: int = 16  # the EPP's prefix.block_size: turns its match into tokens


ProgressCallback = Callable[[RequestOutcome], None]


def live_workload(name: str, rate: float, seed: int, duration_s: float) -> Workload:
    """The named workload at `rate`, without the requests that arrive after `duration_s`.

    A follow-up turn whose predecessor is dropped is dropped too; indices are kept, so an
    outcome's `index` is still the workload's.
    """
    full = workloads.by_name(name, rate=rate, seed=seed)
    kept: list[BenchRequest] = []
    kept_indices: set[int] = set()
    for request in full.requests:
        if request.arrival_s >= duration_s:
            continue
        if request.after is not None and request.after not in kept_indices:
            continue
        kept.append(request)
        kept_indices.add(request.index)
    return replace(full, requests=tuple(kept))


def sim_config(sim_args: Sequence[str]) -> SimPodConfig:
    """The pod configuration `epp sim` builds from these arguments (ValueError if invalid)."""
    parser = sim_cli.build_parser()
    try:
        args = parser.parse_args(list(sim_args))
    except SystemExit as exc:  # argparse exits on a bad argument
        raise ValueError(f"invalid --sim-args {' '.join(sim_args)!r}") from exc
    return sim_cli.config_from_args(args)


@dataclass(slots=True)
class _Measured:
    """What one drive of the stack produced, before it becomes a RunResult."""

    outcomes: list[RequestOutcome]
    wall_s: float
    cpu: CpuUsage
    idle: CpuUsage
    pods_before: dict[str, Any]
    pods_after: dict[str, Any]
    occupancy: Occupancy
    epp_before: dict[str, float] = field(default_factory=dict)
    epp_after: dict[str, float] = field(default_factory=dict)
    client_extra: dict[str, Any] = field(default_factory=dict)
    request_ids: dict[int, str] = field(default_factory=dict)


async def _measure(
    router: RunningRouter,
    drive: Callable[[], Any],
    settings: LiveSettings,
) -> _Measured:
    """Idle probe, counters before, drive (in the loop or a thread), counters after."""
    async with new_session() as session:
        idle_start = snapshot(router.groups)
        await asyncio.sleep(settings.idle_probe_s)
        idle = usage_between(idle_start, snapshot(router.groups), settings.idle_probe_s)
        pods_before = await scrape_pods(session, router.pods)
        epp_before = (
            await scrape_epp_stats(session, router.epp_metrics_url)
            if router.epp_metrics_url
            else {}
        )
        cpu_before = snapshot(router.groups)
        started = time.monotonic()
        async with sample_occupancy(session, router.pods) as occupancy:
            driven = drive()
            result = await driven if asyncio.iscoroutine(driven) else driven
        wall = time.monotonic() - started
        cpu = usage_between(cpu_before, snapshot(router.groups), wall)
        pods_after = await scrape_pods(session, router.pods)
        epp_after = (
            await scrape_epp_stats(session, router.epp_metrics_url)
            if router.epp_metrics_url
            else {}
        )
    if isinstance(result, ClientRun):
        lateness = sorted(result.send_lateness_s)
        client_extra: dict[str, Any] = {
            "not_sent": result.not_sent,
            "cap_waits": result.cap_waits,
            "send_lateness_p99_s": lateness[int(0.99 * (len(lateness) - 1))] if lateness else None,
            "send_lateness_max_s": lateness[-1] if lateness else None,
        }
        outcomes, client_wall = result.outcomes, result.wall_s
        request_ids = result.request_ids
    else:
        assert isinstance(result, InferencePerfRun)
        client_extra = {
            "inference_perf_summary": summary_fields(result.summary),
            "inference_perf_wall_s": result.wall_s,
            "cannot_give": ["pod per request (no response headers)", "HTTP status"],
        }
        outcomes, client_wall = result.outcomes, result.benchmark_s or result.wall_s
        request_ids = {}
    return _Measured(
        outcomes=outcomes,
        wall_s=client_wall,
        cpu=cpu,
        idle=idle,
        pods_before=pods_before,
        pods_after=pods_after,
        occupancy=occupancy,
        epp_before=epp_before,
        epp_after=epp_after,
        client_extra=client_extra,
        request_ids=request_ids,
    )


def _cores_summary(usage: CpuUsage) -> dict[str, float]:
    """Cores by component with the pods added up."""
    out: dict[str, float] = {"pods": 0.0}
    for name, cores in usage.cores.items():
        if name.startswith("pod-"):
            out["pods"] += cores
        else:
            out[name] = cores
    out["client"] = usage.client_cores
    out["machine_busy"] = usage.machine_busy_cores
    out["foreign"] = usage.foreign_cores
    return {k: round(v, 3) for k, v in out.items()}


def _result(
    spec: RouterSpec,
    router: RunningRouter,
    workload: Workload,
    rate: float,
    client: ClientKind,
    settings: LiveSettings,
    measured: _Measured,
) -> RunResult:
    routed = len(measured.outcomes)
    decisions = measured.epp_after.get("decisions", 0.0) - measured.epp_before.get("decisions", 0.0)
    wall = measured.cpu.wall_s
    epp_cpu_us = None
    epp_extra: dict[str, Any] = {}
    if "epp" in measured.cpu.cores:
        epp_cpu_s = measured.cpu.cores["epp"] * wall
        idle_epp_s = measured.idle.cores.get("epp", 0.0) * wall
        per = decisions if decisions > 0 else routed
        epp_cpu_us = epp_cpu_s / per * 1e6 if per else None
        epp_extra = {
            "decisions": decisions,
            "cpu_us_per_decision_net_of_idle": (epp_cpu_s - idle_epp_s) / per * 1e6
            if per
            else None,
            "idle_cores": round(measured.idle.cores.get("epp", 0.0), 4),
            "scoring_latency_us_mean": _delta_mean(
                measured, "scoring_latency_us_sum", "scoring_latency_us_count"
            ),
            "cache_match_mean": _delta_mean(measured, "cache_match_sum", "cache_match_count"),
            "best_match_mean": _delta_mean(measured, "best_match_sum", "best_match_count"),
            "stale_from_epp": _epp_stale(measured),
            "kv_events": _delta(measured, "kv_events"),
        }
        if router.epp_log is not None and measured.request_ids:
            epp_extra["stale_engine_side"] = engine_stale(
                measured.outcomes,
                measured.request_ids,
                read_decisions(router.epp_log),
                settings.block_size,
            )
    router_cpu_us = None
    if router.decision_component and routed:
        router_cpu_us = measured.cpu.cores.get(router.decision_component, 0.0) * wall / routed * 1e6
    pod_config = sim_config(settings.sim_args)
    slots_total = settings.pods * pod_config.engine.max_num_seqs
    client_ttfts = [o.ttft_s for o in measured.outcomes if o.ok and o.ttft_s is not None]
    pod_ttft = pod_ttft_mean_s(measured.pods_before, measured.pods_after)
    # What the path in front of the pods adds to TTFT (router, proxy hops, client): the
    # client's mean minus the pods' own mean, both over the same requests.
    front_ttft = (
        sum(client_ttfts) / len(client_ttfts) - pod_ttft * pod_config.time_scale
        if client_ttfts and pod_ttft is not None
        else None
    )
    extra: dict[str, Any] = {
        "client": client,
        "router_description": spec.description,
        "sim_args": list(settings.sim_args),
        "requests_offered": len(workload.requests),
        "router_cpu_us_per_request": router_cpu_us,
        "pod_ttft_mean_s": None if pod_ttft is None else pod_ttft * pod_config.time_scale,
        "front_ttft_mean_s": front_ttft,
        "router_component": router.decision_component,
        "pod_names": [pod.name for pod in router.pods],
        "machine_cores": measured.cpu.machine_cores,
        "cpu_cores": _cores_summary(measured.cpu),
        "idle_cpu_cores": _cores_summary(measured.idle),
        "occupancy": measured.occupancy.summary(slots_total),
        "client_stats": measured.client_extra,
        "workload_description": workload.description,
    }
    if client == "ours":
        extra["placement"] = placement(workload, measured.outcomes)
    if epp_extra:
        extra["epp"] = epp_extra
    return RunResult(
        router=spec.name,
        workload=workload.name if client == "ours" else f"{workload.name} (inference-perf)",
        rate=rate,
        pods=settings.pods,
        duration_s=measured.wall_s,
        outcomes=measured.outcomes,
        pod_hit_rate=hit_rate(measured.pods_before, measured.pods_after),
        epp_cpu_us_per_decision=epp_cpu_us,
        mode="live",
        extra=extra,
    )


def placement(workload: Workload, outcomes: Sequence[RequestOutcome]) -> dict[str, Any]:
    """How the router placed the workload's prefix groups: groups per pod, split groups.

    Affinity routers keep a group on one pod; how evenly the groups (not the requests) are
    spread decides how evenly the load follows once every group is cached somewhere.
    """
    group_of = {r.index: r.group for r in workload.requests}
    pods_of_group: dict[str, set[str]] = {}
    for outcome in outcomes:
        group = group_of.get(outcome.index)
        if outcome.pod is not None and group:
            pods_of_group.setdefault(group, set()).add(outcome.pod)
    groups_per_pod: dict[str, int] = {}
    for pods in pods_of_group.values():
        for pod in pods:
            groups_per_pod[pod] = groups_per_pod.get(pod, 0) + 1
    return {
        "groups": len(pods_of_group),
        "groups_on_several_pods": sum(1 for pods in pods_of_group.values() if len(pods) > 1),
        "groups_per_pod": dict(sorted(groups_per_pod.items())),
    }


def _delta(measured: _Measured, key: str) -> float:
    return measured.epp_after.get(key, 0.0) - measured.epp_before.get(key, 0.0)


def _epp_stale(measured: _Measured) -> dict[str, float | None]:
    """`epp_stale_cache_routing_total / epp_stale_cache_checked_total` over the run."""
    stale, checked = _delta(measured, "stale"), _delta(measured, "stale_checked")
    return {"stale": stale, "checked": checked, "rate": stale / checked if checked else None}


def wait_for_index_modes(
    metrics_url: str, expected: str, timeout_s: float = 30.0, poll_s: float = 0.2
) -> dict[str, str]:
    """Wait until the EPP reports every pod in index mode `expected` (`/debug/endpoints`);
    StackError if it does not within `timeout_s`. Returns each pod's mode.

    A precise pod becomes precise when its subscriber connects: a run that started before
    would measure approximate routing under the precise label.
    """
    url = metrics_url.rsplit("/metrics", 1)[0] + "/debug/endpoints"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    modes: dict[str, str] = {}
    while True:
        try:
            with opener.open(url, timeout=2.0) as response:
                modes = {e["name"]: e["index_mode"] for e in json.loads(response.read())}
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
            modes = {}
        if modes and set(modes.values()) == {expected}:
            return modes
        if time.monotonic() >= deadline:
            raise StackError(
                f"the EPP's pods are not all {expected} after {timeout_s:g} s: {modes}"
            )
        time.sleep(poll_s)


def expected_index_mode(spec: RouterSpec) -> str | None:
    """The index mode an EPP variant sets for every pod (None: not set by the router)."""
    kv_events = spec.epp_config.get("kv_events")
    mode = kv_events.get("mode") if isinstance(kv_events, dict) else None
    return mode if mode in ("precise", "approximate") else None


def _delta_mean(measured: _Measured, total: str, count: str) -> float | None:
    n = measured.epp_after.get(count, 0.0) - measured.epp_before.get(count, 0.0)
    if n <= 0:
        return None
    return (measured.epp_after.get(total, 0.0) - measured.epp_before.get(total, 0.0)) / n


def run_once(
    spec: RouterSpec,
    bench: BenchDir,
    workload: Workload,
    rate: float,
    settings: LiveSettings,
    client: ClientKind = "ours",
    *,
    work_dir: Path | None = None,
    progress: ProgressCallback | None = None,
) -> RunResult:
    """One router, fresh pods, one workload at one rate; every process stopped after."""
    last_arrival = max((r.arrival_s for r in workload.requests), default=0.0)
    limits = ClientLimits(
        max_in_flight=settings.max_in_flight,
        deadline_s=last_arrival + settings.drain_s,
        request_timeout_s=settings.request_timeout_s,
    )
    with running_router(
        spec,
        bench,
        pods=settings.pods,
        sim_args=settings.sim_args,
        epp_args=settings.epp_args,
        work_dir=work_dir,
        kv_events=settings.kv_events,
    ) as router:
        expected = expected_index_mode(spec)
        index_modes = (
            wait_for_index_modes(router.epp_metrics_url, expected)
            if expected is not None and router.epp_metrics_url
            else None
        )
        if client == "ours":

            def drive() -> Any:
                return run_open_loop(router.url, workload, limits, progress)

        else:
            load = load_from_workload(workload, rate, settings.duration_s, settings.max_in_flight)
            ip_dir = (
                work_dir / "inference-perf"
                if work_dir is not None
                else Path(tempfile.mkdtemp(prefix="epp-inference-perf-"))
            )

            def drive() -> Any:
                return run_inference_perf_async(bench, load, router.url, ip_dir)

        measured = asyncio.run(_measure(router, drive, settings))
        result = _result(spec, router, workload, rate, client, settings, measured)
        if index_modes is not None:
            result.extra["index_modes"] = index_modes
        return result


def git_state(repo: Path) -> dict[str, Any]:
    """The commit and the modified files under src/ the run was made with."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", "-C", str(repo), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip()

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines()]
    return {"commit": git("rev-parse", "HEAD"), "modified_under_src": dirty}


def wait_for_quiet(max_busy_cores: float, max_wait_s: float, probe_s: float = 1.0) -> float:
    """Wait, at most `max_wait_s`, until the machine is quieter than `max_busy_cores`.

    The box is shared (other builds and tests run on it): starting a run while they burn
    the CPU would measure them. Returns the last reading in busy cores; the caller
    records it, whether or not the machine became quiet.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        start = machine_cpu()
        time.sleep(probe_s)
        end = machine_cpu()
        elapsed = end.total_s - start.total_s
        cores = os.cpu_count() or 1
        busy = (end.busy_s - start.busy_s) / elapsed * cores if elapsed > 0 else 0.0
        if busy <= max_busy_cores or time.monotonic() >= deadline:
            return busy
