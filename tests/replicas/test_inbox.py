"""What a peer's messages change here (PeerInbox), and the Router's hooks that feed the
peers (dispatch listeners, route-token prefix, completions of other replicas' decisions)."""

from __future__ import annotations

import json

import pytest
from helpers import config, router_with

from epp.config import DEFAULT_WEIGHTS, PrefillEstimateConfig
from epp.observability.replica_metrics import ReplicaMetrics
from epp.replicas import ReplicaSync
from epp.replicas.inbox import PeerInbox
from epp.replicas.protocol import Completion, Decision, decode
from epp.request import IncomingRequest
from epp.scheduling.scorers.prefill import PrefillCost, PrefillScorer

PODS = [
    {"name": "a", "address": "127.0.0.1:8001", "model": "m"},
    {"name": "b", "address": "127.0.0.1:8002", "model": "m"},
]
SECTIONS = {"scheduling": {"weights": DEFAULT_WEIGHTS}}
COST = PrefillCost.from_config(PrefillEstimateConfig())
BODY = json.dumps({"model": "m", "prompt": "x" * 16_384}).encode()  # 4,096 pseudo-tokens


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def setup(wall: float = 1000.0):
    store_clock = Clock(100.0)
    router, store, index, metrics = router_with(PODS, clock=store_clock, **SECTIONS)
    wall_clock = Clock(wall)
    replica_metrics = ReplicaMetrics(metrics.registry)
    inbox = PeerInbox(
        "me", store, index, router.scheduler, router, replica_metrics,
        block_size=16, max_blocks=8192, max_age_s=1.0, wall_clock=wall_clock,
    )  # fmt: skip
    return inbox, router, store, index, metrics, wall_clock


def hashes_of(router, body: bytes = BODY) -> list[int]:
    return list(
        router.prepare(IncomingRequest(path="/v1/completions", body=body, request_id="x")).hashes
    )


def decision(router, pod: str = "a", at: float = 1000.0, replica: str = "peer", **fields):
    values = dict(
        replica=replica, pod=pod, hashes=hashes_of(router), prompt_tokens=4096, matched=0,
        uncached=4096, at=at,
    )  # fmt: skip
    values.update(fields)
    return Decision(**values)


def received(metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "epp_replica_decisions_received_total", {"outcome": outcome}
    )
    return value or 0.0


def prefill_of(router) -> PrefillScorer:
    scorer = router.scheduler.scorer("prefill")
    assert isinstance(scorer, PrefillScorer)
    return scorer


def test_a_fresh_peer_decision_feeds_the_index_the_load_and_the_prefill_lane():
    inbox, router, store, index, metrics, _ = setup()
    a = store.get("a")
    message = decision(router, at=999.8)  # 0.2 s old by our wall clock
    assert inbox.decision(message) == "applied"
    assert index.match(message.hashes) == {"a": 256}
    assert len(a.peer) == 1 and a.concurrency == 1.0 and a.in_flight == 0
    # The lane starts when the peer dispatched (0.2 s ago on the store's clock).
    assert prefill_of(router).state(a).lane_end == pytest.approx(99.8 + COST.seconds(4096, 0, 16))
    assert received(metrics, "applied") == 1

    # Routing here now sees it: the same prompt goes to the pod the peer chose.
    routed = router.route_now(IncomingRequest(path="/v1/completions", body=BODY, request_id="r"))
    assert routed.endpoint is a and routed.decision.factor("cache") == 1.0


def test_the_lane_is_priced_with_the_match_the_peer_saw():
    inbox, router, store, *_ = setup()
    inbox.decision(decision(router, matched=200, uncached=896))
    expected = 100.0 + COST.seconds(4096, 200, 16)
    assert prefill_of(router).state(store.get("a")).lane_end == pytest.approx(expected)


def test_a_late_decision_feeds_the_index_only():
    inbox, router, store, index, metrics, _ = setup()
    message = decision(router, at=990.0)  # 10 s old: a backlog, or history
    assert inbox.decision(message) == "late"
    assert index.match(message.hashes) == {"a": 256}
    a = store.get("a")
    assert not a.peer and a.concurrency == 0.0
    assert prefill_of(router).state(a).lane_end == 0.0
    assert received(metrics, "late") == 1


