"""What scraping /metrics costs a real running vLLM: its process group's CPU per scrape.

    .venv/bin/python tools/vllm_check/scrape_cost.py [--window 6] [--rounds 5] [--json FILE]

Starts one vLLM OpenAI API server (CPU build, the tiny local model: `make vllm-setup`) in
its own process group, waits for /health, sends one warm-up chat request, then measures
the CPU of the whole group (API server, engine core, any worker) from /proc over windows
of `--window` seconds, the arms alternating in `--rounds` rounds (ABCDE ABCDE ...) so that
the noise of the shared machine spreads over all of them:

- idle: no scrape (the engine's own idle cost, subtracted from the others round by round);
- gzip: GET /metrics at `--rate` Hz with aiohttp's default headers (Accept-Encoding: gzip,
  deflate): what the scraper sent before `datalayer/page_client.py`;
- whole: the scraper's client (`PageClient`) on the plain metrics URL: identity, the whole
  page (`datalayer.scrape_name_filter: false`);
- filtered: exactly what the scraper sends by default: `PageClient` on
  `scrape_url(metrics_url, names)` with the names its reader asks for
  (`page_reader(DataLayerConfig()).names`);
- mount_gzip, mount_whole, mount_filtered: the same three on `/metrics/`. vLLM serves
  `/metrics` from prometheus-fastapi-instrumentator's own route (registered first:
  `generate_latest` of the whole registry, never gzipped, query ignored) and mounts
  prometheus_client's ASGI app (which honours `name[]` and gzip) behind it, reached at
  `/metrics/`;
- floor: `PageClient` on `/version`: the HTTP server's cost of a request that renders no
  metrics.

Every scrape is one request at a time on one kept-alive connection, started on ticks of
1/rate seconds. Prints per arm the engine's CPU per scrape above idle (median and range
over rounds), the page's bytes and encoding, and the engine's cores at `--rate` Hz; then a
JSON summary (also written to `--json`). Uses tools/vllm_fleet/procs.py for the process
group and its CPU, and tools/vllm_check/vllm_server.py for vLLM's command and environment.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT / "tools" / "vllm_fleet"))

from procs import HOST, Children, cpu_snapshot, cpu_window, free_ports, http, wait_http  # noqa: E402
from run_check import vllm_version  # noqa: E402
from vllm_server import MODEL_NAME, missing, server_argv, server_env  # noqa: E402

ARMS = (
    "idle", "gzip", "whole", "filtered", "mount_gzip", "mount_whole", "mount_filtered", "floor",
)  # fmt: skip
LOG_ROOT = ROOT / ".bench" / "vllm-scrape-cost-logs"


def schedule(arms: tuple[str, ...], rounds: int) -> list[tuple[int, str]]:
    """(round, arm) in the order measured: every arm once per round, in the same order."""
    return [(r, arm) for r in range(rounds) for arm in arms]


@dataclass(slots=True)
class Window:
    """One measured window: the engine group's CPU seconds and what was scraped."""

    round: int
    arm: str
    wall_s: float
    engine_cpu_s: float
    scrapes: int = 0
    page_bytes: int = 0  # the last page's body as received (compressed if it was)
    encoding: str = ""
    failures: int = 0
    cores: dict[str, float] = field(default_factory=dict)  # procs.cpu_window of the window


def extra_ms_per_scrape(arm: Window, idle: Window) -> float | None:
    """The engine's CPU per scrape above its idle rate of the same round, in ms."""
    if arm.scrapes <= 0 or idle.wall_s <= 0:
        return None
    idle_rate = idle.engine_cpu_s / idle.wall_s
    return 1000 * (arm.engine_cpu_s - idle_rate * arm.wall_s) / arm.scrapes


def summarize(windows: list[Window], rate_hz: float) -> dict[str, dict[str, Any]]:
    """Per arm: ms per scrape above idle (median, min, max over rounds), cores at rate_hz
    from the median, scrapes per second achieved, page bytes and encoding; for idle, the
    engine's own cores."""
    idle = {w.round: w for w in windows if w.arm == "idle"}
    out: dict[str, dict[str, Any]] = {}
    arms = list(dict.fromkeys(w.arm for w in windows))
    for arm in arms:
        mine = [w for w in windows if w.arm == arm]
        if arm == "idle":
            cores = [w.engine_cpu_s / w.wall_s for w in mine if w.wall_s > 0]
            out[arm] = {
                "engine_cores_median": round(statistics.median(cores), 4),
                "engine_cores_range": [round(min(cores), 4), round(max(cores), 4)],
                "rounds": len(mine),
            }
            continue
        per = [
            ms
            for w in mine
            if w.round in idle and (ms := extra_ms_per_scrape(w, idle[w.round])) is not None
        ]
        if not per:
            out[arm] = {"rounds": 0}
            continue
        median = statistics.median(per)
        out[arm] = {
            "ms_per_scrape_median": round(median, 3),
            "ms_per_scrape_range": [round(min(per), 3), round(max(per), 3)],
            "ms_per_scrape_rounds": [round(x, 3) for x in per],
            "cores_per_engine_at_rate": round(median * rate_hz / 1000, 4),
            "scrapes_per_s": round(sum(w.scrapes for w in mine) / sum(w.wall_s for w in mine), 2),
            "page_bytes": mine[-1].page_bytes,
            "encoding": mine[-1].encoding or "identity",
            "failures": sum(w.failures for w in mine),
            "rounds": len(per),
        }
    return out


