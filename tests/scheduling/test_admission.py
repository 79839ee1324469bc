"""The waiting queue alone (scheduling/admission.py): service order, and a release pass
that places as many as there is room for without letting one request hold back another
that needs other pods. Pure bookkeeping: no clock, no Router."""

from __future__ import annotations

from epp.config import FlowControlConfig
from epp.scheduling.admission import FlowQueue, Offer, Waiting, request_priority


def waiting(name: str, priority: int = 0, model: str = "m", placement=None) -> Waiting[str]:
    return Waiting(name, priority, model, 10, 0.0, 60.0, placement=placement)


def queue_of(*items: Waiting[str]) -> FlowQueue[str]:
    queue: FlowQueue[str] = FlowQueue(100, 10_000)
    for item in items:
        assert queue.push(item)
    return queue


def test_service_order_is_priority_then_the_models_turn_then_arrival():
    queue = queue_of(
        waiting("m1"), waiting("m2"), waiting("m3"), waiting("a1", model="a"),
        waiting("hi", priority=5), waiting("a2", model="a"), waiting("low", priority=-1),
    )  # fmt: skip
    assert [w.item for w in queue.in_order()] == ["hi", "m1", "a1", "m2", "a2", "m3", "low"]
    assert [w.item for w in queue.in_order(min_priority=0)] == ["hi", "m1", "a1", "m2", "a2", "m3"]


def test_a_pass_places_as_many_as_there_is_room_for_in_service_order():
    queue = queue_of(*(waiting(f"r{i}") for i in range(6)))
    room = [4]
    offered: list[str] = []

    def offer(w: Waiting[str]) -> Offer:
        offered.append(w.item)
        if room[0] == 0:
            return Offer.NO_ROOM
        room[0] -= 1
        return Offer.PLACED

    full: set = set()
    assert queue.release(offer, full) == 4
    assert offered == ["r0", "r1", "r2", "r3", "r4"]  # r5 is not offered: its pods are full
    assert [w.item for w in queue.in_order()] == ["r4", "r5"] and full == {"m"}
    assert queue.release(offer, full) == 0 and len(offered) == 5  # known full: no offer


def test_a_request_with_no_room_holds_back_only_its_own_placement():
    queue = queue_of(
        waiting("hinted", placement=("m", "p0")),
        waiting("hinted-later", placement=("m", "p0")),
        waiting("any", placement=("m", None)),
        waiting("refused", placement=("m", "gone")),
    )
    outcomes = {"hinted": Offer.NO_ROOM, "any": Offer.PLACED, "refused": Offer.LEFT}
    offered: list[str] = []

    def offer(w: Waiting[str]) -> Offer:
        offered.append(w.item)
        return outcomes[w.item]

    assert queue.release(offer, set()) == 1
    assert offered == ["hinted", "any", "refused"]
    assert [w.item for w in queue.in_order()] == ["hinted", "hinted-later"]
    assert queue.placements() == {("m", "p0")}


def test_a_partial_pass_offers_only_the_requests_of_that_rank_or_higher():
    queue = queue_of(waiting("low", priority=0, model="a"), waiting("high", priority=3))
    offered: list[str] = []

    def offer(w: Waiting[str]) -> Offer:
        offered.append(w.item)
        return Offer.PLACED

    assert queue.ranks_at_least(3) and not queue.ranks_at_least(4)
    assert queue.release(offer, set(), min_priority=1) == 1
    assert offered == ["high"] and len(queue) == 1


def test_the_queue_is_bounded_in_count_and_in_bytes_inclusive():
    by_count: FlowQueue[str] = FlowQueue(2, 10_000)
    assert by_count.push(waiting("a")) and by_count.push(waiting("b"))  # exactly at the cap
    assert not by_count.push(waiting("c")) and len(by_count) == 2
    by_bytes: FlowQueue[str] = FlowQueue(100, 25)
    assert by_bytes.push(waiting("a")) and by_bytes.push(waiting("b"))  # 20 of 25 bytes
    assert not by_bytes.push(waiting("c"))  # 30 > 25: refused, nothing counted
    assert (len(by_bytes), by_bytes.bytes) == (2, 20)
    exact: FlowQueue[str] = FlowQueue(100, 20)
    assert exact.push(waiting("a")) and exact.push(waiting("b")) and exact.bytes == 20


