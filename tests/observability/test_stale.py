"""epp_stale_cache_routing_total: decisions whose predicted cache hit the pod's own
vLLM hit counter did not cover, checked one page after the decision finished; through a
real Router and endpoint store, the pods' pages written by hand."""

from __future__ import annotations

import json

from helpers import router_with
from prometheus_client import CollectorRegistry

from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_parser import PodMetrics
from epp.observability.stale import StaleCacheTracker

PODS = [{"name": "a", "address": "10.0.0.1:8000", "model": "m"}]
BODY = json.dumps({"model": "m", "prompt": "y" * 4000}).encode()  # 1,000 tokens, 62 blocks


def value(counter) -> float:
    return counter._value.get()


class Pod:
    """One pod of a router built by router_with, whose hit counter the test moves."""

    def __init__(self, **sections) -> None:
        self.router, self.store, _, metrics = router_with(PODS, **sections)
        self.stale = metrics.stale
        self.endpoint = self.store.all()[0]
        self.hits = 0.0
        self.page()

    def page(self, hits: float = 0.0) -> None:
        self.hits += hits
        self.store.scraped(self.endpoint, PodMetrics(model="m", prefix_hits=self.hits))

    def route(self, request_id: str = "r", body: bytes = BODY):
        return self.router.route_now(path="/v1/completions", body=body, request_id=request_id)


def test_hits_that_arrive_keep_decisions_fresh_missing_hits_make_them_stale():
    pod = Pod()
    first = pod.route("cold")  # nothing cached yet: no prediction
    pod.router.complete(first, 200)
    pod.page(0)
    warm = pod.route("warm")  # predicts 61 blocks (976 tokens: the last token is computed)
    pod.page(976)  # the pod served them from its cache
    pod.router.complete(warm, 200)
    pod.page(0)  # seen finished
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (0, 0)
    pod.page(0)  # checked on the next page
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (1, 0)

    evicted = pod.route("evicted")  # the pod lost the prefix: no hits come
    pod.router.complete(evicted, 200)
    pod.page(0)
    pod.page(0)
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (2, 1)


def test_half_the_prediction_is_enough_less_is_stale():
    pod = Pod()
    pod.router.complete(pod.route("cold"), 200)
    pod.page()
    for hits, stale in ((500, 0), (470, 1)):  # 976 predicted: 488 is half
        routed = pod.route()
        pod.page(hits)
        pod.router.complete(routed, 200)
        pod.page()
        pod.page()
        assert value(pod.stale.stale) == stale


def test_a_decision_is_not_checked_while_open():
    pod = Pod()
    pod.router.complete(pod.route("cold"), 200)
    pod.page()
    pod.route("long")  # still generating: its hits may come later
    for _ in range(5):
        pod.page()
    assert value(pod.stale.checked) == 0 and pod.stale.pending(pod.endpoint) == 1


def test_hits_go_to_the_oldest_decisions_first_and_surplus_is_dropped():
    pod = Pod()
    pod.router.complete(pod.route("cold"), 200)
    pod.page()
    a, b = pod.route("a"), pod.route("b")
    pod.page(976 + 976 + 5000)  # both covered; the 5,000 extra hits are nobody's
    for routed in (a, b):
        pod.router.complete(routed, 200)
    pod.page()
    pod.page()
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (2, 0)
    c = pod.route("c")  # the surplus is not banked for later decisions
    pod.router.complete(c, 200)
    pod.page()
    pod.page()
    assert value(pod.stale.stale) == 1


def test_an_engine_restart_drops_the_pending_decisions_unchecked():
    pod = Pod()
    pod.router.complete(pod.route("cold"), 200)
    pod.page(100)
    routed = pod.route()
    pod.router.complete(routed, 200)
    pod.hits = 0.0
    pod.page(0)  # the counter went backwards
    pod.page(0)
    pod.page(0)
    assert value(pod.stale.checked) == 0 and pod.stale.dropped == 1


def test_a_removed_pod_is_forgotten():
    pod = Pod()
    pod.router.complete(pod.route("cold"), 200)
    pod.page()
    pod.route()
    pod.store.sync([])
    assert pod.stale.pending(pod.endpoint) == 0 and pod.stale.dropped == 1


def test_predictions_are_capped_as_the_engine_caps_hits():
    tracker = StaleCacheTracker(CollectorRegistry(), max_pending=2)
    pod = Endpoint(name="p", address="10.0.0.1:8000", metrics_url="")
    pod.metrics = PodMetrics(prefix_hits=0)
    tracker.scraped(pod)
    tracker.dispatched(pod, 1, matched_tokens=16, prompt_tokens=16, block_size=16)
    assert tracker.pending(pod) == 0  # a one-block prompt: vLLM computes its last token
    tracker.dispatched(pod, 2, matched_tokens=32, prompt_tokens=33, block_size=16)
    tracker.dispatched(pod, 3, matched_tokens=32, prompt_tokens=33, block_size=16)
    tracker.dispatched(pod, 4, matched_tokens=32, prompt_tokens=33, block_size=16)
    assert tracker.pending(pod) == 2 and tracker.dropped == 1  # bounded per pod
