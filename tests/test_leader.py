"""Leader election (epp/leader.py) against the Kubernetes API stand-in (tests/kube_standin.py:
no API server runs here, so its Lease get/create/update with resourceVersion conflicts are
a fake), through the real `kubernetes` client over HTTP. Each elector's rounds (`tick`)
are driven by hand on an injected clock: controller-runtime's default timings (15 s lease,
10 s renew deadline, 2 s retry) run in milliseconds and every step is exact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kube_standin import KubeStandIn, running
from kubernetes import client as k8s

from epp.datalayer.kubernetes_resources import LEASE
from epp.leader import (
    KubernetesLeases,
    LeaderElectionError,
    LeaderElector,
    LeaseTimings,
    holder_identity,
    lease_name,
)

NS = "inference"
NAME = lease_name(NS, "pool")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def standin() -> Iterator[KubeStandIn]:
    with running() as s:
        yield s


def elector(standin: KubeStandIn, clock: Clock, who: str, changes: list | None = None):
    api = KubernetesLeases(k8s.ApiClient(k8s.Configuration(host=standin.url)))
    on_change = None if changes is None else (lambda leader: changes.append((who, leader)))
    return LeaderElector(api, NS, NAME, who, clock=clock, on_change=on_change)


def test_lease_name_and_identity_as_upstream():
    # llm-d router v0.10.0 controller_manager.go: epp-<namespace>-<pool>.llm-d.ai
    assert lease_name("llm-d", "qwen") == "epp-llm-d-qwen.llm-d.ai"
    # Standalone: the Deployment's name from the Pod's (runner.go extractDeploymentName).
    assert lease_name("ns", None, "qwen-epp-7d9f8b6c4-x2x9z") == "epp-ns-qwen-epp.llm-d.ai"
    with pytest.raises(LeaderElectionError, match="POD_NAME"):
        lease_name("ns", None, None)
    a, b = holder_identity("epp-0"), holder_identity("epp-0")
    assert a.startswith("epp-0_") and a != b  # a restart is a new holder
    with pytest.raises(ValueError):
        LeaseTimings(lease_duration_s=10, renew_deadline_s=10)


def test_exactly_one_leader_and_the_lease_it_writes(standin: KubeStandIn):
    clock, changes = Clock(), []
    a, b = elector(standin, clock, "a", changes), elector(standin, clock, "b", changes)
    a.tick()
    b.tick()
    assert (a.is_leader, b.is_leader) == (True, False)
    assert changes == [("a", True)]
    lease = standin.get(LEASE, NAME, NS)
    spec = lease["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 15
    assert spec["renewTime"].endswith("Z") and len(spec["renewTime"]) == 27  # microseconds
    # Renewals keep it; the standby keeps waiting.
    for _ in range(20):
        clock.now += 2.0
        a.tick()
        b.tick()
        assert (a.is_leader, b.is_leader) == (True, False)
    assert standin.get(LEASE, NAME, NS)["spec"]["holderIdentity"] == "a"
    assert [s.method for s in standin.requests if "/leases" in s.path] >= ["GET", "POST"]


def test_a_released_lease_is_taken_at_the_next_try(standin: KubeStandIn):
    clock = Clock()
    a, b = elector(standin, clock, "a"), elector(standin, clock, "b")
    a.tick()
    b.tick()
    assert a.release()
    assert not a.is_leader
    assert standin.get(LEASE, NAME, NS)["spec"]["holderIdentity"] == ""
    clock.now += 2.0  # one retry period, far less than the 15 s lease
    b.tick()
    assert b.is_leader
    assert standin.get(LEASE, NAME, NS)["spec"]["leaseTransitions"] == 1


def test_a_leader_cut_off_steps_down_within_the_renew_deadline(standin: KubeStandIn):
    clock, changes = Clock(), []
    a, b = elector(standin, clock, "a", changes), elector(standin, clock, "b", changes)
    a.tick()
    b.tick()
    renewed = clock.now
    standin.refuse_lease_writes("a")  # a's renewals fail; b still reaches the API server
    a_lost = b_won = None
    while clock.now < renewed + 30 and b_won is None:
        clock.now += 0.5
        a.tick()
        b.tick()
        assert not (a.is_leader and b.is_leader), f"two leaders at {clock.now - renewed}s"
        if a_lost is None and not a.is_leader:
            a_lost = clock.now - renewed
        if b.is_leader:
            b_won = clock.now - renewed
    # Not leader once the 10 s deadline passes, at once (is_leader reads the clock) ...
    assert a_lost == 10.0
    # ... and b takes over once the lease (15 s since b saw the last renewal) expired.
    assert b_won == 15.0
    assert changes == [("a", True), ("a", False), ("b", True)]
    # a, reachable again, stays a standby: b holds a valid lease.
    standin.refuse_lease_writes(None)
    clock.now += 2.0
    a.tick()
    b.tick()
    assert (a.is_leader, b.is_leader) == (False, True)


def test_is_leader_ends_at_the_deadline_even_without_a_round(standin: KubeStandIn):
    clock = Clock()
    a = elector(standin, clock, "a")
    a.tick()
    clock.now += 9.9
    assert a.is_leader
    clock.now += 0.1  # a round hung in a call: no tick ran
    assert not a.is_leader


def test_two_candidates_racing_for_one_expired_lease_get_one_leader(standin: KubeStandIn):
    clock = Clock()
    a, b, c = (elector(standin, clock, who) for who in "abc")
    a.tick()
    b.tick()
    c.tick()
    standin.refuse_lease_writes("a")
    clock.now += 16.0
    a.tick()
    b.tick()  # b reads and writes first: takes it
    c.tick()  # c saw the old record 16 s ago too, but reads b's now: held
    assert [e.is_leader for e in (a, b, c)] == [False, True, False]


def test_update_with_a_stale_resource_version_conflicts(standin: KubeStandIn):
    """The stand-in refuses a write from an old read, as the API server does (409)."""
    from epp.leader import LeaseConflict

    api = KubernetesLeases(k8s.ApiClient(k8s.Configuration(host=standin.url)))
    body = {"metadata": {"name": "x"}, "spec": {"holderIdentity": "a"}}
    created = api.create(NS, body, 2.0)
    with pytest.raises(LeaseConflict):
        api.create(NS, body, 2.0)
    api.replace(NS, "x", {**created, "spec": {"holderIdentity": "b"}}, 2.0)
    with pytest.raises(LeaseConflict):
        api.replace(NS, "x", {**created, "spec": {"holderIdentity": "c"}}, 2.0)
    assert api.get(NS, "x", 2.0)["spec"]["holderIdentity"] == "b"
    assert api.get(NS, "missing", 2.0) is None