def test_removal_gives_back_its_count_and_bytes_and_is_idempotent():
    first, second = waiting("a"), waiting("b")
    queue = queue_of(first, second)
    assert (len(queue), queue.bytes) == (2, 20)
    queue.remove(first)
    assert (len(queue), queue.bytes) == (1, 10) and first.done
    assert queue.placements() == {"m"}  # the other one still waits for those pods
    queue.remove(first)  # already out (placed, then its client gave up)
    assert (len(queue), queue.bytes) == (1, 10)
    queue.remove(second)
    assert (len(queue), queue.bytes) == (0, 0) and list(queue.in_order()) == []


def test_a_request_taken_out_during_the_walk_is_not_offered():
    """in_order reads each band when reached: a request removed meanwhile (expired, its
    client gone), even one of the current turn or a whole band, is skipped, and the walk
    goes on to the bands after it."""
    queue = queue_of(
        waiting("m1"), waiting("a1", model="a"), waiting("top", priority=5),
        waiting("mid", priority=2), waiting("low", priority=-1),
    )  # fmt: skip
    by_item = {w.item: w for w in queue.in_order()}
    walked: list[str] = []
    for w in queue.in_order():
        walked.append(w.item)
        if w.item == "top":
            queue.remove(by_item["mid"])  # the next band goes away entirely
        if w.item == "m1":
            queue.remove(by_item["a1"])  # the same turn's next request
    assert walked == ["top", "m1", "low"]
    assert [w.item for w in queue.in_order()] == ["top", "m1", "low"]


def test_candidates_are_one_head_per_model_in_service_order():
    """What the virtual-time benchmark offers a pod: each model's oldest, by priority,
    then the models' turn."""
    m1, m2, a1 = waiting("m1"), waiting("m2"), waiting("a1", model="a")
    queue = queue_of(m1, m2, a1, waiting("hi", priority=5), waiting("low", priority=-1))
    assert [w.item for w in queue.candidates()] == ["hi", "m1", "a1", "low"]
    queue.remove(m1)  # model m was served: a's turn comes first now
    assert [w.item for w in queue.candidates()] == ["hi", "a1", "m2", "low"]


def test_a_request_expires_when_its_deadline_is_reached():
    early = Waiting("early", 0, "m", 10, 0.0, 5.0)
    late = Waiting("late", 1, "a", 10, 0.0, 9.0)
    queue = queue_of(early, late)
    assert queue.expired(4.9) == []
    assert queue.expired(5.0) == [early]  # the deadline itself is past the TTL
    assert {w.item for w in queue.expired(9.0)} == {"early", "late"}


def flow(**kw) -> FlowControlConfig:
    return FlowControlConfig(**kw)


def test_priority_comes_from_the_trusted_header_clamped_else_the_model_else_the_default():
    config = flow(priorities={"m": 5}, default_priority=2, priority_header="X-Priority")
    assert request_priority("m", {}, config) == 5
    assert request_priority("other", {}, config) == 2
    assert request_priority(None, {}, config) == 2
    assert request_priority("m", {"x-priority": " -3 "}, config) == -3
    assert request_priority("m", {"x-priority": "-1000"}, config) == -1000
    assert request_priority("m", {"x-priority": "-1001"}, config) == -1000
    assert request_priority("m", {"x-priority": "1000"}, config) == 1000
    assert request_priority("m", {"x-priority": "99999"}, config) == 1000
    assert request_priority("m", {"x-priority": "high"}, config) == 5  # malformed: ignored
    untrusted = flow(priorities={"m": 5})  # no header configured: a client's is ignored
    assert request_priority("m", {"x-priority": "100"}, untrusted) == 5
