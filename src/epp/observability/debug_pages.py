"""The debug pages: `/debug/endpoints` (each pod's state) and `/debug/index?pod=` (a pod's
index), as aiohttp routes.

They show which pods hold which prefixes, and a page over a pod's whole index costs work
on the routing loop, so they are not for anyone who can reach the metrics port. The
service serves them on a loopback address only (`server.debug_host`, `debug_port`; see
EppService): from inside the pod, or `kubectl port-forward`.

`/debug/index` is bounded work: the counts, and at most `limit` engine block hashes (hex,
ascending) above `after`, chosen while the map is read in slices with the loop free in
between (`EngineMap.hash_slices`). `next` is the `after` of the following page (absent
on the last one). Sorting and formatting a whole pod's index at once would hold the
routing loop for about 27 ms a call.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web

from epp.addresses import unbracket

DEFAULT_LIMIT = 1000
MAX_LIMIT = 10_000


class _BadQuery(ValueError):
    pass


def _query_int(request: web.Request, name: str, default: int, base: int = 10) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw, base)
    except ValueError:
        raise _BadQuery(f"{name} must be an integer, got {raw[:40]!r}") from None


async def smallest_after(
    slices: Iterator[list[int]], after: int, limit: int
) -> tuple[list[int], bool]:
    """The `limit` smallest values above `after`, ascending, and whether more exist; the
    loop runs between slices. Once `limit` are held, only values below the largest held
    are looked at again (`cutoff`)."""
    best: list[int] = []
    more = False
    cutoff: int | None = None  # set once `best` is full: its largest value
    for piece in slices:
        if cutoff is None:
            above = [h for h in piece if h > after]
        else:
            above = [h for h in piece if after < h < cutoff]
            more = more or len(above) < sum(1 for h in piece if h > after)
        if above:
            best = sorted(best + above) if best else sorted(above)
            if len(best) > limit:
                more = True
                del best[limit:]
            if len(best) == limit and limit:
                cutoff = best[-1]
        await asyncio.sleep(0)
    return best, more


def debug_routes(
    endpoints: Callable[[], list[dict[str, Any]]],
    pods: Callable[[], list[str]],
    pod_index: Callable[[str], dict[str, Any]],
    engine_block_slices: Callable[[str], tuple[int, Iterator[list[int]]]],
) -> list[web.RouteDef]:
    """`endpoints()`: the /debug/endpoints rows; `pod_index(pod)`: a pod's counts (mode,
    blocks, capacity); `engine_block_slices(pod)`: (count, hash slices)."""

    async def endpoints_page(_: web.Request) -> web.Response:
        return web.json_response(endpoints())

    async def index_page(request: web.Request) -> web.Response:
        pod = request.query.get("pod", "")
        if pod not in pods():
            return web.json_response({"error": f"unknown pod {pod[:100]!r}"}, status=404)
        try:
            limit = _query_int(request, "limit", DEFAULT_LIMIT)
            after = _query_int(request, "after", -1, base=16)
        except _BadQuery as bad:
            return web.json_response({"error": str(bad)}, status=400)
        if not 0 <= limit <= MAX_LIMIT:
            return web.json_response({"error": f"limit must be 0..{MAX_LIMIT}"}, status=400)
        total, slices = engine_block_slices(pod)
        page, more = await smallest_after(slices, after, limit) if limit else ([], total > 0)
        body = {
            "pod": pod,
            **pod_index(pod),
            "engine_blocks_total": total,
            "engine_blocks": [f"{h:016x}" for h in page],
            "limit": limit,
        }
        if more and page:
            body["next"] = f"{page[-1]:016x}"
        return web.json_response(body)

    return [web.get("/debug/endpoints", endpoints_page), web.get("/debug/index", index_page)]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(unbracket(host)).is_loopback
    except ValueError:
        return host == "localhost"
