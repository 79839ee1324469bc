"""`epp bench scrape`: what scraping pods' /metrics costs the EPP and the engine, before
and after in one run.

EPP side (the scraper's own process CPU, user + system):
1. **Per page, in process**: decode + parse of the 52 KB vLLM 0.33 fixture page
   (tests/fixtures/vllm-0.33-metrics.txt) by the parser of the "before" checkout, and the
   bytes parser of the work tree on the same page and on the filtered page (`name[]`).
2. **Live**: N pods every `--interval` for `--seconds` over loopback, each arm a process
   of its own (`scrape_worker.py`) running `MetricsScraper` as the service does:
   - before: the frozen checkout (`--before`, extracted as tools/bench/freeze_code.py
     does): aiohttp, which asks for gzip (the server gzips, as prometheus_client does
     for such clients), the decoded text parsed;
   - after, whole page: the work tree's client and parser, `scrape_name_filter: false`;
   - after (the default): the page asked for the series read only;
   - after, idle pods: the default settings on pages showing nothing running or waiting
     (`scrape_idle_interval_s`).
   The pods are one page server process (asyncio, raw HTTP/1.1 keep-alive) that answers
   what prometheus_client's exposition answers for each request (whole or filtered, gzip
   or not), rendered once from a real registry holding vLLM's families and cached, so
   that its own cost stays out of the EPP's figures. Cores = CPU seconds / wall seconds;
   per page = CPU / pages read; "at N pods" = per page x N / interval.

Engine side (what one scrape costs the server):
3. **vLLM's rendering**: `_bake_output` of a real prometheus_client registry holding
   vLLM's families (epp_bench.picker.scrape_engine), as vLLM's /metrics route calls it:
   the whole page gzipped (what aiohttp's Accept-Encoding gets), the whole page, the
   filtered page. CPU per call, the median of repeats.
4. **The simulator** (`python -m vllm_sim`, a process of its own): its process CPU per
   /metrics scrape by aiohttp and by the scraper's client (it renders its page itself and
   ignores `name[]`).

The machine is shared and noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[3]
FIXTURE = REPO / "tests" / "fixtures" / "vllm-0.33-metrics.txt"
WORKER = Path(__file__).with_name("scrape_worker.py")
# The default 'before' arm: the last revision that scraped with aiohttp and the text parser.
DEFAULT_BEFORE = "54e3fd6"


# -- the page server ------------------------------------------------------------------------


def idle_page(page: str) -> str:
    """The page with nothing running or waiting (the gauges at 0)."""
    lines = []
    for line in page.splitlines():
        if line.startswith(("vllm:num_requests_waiting{", "vllm:num_requests_running{")):
            line = line.rsplit(" ", 1)[0] + " 0.0"
        lines.append(line)
    return "\n".join(lines) + "\n"


class PageServer(asyncio.Protocol):
    """Answers GET /busy/... or /idle/... with what prometheus_client's exposition would
    (whole or `name[]`-filtered, gzip when accepted), from a cache: each distinct answer is
    rendered once."""

    registries: dict[str, Any] = {}
    cache: dict[tuple[str, str, bool], bytes] = {}
    served = 0

    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        from epp_bench.picker.scrape_engine import render

        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            target = lines[0].split(" ")[1]
            gzip_ok = any(
                line.lower().startswith("accept-encoding:") and "gzip" in line.lower()
                for line in lines[1:]
            )
            kind = "idle" if target.startswith("/idle/") else "busy"
            key = (kind, urlsplit(target).query, gzip_ok)
            body = self.cache.get(key)
            if body is None:
                body = render(self.registries[kind], target, "gzip" if gzip_ok else "")
                self.cache[key] = body
            extra = "Content-Encoding: gzip\r\n" if gzip_ok else ""
            self.transport.write(
                (
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8"
                    f"\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
                ).encode()
                + body
            )
            PageServer.served += 1


async def serve(port_file: str) -> None:
    from epp_bench.picker.scrape_engine import vllm_registry

    page = FIXTURE.read_text()
    PageServer.registries = {"busy": vllm_registry(page), "idle": vllm_registry(idle_page(page))}
    server = await asyncio.get_running_loop().create_server(PageServer, "127.0.0.1", 0)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()


# -- measurements -----------------------------------------------------------------------


def cpu_per_call(call: Any, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the process CPU per call, in microseconds."""
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        samples.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(samples)


BEFORE_PARSE = """
import json, time, statistics
from epp.datalayer.metrics_parser import VLLM_READER
raw = open({path!r}, "rb").read()
samples = []
for _ in range(5):
    t = time.process_time()
    for _ in range({calls}):
        VLLM_READER.parse(raw.decode("utf-8", "replace"))
    samples.append((time.process_time() - t) / {calls} * 1e6)
print(json.dumps(statistics.median(samples)))
"""