def test_a_decision_for_an_unknown_pod_or_from_this_replica_changes_nothing():
    inbox, router, store, index, metrics, _ = setup()
    unknown = decision(router, pod="gone")
    assert inbox.decision(unknown) == "unknown_pod"
    mine = decision(router, replica="me")
    assert inbox.decision(mine) == "self"
    assert index.nodes == 0
    assert all(not e.peer for e in store.all())
    assert received(metrics, "unknown_pod") == 1 and received(metrics, "self") == 1


def test_hashes_beyond_max_blocks_are_not_recorded():
    inbox, router, _store, index, *_ = setup()
    inbox._max_blocks = 10
    message = decision(router)
    inbox.decision(message)
    assert index.blocks("a") == 10


def test_a_forwarded_completion_releases_this_replicas_reservation():
    inbox, router, _store, *_ = setup()
    router.hooks.token_prefix = "me."
    routed = router.route_now(IncomingRequest(path="/v1/completions", body=BODY, request_id="r"))
    assert routed.token.startswith("me.")
    assert routed.endpoint.in_flight == 1
    inbox.completion(Completion("other.123", 200, None))  # not ours: ignored
    assert routed.endpoint.in_flight == 1
    inbox.completion(Completion(routed.token, 200, None))
    assert routed.endpoint.in_flight == 0


# -- the Router's hooks, and ReplicaSync's use of them ----------------------------------
def test_dispatch_listeners_hear_each_decision_and_their_failure_costs_nothing():
    router, _store, *_ = router_with(PODS, **SECTIONS)
    heard = []

    def broken(event, uncached):
        raise RuntimeError("boom")

    router.hooks.shared += [broken, lambda event, uncached: heard.append((event, uncached))]
    routed = router.route_now(IncomingRequest(path="/v1/completions", body=BODY, request_id="r"))
    ((event, uncached),) = heard
    assert event.endpoint is routed.endpoint and uncached == 4096
    assert list(event.request.block_hashes) == hashes_of(router)
    assert routed.endpoint.in_flight == 1  # the request is routed and reserved


def test_a_completion_for_another_replicas_token_goes_to_foreign_completion_only():
    router, *_ = router_with(PODS, **SECTIONS)
    forwarded = []
    router.hooks.token_prefix = "me."
    router.hooks.foreign_completion = lambda *args: forwarded.append(args)
    routed = router.route_now(IncomingRequest(path="/v1/completions", body=BODY, request_id="r"))
    router.complete("peer.abc", 200, "127.0.0.1:8001")
    router.complete("me.unknown", 200)  # ours, long gone: nothing to forward
    router.complete(routed.token, 200)
    assert forwarded == [("peer.abc", 200, "127.0.0.1:8001")]
    assert routed.endpoint.in_flight == 0


async def test_replica_sync_encodes_each_decision_for_its_peers_and_forwards_completions():
    cfg = config(replicas={"peers": ["127.0.0.1:1"], "listen_port": 0}, **SECTIONS)
    router, store, index, metrics = router_with(PODS, **SECTIONS)
    sync = ReplicaSync(
        cfg, store, index, router.scheduler, router, metrics, replica_id="me",
        wall_clock=lambda: 1234.5,
    )  # fmt: skip
    sent: list[bytes] = []
    sync.peers.broadcast = sent.append  # type: ignore[method-assign]
    routed = router.route_now(IncomingRequest(path="/v1/completions", body=BODY, request_id="r"))
    (frame,) = sent
    message = decode(frame[4:])
    assert message == Decision("me", routed.endpoint.name, hashes_of(router), 4096, 0, 4096, 1234.5)
    assert routed.token.startswith("me.")

    targets: list[tuple[str, bytes]] = []
    sync.peers.send_to = lambda rid, f: targets.append((rid, f)) or True  # type: ignore[method-assign]
    router.complete("peer7.abc", 503, None)
    router.complete("nodot", 200, None)  # names no replica: dropped
    ((rid, f),) = targets
    assert rid == "peer7" and decode(f[4:]) == Completion("peer7.abc", 503, None)
    assert metrics.registry.get_sample_value("epp_replica_completions_forwarded_total") == 1
