"""What one `/debug/index?pod=` request costs the event loop that routes: the longest stall
a ticker task sees while the page is served over real HTTP on 127.0.0.1, for one pod's
map of engine blocks (the default capacity, 31,250, and 100,000).

- **whole**: the page as it was (every engine block hash, sorted and formatted at once);
- **paged**: `epp.observability.debug_pages` (at most `limit` hashes, the map read in
  slices with the loop free in between), at its default and its largest limit.

    .venv/bin/python -m epp_bench.picker.debug_index
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import urllib.request
from collections.abc import Callable

from aiohttp import web

from epp.observability.debug_pages import DEFAULT_LIMIT, MAX_LIMIT, debug_routes
from epp.prefix.engine_map import EngineMap

SIZES = (31_250, 100_000)
REPEATS = 5


def engine_map(size: int) -> EngineMap:
    rng = random.Random(size)
    engine = EngineMap(size)
    while len(engine) < size:
        engine.add(rng.getrandbits(64), rng.getrandbits(64))
    return engine


def whole_page(engine: EngineMap) -> web.RouteDef:
    async def page(_: web.Request) -> web.Response:
        hashes = sorted(f"{h:016x}" for h in engine.hashes())
        return web.json_response({"pod": "p", "engine_blocks": hashes})

    return web.get("/whole", page)


async def longest_stall(url: str) -> float:
    """The longest gap between two turns of a ticker while `url` is fetched, in ms."""
    stop = asyncio.Event()
    worst = 0.0

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    worst = 0.0
    await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read())
    stop.set()
    await task
    return worst * 1000


async def measure(size: int) -> dict[str, float]:
    engine = engine_map(size)
    count: Callable[[str], tuple[int, object]] = lambda pod: (len(engine), engine.hash_slices())  # noqa: E731
    app = web.Application()
    app.add_routes(
        [
            whole_page(engine),
            *debug_routes(lambda: [], lambda: ["p"], lambda pod: {}, count),  # type: ignore[arg-type]
        ]
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    urls = {
        "whole": f"{base}/whole",
        f"paged limit={DEFAULT_LIMIT}": f"{base}/debug/index?pod=p",
        f"paged limit={MAX_LIMIT}": f"{base}/debug/index?pod=p&limit={MAX_LIMIT}",
    }
    out: dict[str, float] = {}
    try:
        for name, url in urls.items():
            out[name] = min([await longest_stall(url) for _ in range(REPEATS)])
    finally:
        await runner.cleanup()
    return out


async def main() -> None:
    results = {size: await measure(size) for size in SIZES}
    json.dump(
        {str(k): {n: round(v, 1) for n, v in r.items()} for k, r in results.items()}, sys.stdout
    )
    print()
    for size, row in results.items():
        cells = ", ".join(f"{name} {ms:.1f} ms" for name, ms in row.items())
        print(f"{size:>7} engine blocks: longest loop stall: {cells}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
