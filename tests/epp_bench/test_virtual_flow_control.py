"""The virtual EPP waits in the Router's own flow control (epp.routing.flow_control), as
the ext_proc server does: its held requests are the router's waiting requests, the
store's events make a release pass due, and one pass places as many as pods have room
for. Real components throughout: the Router, its store on the virtual clock, simulated
engines."""

from __future__ import annotations

from epp.config import EppConfig
from epp_bench.virtual.epp import EppVirtualRouter
from epp_bench.virtual.prepare import prepare
from epp_bench.virtual.types import WAITING, VirtualPods
from epp_bench.workloads import catalog as workloads
from vllm_sim.engine import EngineConfig, SimEngine

ENGINE = EngineConfig(num_gpu_blocks=2048, max_num_seqs=4, max_waiting=64)
ONE_EACH = {"scheduling": {"max_queue": 1, "running_slots": 1}}  # 2 in flight: saturated


def virtual_epp(pods: int) -> EppVirtualRouter:
    names = tuple(f"pod-{i}" for i in range(pods))
    fleet = VirtualPods(names, tuple(SimEngine(ENGINE) for _ in names), workloads.DEFAULT_MODEL)
    epp = EppVirtualRouter(fleet, EppConfig.model_validate(ONE_EACH))
    epp.tick(0.0)  # the first scrape: idle pods
    return epp


def test_held_requests_wait_in_the_routers_flow_control_and_one_pass_places_all_that_fit():
    epp = virtual_epp(4)
    requests = prepare(workloads.no_reuse(requests=12, prompt_tokens=64, output_tokens=4))
    held = [epp.route(r, 0.0) for r in requests[:8]]  # 2 per pod: every pod saturated
    assert sorted(c.pod for c in held) == [0, 0, 1, 1, 2, 2, 3, 3]
    waiting = [epp.route(r, 0.0) for r in requests[8:]]
    assert all(c.status == WAITING and c.pod is None for c in waiting)
    assert epp.router.waiting == 4  # the Router's own queue holds them
    assert epp.release(0.0) == []  # no event returned room: no pass is due
    firsts = {}
    for choice in held:
        firsts.setdefault(choice.pod, choice)
    for choice in firsts.values():  # one completion per pod (store events: released)
        epp.complete(choice, 200)
    released = epp.release(0.001)  # one due pass
    assert sorted(index for index, _ in released) == [8, 9, 10, 11]
    assert sorted(choice.pod for _, choice in released) == [0, 1, 2, 3]
    assert epp.router.waiting == 0
    stats = epp.stats()
    assert stats["waited_in_epp"] == 4 and stats["rejected_by_epp"] == 0
    assert set(epp.predictions) == set(range(12))  # released decisions heard too


def test_a_waiting_request_past_its_ttl_is_refused_on_the_virtual_clock():
    epp = virtual_epp(1)
    ttl = epp.config.flow_control.ttl_s
    requests = prepare(workloads.no_reuse(requests=3, prompt_tokens=64, output_tokens=4))
    assert [epp.route(r, 0.0).pod for r in requests[:2]] == [0, 0]
    assert epp.route(requests[2], 0.0).status == WAITING
    assert epp.release(ttl - 0.001) == []
    ((index, choice),) = epp.release(ttl)
    assert (index, choice.pod, choice.status, choice.reason) == (
        2,
        None,
        429,
        "rejected-ttl-expired",
    )
    assert epp.router.waiting == 0