def parse_costs(before_src: Path, calls: int) -> dict[str, float]:
    from epp.config import DataLayerConfig
    from epp.datalayer.scraper import page_reader, scrape_url
    from epp_bench.picker.scrape_engine import render, vllm_registry

    raw = FIXTURE.read_bytes()
    reader = page_reader(DataLayerConfig())
    filtered = render(vllm_registry(raw.decode()), scrape_url("/metrics", reader.names))
    code = BEFORE_PARSE.format(path=str(FIXTURE), calls=calls)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(before_src)},
        capture_output=True,
        text=True,
        check=True,
    )
    return {
        "before: decode + text parse, whole page": json.loads(done.stdout),
        "after: bytes parse, whole page": cpu_per_call(lambda: reader.parse(raw), calls),
        "after: bytes parse, filtered page": cpu_per_call(lambda: reader.parse(filtered), calls),
        "filtered page bytes": float(len(filtered)),
    }


def engine_costs(calls: int) -> dict[str, float]:
    from epp.config import DataLayerConfig
    from epp.datalayer.scraper import page_reader, scrape_url
    from epp_bench.picker.scrape_engine import render, vllm_registry

    registry = vllm_registry(FIXTURE.read_text())
    url = scrape_url("/metrics", page_reader(DataLayerConfig()).names)
    return {
        "whole page, gzip (aiohttp's Accept-Encoding)": cpu_per_call(
            lambda: render(registry, "/metrics", "gzip, deflate"), calls
        ),
        "whole page, identity": cpu_per_call(lambda: render(registry, "/metrics"), calls),
        "filtered (name[]), identity": cpu_per_call(lambda: render(registry, url), calls),
    }


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def simulator_costs(scrapes: int) -> dict[str, float]:
    """The simulator's process CPU per /metrics scrape, by aiohttp and by PageClient."""
    import aiohttp

    from epp.config import DataLayerConfig
    from epp.datalayer.page_client import PageClient
    from epp.datalayer.scraper import page_reader, scrape_url

    port = free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "vllm_sim", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                try:
                    async with session.get(url) as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)

            async def by_aiohttp() -> None:
                async with session.get(url) as response:
                    await response.read()

            client = PageClient(scrape_url(url, page_reader(DataLayerConfig()).names))

            async def by_page_client() -> None:
                await client.get(5.0)

            out = {}
            for name, fetch in (("aiohttp", by_aiohttp), ("scraper's client", by_page_client)):
                for _ in range(20):
                    await fetch()
                start = _proc_cpu_s(sim.pid)
                for _ in range(scrapes):
                    await fetch()
                out[name] = (_proc_cpu_s(sim.pid) - start) / scrapes * 1e6
            client.close()
            return out
    finally:
        sim.terminate()
        sim.wait(10)


async def client_costs(url: str, fetches: int) -> dict[str, float]:
    """Process CPU per GET of one page (us, median of 3): aiohttp as the scraper used it
    (asking for gzip, which the page server gives, as prometheus_client does), aiohttp
    asking for identity, and the scraper's client."""
    import aiohttp

    from epp.datalayer.page_client import PageClient

    async def cpu(fetch: Any) -> float:
        for _ in range(50):
            await fetch()
        samples = []
        for _ in range(3):
            start = time.process_time()
            for _ in range(fetches):
                await fetch()
            samples.append((time.process_time() - start) / fetches * 1e6)
        return statistics.median(samples)

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def gzip_asked() -> bytes:
            async with session.get(url, ssl=True) as response:
                return await response.content.read(8 * 1024 * 1024 + 1)

        async def identity() -> bytes:
            headers = {"Accept-Encoding": "identity"}
            async with session.get(url, ssl=True, headers=headers) as response:
                return await response.content.read(8 * 1024 * 1024 + 1)

        client = PageClient(url)

        async def page_client() -> bytes:
            return (await client.get(5.0)).body

        out = {
            "aiohttp, gzip asked (before)": await cpu(gzip_asked),
            "aiohttp, identity": await cpu(identity),
            "the scraper's client, identity": await cpu(page_client),
        }
        client.close()
        return out


