"""epp_stale_cache_routing_total: decisions whose predicted cache hit the pod's own
vLLM hit counter did not cover, checked one page after the decision finished; through a
real Router and endpoint store, the pods' pages written by hand."""

from __future__ import annotations

import json

import pytest
from helpers import router_with
from prometheus_client import CollectorRegistry

from epp.datalayer.endpoint import Dispatch, Endpoint
from epp.datalayer.metrics_parser import PodMetrics
from epp.observability.stale import StaleCacheTracker
from epp.request import IncomingRequest

PODS = [{"name": "a", "address": "10.0.0.1:8000", "model": "m"}]
BODY = json.dumps({"model": "m", "prompt": "y" * 4000}).encode()  # 1,000 tokens, 62 blocks


def value(counter) -> float:
    return counter._value.get()


class Pod:
    """One pod of a router built by router_with, whose hit counter the test moves (and,
    with `engine_tokens`, the prompt tokens of the requests it finished, as a pod whose
    tokenizer counts `engine_tokens` tokens per EPP token reports them)."""

    def __init__(self, engine_tokens: float | None = None, **sections) -> None:
        # A store clock that does not move: no request is released by time.
        self.router, self.store, _, metrics = router_with(PODS, clock=lambda: 0.0, **sections)
        self.stale = metrics.stale
        self.endpoint = self.store.all()[0]
        self.engine_tokens = engine_tokens
        self.hits = 0.0
        self.finished = 0.0
        self.requests = 0
        self.page()

    def page(self, hits: float = 0.0, finished: int = 0, start_time: float | None = None) -> None:
        """A page after the pod served `hits` more tokens from its cache and finished
        `finished` more requests of 1,000 EPP tokens; `start_time`: its server's."""
        self.hits += hits
        factor = self.engine_tokens
        self.finished += finished * 1000 * (factor or 0)
        self.requests += finished
        metrics = PodMetrics(
            model="m",
            prefix_hits=self.hits,
            finished_requests=self.requests if factor else None,
            finished_prompt_tokens=self.finished if factor else None,
            start_time=start_time,
        )
        self.store.scraped(self.endpoint, metrics)

    def route(self, request_id: str = "r", body: bytes = BODY):
        return self.router.route_now(
            IncomingRequest(path="/v1/completions", body=body, request_id=request_id)
        )


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


def test_a_pod_whose_page_has_no_hit_counter_is_never_checked():
    """SGLang's or Triton's page has no vLLM prefix-cache counter: no hit is ever seen, and
    counting its decisions would call every predicted hit stale."""
    pod = Pod()
    for name in ("cold", "warm", "again"):
        routed = pod.route(name)
        pod.router.complete(routed, 200)
        for _ in range(3):
            pod.store.scraped(pod.endpoint, PodMetrics(model="m", prefix_counters=False))
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (0, 0)
    assert pod.stale.pending(pod.endpoint) == 0


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


def test_hits_beyond_a_prediction_do_not_cover_a_later_decision_the_pod_could_not_serve():
    """The flake of tests/e2e/test_prometheus_e2e.py, made deterministic. The pod counts
    1.3 tokens per EPP token (the simulator's tokenizer against the byte estimate on chat
    prompts; a real vLLM's is 2.1-2.4), so each decision that hit brings 30% more hits
    than its prediction. Unconverted, that surplus went to the next queued decision:
    `c` took it on page A before its own hits came, so on page B `c` needed little and
    `d`, which the pod could not serve (its cache was reset), was covered."""
    pod = Pod(engine_tokens=1.3)
    pod.router.complete(pod.route("cold"), 200)  # no prediction: counts in the ratio only
    pod.page(finished=1)
    a, b, c = pod.route("a"), pod.route("b"), pod.route("c")  # each predicts 976 tokens
    for routed in (a, b):
        pod.router.complete(routed, 200)
    pod.page(hits=2 * 976 * 1.3, finished=2)  # page A: a's and b's hits; c still open
    # The pod's cache is reset behind the EPP's back; `d` still predicts a full hit.
    d = pod.route("d")
    pod.router.complete(c, 200)
    pod.page(hits=976 * 1.3, finished=1)  # page B: c's hits (computed before the reset)
    pod.router.complete(d, 200)
    pod.page(finished=1)  # d: no hits at all
    pod.page()
    assert pod.stale.ratio(pod.endpoint) == pytest.approx(1 / 1.3)
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (4, 1)


def test_the_pods_token_ratio_converts_hits_so_a_full_hit_is_never_stale():
    """A pod counting 2.3 tokens per EPP token (a real vLLM's tokenizer against the byte
    estimate) whose hits cover exactly what the EPP predicted: none stale, and a miss
    among them is stale even though its neighbours' hits arrive on the same page."""
    pod = Pod(engine_tokens=2.3)
    pod.router.complete(pod.route("cold"), 200)
    pod.page(finished=1)
    hit1, missed, hit2 = pod.route("1"), pod.route("missed"), pod.route("2")
    for routed in (hit1, missed, hit2):
        pod.router.complete(routed, 200)
    pod.page(hits=2 * 976 * 2.3, finished=3)
    pod.page()
    # Oldest first: hit1 and the miss take the page's hits, hit2 lacks them. Aggregates
    # cannot tell which of the three missed, only that one did.
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (3, 1)


