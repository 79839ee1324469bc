"""Predicted entries on a precise pod live while their request is in flight, then
`predicted_ttl_s`, and never past `predicted_max_s` from dispatch (index.py). The clock is
the test's; nothing sleeps."""

from __future__ import annotations

import pytest

from epp.config import EndpointConfig, EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.prefix.hashing import BlockHash
from epp.prefix.index import PrefixIndex
from epp.prefix.kv_events import KvEventStats
from epp.prefix.precise import PreciseIndex
from epp.request import IncomingRequest
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.wiring import connect

A = [BlockHash(1), BlockHash(2), BlockHash(3)]
B = [BlockHash(1), BlockHash(2), BlockHash(4)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def precise_index(ttl: float = 2.0, max_s: float = 60.0) -> tuple[PrefixIndex, Clock]:
    clock = Clock()
    index = PrefixIndex(1000, predicted_ttl_s=ttl, predicted_max_s=max_s, clock=clock)
    index.set_precise("a", True)
    return index, clock


def test_an_in_flight_prediction_outlives_the_ttl():
    index, clock = precise_index()
    index.record("a", A, token="r1")
    clock.now = 30.0  # queued far longer than the TTL
    assert index.match(A) == {"a": 3}
    assert index.predictions == 1


def test_a_prediction_goes_the_ttl_after_its_request_ended():
    index, clock = precise_index()
    index.record("a", A, token="r1")
    clock.now = 10.0
    index.completed("r1", 10.0)
    clock.now = 11.9
    assert index.match(A) == {"a": 3}
    clock.now = 12.0
    assert index.match(A) == {}
    assert index.blocks("a") == 0
    assert index.predictions == 0
    assert index.predictions_capped == 0


def test_without_a_token_a_prediction_lives_the_ttl_from_dispatch():
    index, clock = precise_index()
    index.record("a", A)  # a peer replica's decision: its end is not seen here
    clock.now = 1.9
    assert index.match(A) == {"a": 3}
    clock.now = 2.0
    assert index.match(A) == {}


def test_a_completion_that_never_comes_is_capped_by_predicted_max_s():
    index, clock = precise_index(max_s=60.0)
    index.record("a", A, token="lost")
    clock.now = 59.9
    assert index.match(A) == {"a": 3}
    clock.now = 60.0
    assert index.match(A) == {}
    assert index.predictions_capped == 1
    assert index.predictions == 0
    index.completed("lost", 61.0)  # late: nothing left to do
    assert index.blocks("a") == 0
    # Operators see it on the EPP's page.
    metrics = EppMetrics()
    metrics.watch_kv_events(KvEventStats(), dict, lambda: index.predictions_capped)
    assert "epp_predicted_entries_capped_total 1.0" in metrics.exposition().decode()


def test_the_cap_also_bounds_the_ttl_after_a_late_completion():
    index, clock = precise_index(ttl=2.0, max_s=10.0)
    index.record("a", A, token="r1")
    index.completed("r1", 9.0)  # 9 + 2 is past the deadline at 10
    clock.now = 10.0
    assert index.match(A) == {}
    assert index.predictions_capped == 0  # it had ended: not a lost completion


def test_a_block_lives_as_long_as_the_last_request_predicting_it():
    index, clock = precise_index()
    index.record("a", A, token="first")
    index.record("a", B, token="second")  # shares blocks 1 and 2
    index.completed("first", 1.0)
    clock.now = 5.0  # the first one's TTL is over; the second is still queued
    assert index.match(A) == {"a": 2}
    assert index.match(B) == {"a": 3}
    index.completed("second", 5.0)
    clock.now = 7.0
    assert index.match(B) == {}
    assert index.blocks("a") == 0


def test_an_event_makes_a_prediction_a_reported_entry_that_never_expires():
    index, clock = precise_index()
    index.record("a", A, token="r1")
    index.store_engine_blocks("a", [101, 102], A[:2], 1)  # the engine started it
    assert index.reported("a", A[0]) and not index.reported("a", A[2])
    index.completed("r1", 1.0)
    clock.now = 100.0
    assert index.match(A) == {"a": 2}  # the two reported ones stay
    assert index.blocks("a") == 2


def test_an_old_prediction_never_drops_an_entry_predicted_anew():
    index, clock = precise_index()
    index.record("a", A, token="old")
    # Confirmed, then evicted by the engine, then predicted again by a later request.
    index.store_engine_blocks("a", [101], A[:1], 1)
    index.remove_engine_blocks("a", [101])
    index.record("a", A[:1], token="new")
    index.completed("old", 1.0)
    clock.now = 4.0
    assert index.match(A) == {"a": 1}  # block 1 is the new request's
    index.completed("new", 4.0)
    clock.now = 6.0
    assert index.match(A) == {}


@pytest.mark.parametrize("how", ["clear", "remove"])
def test_a_reset_or_removed_pod_keeps_no_prediction_of_an_open_request(how: str):
    index, clock = precise_index()
    index.record("a", A, token="before")
    if how == "clear":
        index.clear_pod("a")
    else:
        index.remove_pod("a")
        index.set_precise("a", True)
    assert index.match(A) == {}
    index.record("a", A[:2], token="after")
    index.completed("before", 1.0)  # the earlier request ends: not the new predictions
    clock.now = 10.0
    assert index.match(A) == {"a": 2}
    assert index.blocks("a") == 2


def test_released_predictions_do_not_pile_up_while_others_stay_in_flight():
    index, clock = precise_index(ttl=1.0, max_s=3600.0)
    index.record("a", A, token="slow")  # in flight the whole time
    for n in range(20_000):
        clock.now = n * 0.01
        index.record("a", [BlockHash(1000 + n)], token=f"r{n}")
        index.completed(f"r{n}", clock.now)
        index.match(A)
    assert index.predictions <= 102  # the slow one and the last second's
    # Bounded by what is live, not by the request rate x predicted_max_s.
    assert len(index._predictions.in_flight) <= 4 * index.predictions + 1024
    assert index.match(A) == {"a": 3}


# -- through the Router: the completion listener carries the request's end ---------------


def precise_router(clock: Clock) -> tuple[Router, PrefixIndex]:
    cfg = EppConfig.model_validate({"kv_events": {"predicted_ttl_s": 2.0}})
    store = EndpointStore.for_config(cfg, clock)
    store.sync([EndpointConfig.model_validate({"name": "a", "address": "10.0.0.1:8000"})])
    for endpoint in store.all():
        store.scraped(endpoint, PodMetrics(model="m"))
    kv = cfg.kv_events
    index = PrefixIndex.from_config(
        cfg.prefix,
        predicted_ttl_s=kv.predicted_ttl_s,
        predicted_max_s=kv.predicted_max_s,
        clock=clock,
    )
    scheduler = Scheduler(cfg.scheduling)
    router = Router(cfg, store, index, scheduler, ByteEstimateTokenizer(), EppMetrics())
    connect(store, index, router, cfg)
    precise = PreciseIndex(index, cfg.prefix.block_size)
    precise.attach("a", "m")
    # As epp.wiring.connect wires precise mode.
    router.hooks.before_record.append(precise.dispatched)
    router.hooks.completed.append(precise.completed)
    return router, index


BODY = b'{"model": "m", "prompt": "' + b"the same long prompt " * 40 + b'"}'


@pytest.mark.parametrize("status", [200, 503, None], ids=["answered", "failed", "cancelled"])
def test_the_router_keeps_a_prediction_until_its_request_ends(status: int | None):
    clock = Clock()
    router, index = precise_router(clock)
    routed = router.route_now(IncomingRequest(path="/v1/completions", body=BODY, request_id="r1"))
    blocks = index.blocks("a")
    assert blocks > 0
    clock.now = 30.0  # still in flight, long past the TTL
    assert index.blocks("a") == blocks
    assert index.match(index_keys(router, index)) == {"a": blocks}
    router.complete(routed, status)
    clock.now = 31.9
    assert index.match(index_keys(router, index)) == {"a": blocks}
    clock.now = 32.0
    assert index.match(index_keys(router, index)) == {}
    assert index.predictions_capped == 0


def index_keys(router: Router, index: PrefixIndex) -> list[BlockHash]:
    prepared = router.prepare(
        IncomingRequest(path="/v1/completions", body=BODY, request_id="probe")
    )
    return prepared.hashes


def test_the_maximum_must_cover_the_ttl():
    with pytest.raises(ValueError, match="predicted_max_s"):
        EppConfig.model_validate({"kv_events": {"predicted_ttl_s": 30, "predicted_max_s": 10}})
    with pytest.raises(ValueError, match="predicted_max_s"):
        PrefixIndex(10, predicted_ttl_s=30.0, predicted_max_s=10.0)
    assert EppConfig().kv_events.predicted_max_s == 120.0
