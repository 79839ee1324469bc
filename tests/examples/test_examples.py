"""The examples of CONTRIBUTING.md ("Add a scorer", "Add a filter"), registered as the
page says (a ScorerRegistry passed to EppService, the scorer's weight in the config) and
run on the Router the service builds (not started: no ports, no scrape loops; the pods
are given one scraped page each, as the scraper would). Each asserts that the example
changes where real requests go."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from examples.filter_example import DrainFilter
from examples.scorer_example import ZoneScorer

from epp.app import EppService
from epp.config import load_config
from epp.datalayer.metrics_parser import PodMetrics
from epp.request import IncomingRequest, RequestRejected
from epp.routing import Router, Saturated
from epp.scheduling.registry import ScorerRegistry

# The five-factor score (config.SPEC_WEIGHTS) with 0.05 taken from cache for the zone
# scorer, as CONTRIBUTING.md gives it; and the same without it.
WEIGHTS = {"cache": 0.55, "load": 0.20, "queue": 0.10, "health": 0.05, "adapter": 0.05,
           "zone": 0.05}  # fmt: skip
WITHOUT_ZONE = {"cache": 0.60, "load": 0.20, "queue": 0.10, "health": 0.05, "adapter": 0.05}


def pod(name: str, port: int, **labels: str) -> dict:
    return {"name": name, "address": f"127.0.0.1:{port}", "model": "m", "labels": labels}


def router_of(registry: ScorerRegistry | None, endpoints: list[dict], **sections: dict) -> Router:
    config = load_config(None, {"endpoints": endpoints, **sections})
    service = EppService(config, registry=registry)
    service.store.sync(config.endpoints)  # what start() does with static endpoints
    for endpoint in service.store.all():
        service.store.scraped(endpoint, PodMetrics(model="m"))
    return service.router


def body(i: int) -> bytes:
    return json.dumps({"model": "m", "prompt": f"question {i}: " + "words " * 40}).encode()


async def served_by(router: Router, n: int, *, complete: bool = True) -> Counter[str]:
    """Route n distinct requests one after another; the pods that got them."""
    pods: Counter[str] = Counter()
    for i in range(n):
        routed = await router.route(
            IncomingRequest(path="/v1/completions", body=body(i), request_id=f"r{i}")
        )
        pods[routed.endpoint.name] += 1
        if complete:
            router.complete(routed.token, 200)
    return pods


ZONES = [pod("east-0", 8001, zone="east"), pod("west-0", 8002, zone="west")]


def zone_registry() -> ScorerRegistry:
    registry = ScorerRegistry()
    registry.register("zone", lambda config: ZoneScorer(zone="east"))
    return registry


async def test_the_zone_scorer_keeps_requests_in_the_epps_zone():
    router = router_of(zone_registry(), ZONES, scheduling={"weights": WEIGHTS})
    assert router.scheduler.weights["zone"] == 0.05
    assert await served_by(router, 20) == {"east-0": 20}


async def test_without_the_zone_scorer_the_same_requests_use_both_zones():
    router = router_of(None, ZONES, scheduling={"weights": WITHOUT_ZONE})
    assert set(await served_by(router, 20)) == {"east-0", "west-0"}


async def test_a_registered_scorer_without_a_weight_is_not_built():
    router = router_of(zone_registry(), ZONES)  # default weights: no `zone`
    assert router.scheduler.scorer("zone") is None
    assert set(await served_by(router, 20)) == {"east-0", "west-0"}


DRAINING = [pod("a", 8001, drain="true"), pod("b", 8002), pod("c", 8003, drain="false")]


def drain_registry() -> ScorerRegistry:
    registry = ScorerRegistry()
    registry.add_filter(lambda config: DrainFilter())
    return registry


async def test_the_drain_filter_sends_nothing_to_a_draining_pod():
    router = router_of(drain_registry(), DRAINING)
    assert set(await served_by(router, 30)) == {"b", "c"}
    control = router_of(None, DRAINING)
    assert "a" in await served_by(control, 30)


async def test_every_pod_draining_is_the_filters_refusal():
    router = router_of(drain_registry(), [pod("a", 8001, drain="true")])
    with pytest.raises(RequestRejected) as refused:
        await served_by(router, 1)
    assert (refused.value.status, refused.value.reason) == (503, "rejected-draining")


def test_an_added_filter_runs_before_saturation():
    """The only pod that may serve is full: the request waits for it (429 Saturated, flow
    control's to hold), whatever the drain filter says of the idle draining pod."""
    one_slot = {"max_queue": 1, "running_slots": 1}  # 1 running + 1 queued: full
    router = router_of(
        drain_registry(), DRAINING[:2], scheduling=one_slot, flow_control={"enabled": False}
    )
    for i in range(2):
        assert (
            router.route_now(
                IncomingRequest(path="/v1/completions", body=body(i), request_id=f"r{i}")
            ).endpoint.name
            == "b"
        )
    with pytest.raises(Saturated) as refused:
        router.route_now(IncomingRequest(path="/v1/completions", body=body(2), request_id="r2"))
    assert refused.value.status == 429


def test_contributing_quotes_the_examples_as_they_are_tested():
    """The page shows the code this file runs: each example after its `__future__`
    import, and the registration lines used above."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "CONTRIBUTING.md").read_text()
    for name in ("scorer_example.py", "filter_example.py"):
        source = (Path(__file__).parent / name).read_text()
        code = source[source.index("\n\n", source.index("from __future__")) + 2 :]
        assert code.rstrip() in page, name
    this = Path(__file__).read_text()
    for line in (
        'registry.register("zone", lambda config: ZoneScorer(zone="east"))',
        "registry.add_filter(lambda config: DrainFilter())",
        "service = EppService(config, registry=registry)",
    ):
        assert line in page, line
        assert this.count(line) >= 2, line  # here in the tuple, and where it is run


def test_added_filters_run_in_the_order_added_between_health_and_saturation():
    from dataclasses import replace

    from epp.config import SchedulingConfig
    from epp.scheduling.scheduler import Scheduler

    registry = drain_registry()
    registry.add_filter(lambda config: replace(DrainFilter(), name="second"))
    names = [f.name for f in Scheduler(SchedulingConfig(), registry).filters]
    assert names[:6] == ["subset", "model", "health", "drain", "second", "saturation"]
    assert [f.name for f in Scheduler(SchedulingConfig()).filters][:4] == [
        "subset", "model", "health", "saturation",
    ]  # fmt: skip