def test_without_the_prompt_histogram_hits_count_one_for_one():
    """An old vLLM without `vllm:request_prompt_tokens`: the ratio stays 1."""
    pod = Pod()
    pod.router.complete(pod.route("cold"), 200)
    pod.page()
    pod.router.complete(pod.route("warm"), 200)
    pod.page(hits=500)
    pod.page()
    assert pod.stale.ratio(pod.endpoint) == 1.0
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (1, 0)


def test_a_restart_reported_by_the_store_drops_the_pending_decisions():
    """The store's `reset` (counters back, or a new process start time even with counters
    that grew): the queued decisions are dropped unchecked."""
    pod = Pod()
    pod.router.complete(pod.route("cold"), 200)
    pod.page(start_time=100.0)
    routed = pod.route()
    pod.router.complete(routed, 200)
    pod.page(hits=5000, start_time=200.0)  # restarted: the hits are the new process's
    pod.page(start_time=200.0)
    assert value(pod.stale.checked) == 0 and pod.stale.dropped == 1


def test_the_ratio_counts_requests_the_pod_finished_before_the_epp_heard_of_their_end():
    """The pod's page can show a request finished before its end reaches the EPP (through
    Envoy's observer stream, later under load). The EPP's side of the ratio follows the
    pod's count, not what the EPP has seen end: otherwise the ratio read too low, and a
    hit seemed stale (seen in the e2e test: 4 stale of 3)."""
    pod = Pod(engine_tokens=1.3)
    pod.router.complete(pod.route("cold"), 200)
    pod.page(finished=1)
    a, b = pod.route("a"), pod.route("b")
    pod.page(hits=2 * 976 * 1.3, finished=2)  # both over at the pod, neither heard of yet
    for routed in (a, b):
        pod.router.complete(routed, 200)
    pod.page()
    pod.page()
    assert pod.stale.ratio(pod.endpoint) == pytest.approx(1 / 1.3)
    assert (value(pod.stale.checked), value(pod.stale.stale)) == (2, 0)


def test_a_decision_the_pods_first_page_already_counts_is_not_matched_again():
    """A request routed before the pod's first page, over at the pod by then (its count
    has it) though the EPP has not heard of its end: the next request the pod finishes
    is matched with the next decision, not with that one."""
    tracker = StaleCacheTracker(CollectorRegistry())
    pod = Endpoint(name="p", address="10.0.0.1:8000", metrics_url="")

    def page(requests: int, tokens: float) -> None:
        pod.metrics = PodMetrics(finished_requests=requests, finished_prompt_tokens=tokens)
        tracker.scraped(pod)

    pod.open[1] = Dispatch(1, 100, 0.0)
    tracker.dispatched(pod, 1, matched_tokens=0, prompt_tokens=100, block_size=16)
    page(1, 130)  # the pod's first page: the request is over there
    del pod.open[1]  # the EPP hears of its end
    pod.open[2] = Dispatch(2, 1000, 0.0)
    tracker.dispatched(pod, 2, matched_tokens=0, prompt_tokens=1000, block_size=16)
    del pod.open[2]
    page(2, 130 + 1300)
    assert tracker.ratio(pod) == pytest.approx(1 / 1.3)


def test_a_decision_the_pod_never_counts_does_not_shift_the_ratio_for_good():
    """A request routed without a prompt (the EPP counts 0 tokens; the pod's prompt
    histogram never has it) and one the pod refused: the pod's next finished requests
    are matched with the EPP's decisions they belong to once those are seen over."""
    tracker = StaleCacheTracker(CollectorRegistry())
    pod = Endpoint(name="p", address="10.0.0.1:8000", metrics_url="")
    pod.metrics = PodMetrics(finished_requests=0, finished_prompt_tokens=0)
    tracker.scraped(pod)
    sizes = {1: 0, 2: 50, 3: 1000, 4: 1000}  # 1: no prompt; 2: refused by the pod
    for seq, prompt in sizes.items():
        tracker.dispatched(pod, seq, matched_tokens=0, prompt_tokens=prompt, block_size=16)
    pod.metrics = PodMetrics(finished_requests=1, finished_prompt_tokens=1300)  # 3 is over
    tracker.scraped(pod)
    pod.metrics = PodMetrics(finished_requests=2, finished_prompt_tokens=2600)  # and 4
    tracker.scraped(pod)
    tracker.scraped(pod)  # all seen over a page ago
    # The refused request's 50 tokens are the only error left: (50 + 2000) / 2600.
    assert tracker.ratio(pod) == pytest.approx(2050 / 2600)