def render_table(summary: dict[str, dict[str, Any]], rate_hz: float) -> str:
    rate = f"{rate_hz:g}"
    lines = [
        f"| arm | engine CPU ms per scrape above idle, median [range] | page | "
        f"cores per engine at {rate} Hz | scrapes/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm, s in summary.items():
        if arm == "idle":
            lo, hi = s["engine_cores_range"]
            lines.append(
                f"| idle (no scrape) | - | - | {s['engine_cores_median']:.3f} [{lo:.3f}-{hi:.3f}] "
                "(the engine's own) | 0 |"
            )
        elif s.get("rounds"):
            lo, hi = s["ms_per_scrape_range"]
            lines.append(
                f"| {arm} | {s['ms_per_scrape_median']:.2f} [{lo:.2f} - {hi:.2f}] | "
                f"{s['page_bytes']:,} B {s['encoding']} | {s['cores_per_engine_at_rate']:.3f} | "
                f"{s['scrapes_per_s']:.1f} |"
            )
    return "\n".join(lines)


# -- the scrapes ---------------------------------------------------------------------------


async def paced(
    fetch: Callable[[], Awaitable[tuple[int, str]]], window: Window, seconds: float, rate: float
) -> None:
    """`fetch` once per 1/rate-second tick for `seconds`, one at a time (a late one skips
    the ticks it overran, as the scraper's loop does)."""
    period = 1.0 / rate
    start = time.monotonic()
    tick = 0
    while (now := time.monotonic()) - start < seconds:
        due = start + tick * period
        if due > now:
            await asyncio.sleep(due - now)
        try:
            window.page_bytes, window.encoding = await fetch()
            window.scrapes += 1
        except Exception:
            window.failures += 1
        tick = max(tick + 1, int((time.monotonic() - start) / period) + 1)


class Fetchers:
    """One kept-alive client per arm, built once."""

    def __init__(self, base: str) -> None:
        import aiohttp

        from epp.config import DataLayerConfig
        from epp.datalayer.page_client import PageClient
        from epp.datalayer.scraper import page_reader, scrape_url

        names = page_reader(DataLayerConfig()).names
        self.urls = {
            "gzip": base + "/metrics",
            "whole": base + "/metrics",
            "filtered": scrape_url(base + "/metrics", names),
            "mount_gzip": base + "/metrics/",
            "mount_whole": base + "/metrics/",
            "mount_filtered": scrape_url(base + "/metrics/", names),
            "floor": base + "/version",
        }
        self.names = names
        # Default headers (Accept-Encoding: gzip, deflate); the body kept as it came.
        self.session = aiohttp.ClientSession(auto_decompress=False)
        self.clients = {
            arm: PageClient(url) for arm, url in self.urls.items() if not arm.endswith("gzip")
        }

    async def fetch(self, arm: str) -> tuple[int, str]:
        if arm.endswith("gzip"):
            async with self.session.get(self.urls[arm]) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{arm}: {resp.status}")
                return len(body), resp.headers.get("Content-Encoding", "")
        response = await self.clients[arm].get(5.0)
        if response.status != 200:
            raise RuntimeError(f"{arm}: {response.status}")
        return len(response.body), ""

    async def page(self, arm: str) -> bytes:
        """The body of one identity arm's answer."""
        response = await self.clients[arm].get(5.0)
        if response.status != 200:
            raise RuntimeError(f"{arm}: {response.status}")
        return bytes(response.body)

    async def close(self) -> None:
        for client in self.clients.values():
            client.close()
        await self.session.close()


async def measure(
    pgid: int, base: str, arms: tuple[str, ...], rounds: int, seconds: float, rate: float
) -> tuple[list[Window], dict[str, Any]]:
    fetchers = Fetchers(base)
    probe: dict[str, Any] = {"names": list(fetchers.names), "urls": fetchers.urls}
    try:
        for arm in arms:  # first renderings are slow; each arm's page once, checked
            if arm == "idle":
                continue
            for _ in range(5):
                size, encoding = await fetchers.fetch(arm)
            probe[arm] = {"page_bytes": size, "encoding": encoding or "identity"}
            log(f"probe {arm}: {size:,} bytes {encoding or 'identity'}")
        # Whether a filtered page gives the scraper's reader what the whole page gives it
        # (the engine is idle: its values do not move between the two GETs).
        from epp.config import DataLayerConfig
        from epp.datalayer.scraper import page_reader

        reader = page_reader(DataLayerConfig())
        if "whole" in arms:
            whole = reader.parse(await fetchers.page("whole"))
            for arm in ("filtered", "mount_filtered"):
                if arm in arms:
                    same = reader.parse(await fetchers.page(arm)) == whole
                    probe[arm]["reads_as_whole_page"] = same
                    log(f"{arm}: the reader's fields {'equal' if same else 'DIFFER from'} "
                        "the whole page's")  # fmt: skip
        windows = []
        groups = {"engine": pgid}
        for r, arm in schedule(arms, rounds):
            w = Window(r, arm, 0.0, 0.0)
            before, t0 = cpu_snapshot(groups), time.monotonic()
            if arm == "idle":
                await asyncio.sleep(seconds)
            else:
                await paced(lambda a=arm: fetchers.fetch(a), w, seconds, rate)
            w.wall_s = time.monotonic() - t0
            after = cpu_snapshot(groups)
            w.engine_cpu_s = after["engine"] - before["engine"]
            w.cores = cpu_window(before, after, w.wall_s)
            w.cores["loadavg_1m"] = os.getloadavg()[0]
            windows.append(w)
            log(
                f"round {r} {arm:8s} {w.scrapes:4d} scrapes {w.engine_cpu_s * 1000:7.0f} ms "
                f"engine CPU; cores {w.cores}"
            )
        return windows, probe
    finally:
        await fetchers.close()


# -- vLLM ----------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def group_processes(pgid: int) -> list[str]:
    """The command names of the processes in group `pgid` (what the CPU figure covers)."""
    names = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        if int(rest.split()[2]) == pgid:
            names.append(head.partition("(")[2])
    return sorted(names)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=6.0, help="seconds per measured window")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rate", type=float, default=20.0, help="scrapes per second (20: 50 ms)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"subset of {','.join(ARMS)}")
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args()
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    unknown = set(arms) - set(ARMS)
    if unknown or "idle" not in arms:
        raise SystemExit(f"--arms: {sorted(unknown)} unknown; idle is required")
    if (why := missing()) is not None:
        raise SystemExit(f"cannot start vLLM: {why}; run `make vllm-setup`")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = " ".join([".venv/bin/python tools/vllm_check/scrape_cost.py", *sys.argv[1:]]).strip()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    logs = LOG_ROOT / time.strftime("%Y%m%d-%H%M%S")
    (port,) = free_ports(1)
    base = f"http://{HOST}:{port}"
    children = Children()
    t0 = time.monotonic()
    try:
        argv = server_argv(port, block_size=32, num_blocks=None, max_model_len=2048)
        child = children.spawn("vllm", argv, logs / "vllm.log", server_env())
        log(f"starting vLLM on {base} (log {logs / 'vllm.log'})")
        wait_http(child, base + "/health", args.start_timeout)
        start_s = time.monotonic() - t0
        log(f"healthy after {start_s:.0f} s")
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "warm up " * 50}],
            "max_tokens": 8,
        }
        status, _, text = http("POST", base + "/v1/chat/completions", body, timeout=120)
        if status != 200:
            raise RuntimeError(f"warm-up request -> {status}: {text[:300]}")
        time.sleep(2.0)  # let the request's aftermath settle before the first window
        pgid = child.popen.pid
        processes = group_processes(pgid)
        log(f"process group {pgid}: {processes}")
        load_before = os.getloadavg()
        windows, probe = asyncio.run(measure(pgid, base, arms, args.rounds, args.window, args.rate))
        load_after = os.getloadavg()
    finally:
        children.stop_all()
    summary = summarize(windows, args.rate)
    result = {
        "command": command,
        "started": started,
        "vllm": vllm_version(),
        "vllm_start_s": round(start_s, 1),
        "engine_processes": processes,
        "window_s": args.window,
        "rounds": args.rounds,
        "rate_hz": args.rate,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
        "probe": probe,
        "summary": summary,
        "windows": [
            {k: getattr(w, k) for k in Window.__slots__}  # type: ignore[attr-defined]
            for w in windows
        ],
    }
    print()
    print(render_table(summary, args.rate))
    print()
    print(f"vLLM {result['vllm']}, {started}, load average {load_before} -> {load_after}")
    print(f"rerun: {command}")
    print(json.dumps({k: v for k, v in result.items() if k != "windows"}, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
