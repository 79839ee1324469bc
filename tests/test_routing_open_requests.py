"""Accounting of open requests at scale: what an open request keeps, and what the
maintenance round and a pod's removal visit.

An open request keeps only what its completion needs (never its decision, whose scores
grow with the pod count, nor the parsed request); the round that forgets the reservations
the store dropped visits each pod with open requests once plus what was dropped, not every
open request; a removed pod's open requests are found without looking at the others'.

The work is counted, not timed: a line tracer counts the lines the accounting module runs
(a loop's body counts once per pass), so a walk over every open request shows up whatever
the machine's load.
"""

from __future__ import annotations

import json
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from helpers import router_with

import epp.routing.accounting
from epp.config import EndpointConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.request import IncomingRequest

ACCOUNTING = str(Path(epp.routing.accounting.__file__).resolve())
TTL = 150.0


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pods(n: int) -> list[dict]:
    return [
        {"name": f"p{i}", "address": f"10.0.{i // 250}.{i % 250}:8000", "model": "m"}
        for i in range(n)
    ]


def chat(i: int) -> bytes:
    # Distinct short chats: the prompt and its blocks are small, the decision is not.
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}).encode()


def route(router, i: int):
    return router.route_now(
        IncomingRequest(path="/v1/chat/completions", body=chat(i), request_id=f"r{i}")
    )


@contextmanager
def lines_run_in_accounting() -> Iterator[list[int]]:
    """Counts the lines the accounting module runs inside the block (one per line event:
    a loop's body, a comprehension's pass)."""
    count = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Callable | None:
        if event == "line":
            count[0] += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable | None:
        if event == "call" and frame.f_code.co_filename == ACCOUNTING:
            return local
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield count
    finally:
        sys.settrace(previous)


def test_an_open_request_keeps_a_few_hundred_bytes_not_its_decision():
    """At 200 pods a decision holds ~1,000 scores (one list of 200 per scorer, the
    totals): kept per open request that was 34 KB. What an open request keeps is now what
    its completion frees: measured by tracemalloc as the memory the completions of 2,000
    open requests give back."""
    router, store, *_ = router_with(pods(200))
    n = 2000
    tracemalloc.start()
    try:
        tokens = [route(router, i).token for i in range(n)]
        held = tracemalloc.get_traced_memory()[0]
        for token in tokens:
            router.complete(token, 200)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert sum(e.in_flight for e in store.all()) == 0
    per_request = (held - after) / n
    assert 0 < per_request < 4096, f"{per_request:.0f} bytes per open request"


def test_the_round_visits_the_pods_and_what_was_dropped_not_every_open_request():
    clock = Clock(100.0)
    router, *_ = router_with(pods(20), clock=clock, datalayer={"in_flight_ttl_s": TTL})
    for i in range(200):
        route(router, i)
    with lines_run_in_accounting() as few:
        router.tick()
    for i in range(200, 2000):
        route(router, i)
    with lines_run_in_accounting() as many:
        router.tick()
    # Ten times the open requests, the same pods: the same work.
    assert many[0] == few[0], (few[0], many[0])
    assert many[0] < 20 * 10, many[0]


def test_the_round_forgets_exactly_the_reservations_the_ttl_dropped():
    clock = Clock(100.0)
    router, store, *_ = router_with(pods(20), clock=clock, datalayer={"in_flight_ttl_s": TTL})
    old = [route(router, i) for i in range(300)]
    clock.now = 200.0
    young = [route(router, i) for i in range(300, 2300)]
    clock.now = 100.0 + TTL + 1.0  # the first 300 expire, the last 2,000 do not
    store.refresh_health()
    with lines_run_in_accounting() as visited:
        router.tick()
    # The 20 pods once each and the 300 dropped (a few lines each): not the 2,000 others.
    assert visited[0] < 20 * 6 + 300 * 6, visited[0]
    for routed in old:  # forgotten: their completion changes nothing
        router.complete(routed.token, 500)
    assert all(e.error_rate == 0.0 for e in store.all())
    assert sum(e.in_flight for e in store.all()) == 2000
    for routed in young:  # still open: released, and their status counted
        router.complete(routed.token, 500)
    assert sum(e.in_flight for e in store.all()) == 0
    assert all(e.error_rate > 0.0 for e in {r.endpoint for r in young})


def test_the_round_forgets_the_reservations_a_page_showed_over():
    clock = Clock(100.0)
    router, store, *_ = router_with(pods(1), clock=clock)
    pod = store.get("p0")
    sent = [route(router, i) for i in range(3)]
    clock.now = 110.0
    # The page shows one request: the pod finished the two oldest (ledger.reconcile).
    store.scraped(pod, PodMetrics(model="m", running=1.0))
    assert list(pod.open) == [sent[2].dispatch]
    router.tick()
    router.complete(sent[0].token, 500)
    router.complete(sent[1].token, 500)
    assert pod.error_rate == 0.0  # forgotten: nothing counted
    router.complete(sent[2].token, 500)
    assert pod.error_rate > 0.0 and pod.in_flight == 0


def test_removing_a_pod_visits_only_its_own_open_requests():
    router, store, *_ = router_with(pods(20))
    routed = [route(router, i) for i in range(2000)]
    gone = store.get("p7")
    own = [r for r in routed if r.endpoint is gone]
    assert 0 < len(own) < 400
    keep = [EndpointConfig.model_validate(p) for p in pods(20) if p["name"] != "p7"]
    with lines_run_in_accounting() as visited:
        store.sync(keep)
    assert visited[0] < 20 + 6 * len(own), (visited[0], len(own))
    # Its requests are forgotten; every other one still completes.
    for r in own:
        router.complete(r.token, 500)
    assert gone.error_rate == 0.0
    for r in routed:
        if r.endpoint is not gone:
            router.complete(r.token, 200)
    assert sum(e.in_flight for e in store.all()) == 0