def live_arm(
    urls: list[str], interval_s: float, seconds: float, config: dict[str, Any], src: Path | None
) -> dict[str, Any]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src) + (
            os.pathsep + env["PYTHONPATH"] if "PYTHONPATH" in env else ""
        )
    spec = {"urls": urls, "interval_s": interval_s, "seconds": seconds, "config": config}
    done = subprocess.run(
        # The worker's text, not its path: a script's folder comes first on sys.path, and
        # this one's tokenize.py would shadow the standard library's.
        [sys.executable, "-c", WORKER.read_text(), json.dumps(spec)],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scrape worker failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = result["user_s"] + result["system_s"]
    result["cores"] = cpu / result["wall_s"]
    result["us_per_page"] = cpu / result["pages"] * 1e6 if result["pages"] else None
    result["pages_per_s"] = result["pages"] / result["wall_s"]
    return result


def freeze_before(revision: str) -> tuple[str, Path]:
    from epp_bench.live.frozen_code import freeze

    return freeze(REPO, REPO / ".bench" / "code", revision)


# -- the command ------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp bench scrape", description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.05, help="scrape_interval_s")
    parser.add_argument("--seconds", type=float, default=10.0, help="each live arm")
    parser.add_argument("--before", default=DEFAULT_BEFORE, help="the 'before' revision")
    parser.add_argument("--calls", type=int, default=300, help="in-process calls per sample")
    parser.add_argument("--sim-scrapes", type=int, default=300)
    parser.add_argument("--no-live", action="store_true", help="skip the live arms")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    commit, before_src = freeze_before(args.before)
    results: dict[str, Any] = {
        "command": "epp bench scrape " + shlex.join(argv),
        "before_commit": commit,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load_average": os.getloadavg(),
    }
    print(f"before: {commit[:12]} (frozen under {before_src})")
    results["parse_us"] = parse_costs(before_src, args.calls)
    _table("EPP CPU per page, in process (us)", results["parse_us"])
    results["engine_render_us"] = engine_costs(max(20, args.calls // 10))
    _table(
        "vLLM's /metrics rendering per scrape, prometheus_client (us CPU)",
        results["engine_render_us"],
    )
    results["simulator_us"] = asyncio.run(simulator_costs(args.sim_scrapes))
    _table("simulator process CPU per /metrics scrape (us)", results["simulator_us"])
    if not args.no_live:
        results["live"] = _live(args, before_src)
    results["load_average_after"] = os.getloadavg()
    print(f"\nload average before/after: {results['load_average']} / {os.getloadavg()}")
    print("command:", results["command"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


@contextlib.contextmanager
def page_server(fixture: Path = FIXTURE) -> Iterator[int]:
    """`serve` in a process of its own, answering `fixture`'s page; yields its port and
    stops it on exit."""
    port_file = Path(f"/tmp/epp-bench-page-server-{os.getpid()}.port")
    port_file.unlink(missing_ok=True)
    code = (
        "import asyncio, pathlib, epp_bench.picker.scrape as s; "
        f"s.FIXTURE = pathlib.Path({str(fixture)!r}); asyncio.run(s.serve({str(port_file)!r}))"
    )
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(600):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        yield int(port_file.read_text())
    finally:
        server.terminate()
        server.wait(10)
        port_file.unlink(missing_ok=True)


def _live(args: argparse.Namespace, before_src: Path) -> dict[str, Any]:
    with page_server() as port:
        busy = [f"http://127.0.0.1:{port}/busy/{i}/metrics" for i in range(args.pods)]
        clients = asyncio.run(client_costs(busy[0], args.calls * 5))
        _table("EPP CPU per GET of the whole page, in process (us)", clients)
        idle = [f"http://127.0.0.1:{port}/idle/{i}/metrics" for i in range(args.pods)]
        arms = {
            "before (aiohttp, gzip, text parse)": (busy, {}, before_src),
            "after, whole page": (busy, {"scrape_name_filter": False}, None),
            "after (default: name[] filter)": (busy, {}, None),
            "after, idle pods (default)": (idle, {}, None),
        }
        out: dict[str, Any] = {"client_us": clients}
        print(
            f"\nlive: {args.pods} pods every {args.interval * 1000:.0f} ms, {args.seconds} s each"
        )
        for name, (urls, config, src) in arms.items():
            out[name] = live_arm(urls, args.interval, args.seconds, config, src)
            row = out[name]
            projected = (
                row["us_per_page"] * 1e-6 * args.pods / args.interval if row["us_per_page"] else 0
            )
            row["cores_at_rate"] = projected
            print(
                f"  {name:<38} {row['us_per_page'] or 0:8.0f} us/page  "
                f"{row['pages_per_s']:7.0f} pages/s  {row['cores']:.3f} cores measured  "
                f"{projected:.3f} cores at {args.pods} pods / {args.interval * 1000:.0f} ms "
                f"(failures {row['failures']})"
            )
        return out


def _table(title: str, rows: dict[str, float]) -> None:
    print(f"\n{title}")
    for name, value in rows.items():
        print(f"  {name:<50} {value:10.1f}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
