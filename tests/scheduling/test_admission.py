"""The waiting queue alone (scheduling/admission.py): service order, and a release pass
that places as many as there is room for without letting one request hold back another
that needs other pods. Pure bookkeeping: no clock, no Router."""

from __future__ import annotations

from epp.scheduling.admission import FlowQueue, Offer, Waiting


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
