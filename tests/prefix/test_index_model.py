"""PrefixIndex, both modes, answers as a straightforward model of its contract over long
random sequences of every public call: pods switching modes, approximate records and their
CLOCK eviction, precise engine blocks (copies, several keys a block, unknown keys, relearnt
blocks, several engine blocks carrying one key), predictions (tokens, completions, the TTL,
the cap, the bound on predicted entries), capacities, match units, clears and removals.

The model keeps sets and counters where the index keeps bit masks, packed records and
sequence numbers. One thing it leaves out: the capacity bound on a precise pod's engine
blocks (a CLOCK over the engine map's buckets, tested case by case in
test_index_contract.py): capacities here stay above the engine blocks a pod can hold, and
so the marks a routed hit sets, read only by that bound, are not modelled either."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from epp.prefix.hashing import BlockHash
from epp.prefix.index import PrefixIndex

TTL, MAX = 2.0, 10.0


@dataclass(eq=False)
class Prediction:
    pod: PodModel
    keys: list[int]
    deadline: float
    token: str | None
    released: bool = False


@dataclass(eq=False)
class PodModel:
    capacity: int
    precise: bool = False
    # approximate: CLOCK
    held: set[int] = field(default_factory=set)
    queue: deque[int] = field(default_factory=deque)
    marked: set[int] = field(default_factory=set)
    # precise
    engine: dict[int, int | tuple[int, ...]] = field(default_factory=dict)
    copies: dict[int, int] = field(default_factory=dict)
    carriers: dict[int, int] = field(default_factory=dict)  # key -> engine blocks with it
    predicted: dict[int, set[Prediction]] = field(default_factory=dict)  # oldest first

    def holds(self, key: int) -> bool:
        if not self.precise:
            return key in self.held
        return key in self.predicted or self.carriers.get(key, 0) > 0

    def size(self) -> int:
        return len(self.engine) + len(self.predicted) if self.precise else len(self.held)

    def clear(self) -> None:
        self.held, self.queue, self.marked = set(), deque(), set()
        self.engine, self.copies, self.carriers, self.predicted = {}, {}, {}, {}


def group_keys(keys: int | tuple[int, ...]) -> tuple[int, ...]:
    return (keys,) if isinstance(keys, int) else keys


class ModelIndex:
    def __init__(self, capacity: int, fraction: float, clock: list[float]) -> None:
        self.default = capacity
        self.fraction = fraction
        self.clock = clock
        self.cap: dict[str, int] = {}
        self.pods: dict[str, PodModel] = {}
        self.units: dict[str, int] = {}
        self.expiring: deque[tuple[float, Prediction]] = deque()
        self.in_flight: deque[Prediction] = deque()
        self.by_token: dict[str, Prediction] = {}
        self.capped = 0

    def capacity(self, pod: str) -> int:
        return self.cap.get(pod, self.default)

    def pod(self, name: str) -> PodModel:
        if name not in self.pods:
            self.pods[name] = PodModel(self.capacity(name))
        return self.pods[name]

    # -- lookup

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        self.expire(self.clock[0])
        out: dict[str, int] = {}
        for name, pod in self.pods.items():
            depth = 0
            while depth < len(hashes) and pod.holds(hashes[depth]):
                depth += 1
            if depth:
                unit = self.units.get(name, 1)
                out[name] = depth - depth % unit
        return out

    def nodes(self) -> int:
        keys: set[int] = set()
        for pod in self.pods.values():
            keys |= pod.held | set(pod.predicted) | {k for k, n in pod.carriers.items() if n}
        return len(keys)

    # -- record

    def record(self, name: str, hashes: Sequence[int], now: float, token: str | None) -> None:
        pod = self.pod(name)
        hashes = hashes[: max(1, int(self.capacity(name) * self.fraction))]
        if pod.precise:
            self.predict(pod, hashes, now, token)
            return
        for block in reversed(hashes):
            if block in pod.held:
                pod.marked.add(block)
            else:
                pod.held.add(block)
                pod.queue.append(block)
        self.evict(pod)

    def evict(self, pod: PodModel) -> None:
        while len(pod.held) > pod.capacity:
            block = pod.queue.popleft()
            if block in pod.marked:
                pod.marked.discard(block)
                pod.queue.append(block)
            else:
                pod.held.discard(block)

    def predict(self, pod: PodModel, hashes: Sequence[int], now: float, token: str | None):
        prediction = Prediction(pod, [], now + (MAX if token else TTL), token)
        for block in hashes:
            if block in pod.predicted:
                pod.predicted[block].add(prediction)
            elif pod.holds(block):
                continue
            else:
                pod.predicted[block] = {prediction}
            prediction.keys.append(block)
        if not prediction.keys:
            return
        if token is None:
            self.expiring.append((prediction.deadline, prediction))
        else:
            if token in self.by_token:
                self.completed(token, now)
            self.in_flight.append(prediction)
            self.by_token[token] = prediction
        self.bound_predicted(pod)

    def bound_predicted(self, pod: PodModel) -> None:
        while len(pod.predicted) > pod.capacity:
            del pod.predicted[next(iter(pod.predicted))]

    def completed(self, token: str, now: float) -> None:
        prediction = self.by_token.pop(token, None)
        alive = prediction is not None and not prediction.released
        if alive and now + TTL < prediction.deadline:  # type: ignore[union-attr]
            self.expiring.append((now + TTL, prediction))  # type: ignore[arg-type]

    def expire(self, now: float) -> int:
        dropped = 0
        while self.expiring and self.expiring[0][0] <= now:
            dropped += self.release(self.expiring.popleft()[1])
        while self.in_flight and self.in_flight[0].deadline <= now:
            prediction = self.in_flight.popleft()
            token = prediction.token
            if not prediction.released and token and self.by_token.get(token) is prediction:
                del self.by_token[token]
                self.capped += 1
            dropped += self.release(prediction)
        return dropped

    def release(self, prediction: Prediction) -> int:
        if prediction.released:
            return 0
        prediction.released = True
        dropped = 0
        predicted = prediction.pod.predicted
        for key in prediction.keys:
            holders = predicted.get(key)
            if holders and prediction in holders:
                holders.discard(prediction)
                if not holders:
                    del predicted[key]
                    dropped += 1
        return dropped

    def predictions(self) -> int:
        return len(self.by_token) + sum(1 for _, p in self.expiring if not p.released)

    def open_predictions(self, name: str) -> list[list[int]]:
        pod = self.pods.get(name)
        if pod is None or not pod.precise:
            return []
        live = [p for p in reversed(self.by_token.values()) if p.pod is pod and not p.released]
        live += [p for _, p in reversed(self.expiring) if p.pod is pod and not p.released]
        return [p.keys for p in live]

    # -- pods

    def set_capacity(self, name: str, capacity: int) -> None:
        capacity = max(1, min(capacity, self.default))
        if self.cap.get(name) == capacity:
            return
        self.cap[name] = capacity
        pod = self.pods.get(name)
        if pod is not None:
            pod.capacity = capacity
            self.bound_predicted(pod) if pod.precise else self.evict(pod)

    def set_precise(self, name: str, precise: bool) -> None:
        if name not in self.pods and not precise:
            return
        pod = self.pod(name)
        if pod.precise != precise:
            pod.clear()
            pod.precise = precise

    def remove_pod(self, name: str) -> None:
        pod = self.pods.pop(name, None)
        if pod is not None:
            pod.clear()  # its predictions, released later, find nothing
        self.cap.pop(name, None)

    def clear_pod(self, name: str) -> None:
        if name in self.pods:
            self.pods[name].clear()

    # -- engine blocks

    def precise_pod(self, name: str) -> PodModel | None:
        pod = self.pods.get(name)
        return pod if pod is not None and pod.precise else None

    def store(self, name: str, hashes: list[int], keys: list[int], per_block: int) -> bool:
        pod = self.precise_pod(name)
        if pod is None:
            return False
        for i, engine_hash in enumerate(hashes):
            group = tuple(keys[i * per_block : (i + 1) * per_block])
            if engine_hash in pod.engine:
                pod.copies[engine_hash] = pod.copies.get(engine_hash, 0) + 1
                continue
            pod.engine[engine_hash] = group[0] if per_block == 1 and group else group
            for key in group:
                pod.predicted.pop(key, None)  # confirmed
                pod.carriers[key] = pod.carriers.get(key, 0) + 1
        return True

    def remove(self, name: str, hashes: list[int]) -> int:
        pod = self.precise_pod(name)
        if pod is None:
            return 0
        found = 0
        for engine_hash in hashes:
            if pod.copies.get(engine_hash):
                pod.copies[engine_hash] -= 1
                found += 1
            elif engine_hash in pod.engine:
                for key in group_keys(pod.engine.pop(engine_hash)):
                    pod.carriers[key] -= 1
                found += 1
        return found

    def relearn(self, name: str, engine_hash: int, keys: list[int]) -> bool:
        pod = self.precise_pod(name)
        if pod is None or not keys or pod.engine.get(engine_hash):
            return False
        if engine_hash in pod.engine:  # held with unknown keys
            del pod.engine[engine_hash]
        group = [k for k in keys[:-1] if k in pod.predicted or not pod.carriers.get(k)]
        group.append(keys[-1])
        return self.store(name, [engine_hash], group, len(group))

    def reported(self, name: str, key: int) -> bool:
        pod = self.precise_pod(name)
        return pod is not None and key not in pod.predicted and pod.carriers.get(key, 0) > 0


def make_prefixes(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts that share heads, as a prefix tree: each extends a cut of an earlier one."""
    prefixes = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 30))]]
    while len(prefixes) < count:
        parent = rng.choice(prefixes)
        head = parent[: rng.randrange(0, len(parent) + 1)]
        prefixes.append(head + [rng.getrandbits(64) for _ in range(rng.randrange(1, 20))])
    return prefixes


def engine_universe(rng: random.Random, keys: list[int]) -> dict[int, list[list[int]]]:
    """Engine hashes by how many of our keys each carries (0: unknown keys). Drawn from a
    small pool of keys, so that several engine blocks carry the same key."""
    pool = rng.sample(keys, 25)
    universe: dict[int, list[list[int]]] = {0: [], 1: [], 2: []}
    hashes = iter({rng.getrandbits(64) | 1 for _ in range(40)})
    for per_block, count in ((1, 20), (2, 10), (0, 8)):
        for _ in range(count):
            universe[per_block].append([next(hashes), *rng.sample(pool, per_block)])
    return universe


def check_pod(ours: PrefixIndex, model: ModelIndex, name: str, step: int) -> None:
    pod = model.pods.get(name)
    assert ours.blocks(name) == (pod.size() if pod else 0), step
    assert ours.is_precise(name) == bool(pod and pod.precise), step
    engine = pod.engine if pod and pod.precise else {}
    assert sorted(ours.engine_blocks(name)) == sorted(engine), step
    for engine_hash, keys in engine.items():
        assert ours.engine_block(name, engine_hash) == keys, step
    assert list(ours.open_predictions(name)) == model.open_predictions(name), step


@pytest.mark.parametrize(("seed", "pod_count"), [(1, 6), (2, 6), (3, 70)])
def test_random_operations_answer_as_the_model(seed, pod_count, kernels_used):
    rng = random.Random(seed)
    pods = [f"pod-{i}" for i in range(pod_count)]
    prefixes = make_prefixes(rng, 60)
    all_keys = sorted({k for p in prefixes for k in p})
    universe = engine_universe(rng, all_keys)
    clock = [0.0]
    capacity, fraction = 64, 0.5
    ours = PrefixIndex(
        capacity, fraction, predicted_ttl_s=TTL, predicted_max_s=MAX, clock=lambda: clock[0]
    )
    model = ModelIndex(capacity, fraction, clock)
    tokens = [f"t{i}" for i in range(30)]
    for step in range(8000):
        clock[0] += rng.choice((0.0, 0.0, 0.1, 0.5, 1.5))
        pod = rng.choice(pods)
        prefix = rng.choice(prefixes)
        cut = prefix[: rng.randrange(1, len(prefix) + 1)]
        op = rng.random()
        if op < 0.25:
            token = rng.choice([None, *tokens])
            now = clock[0]
            ours.record(pod, cut, None if rng.random() < 0.5 else now, token)  # type: ignore[arg-type]
            model.record(pod, cut, now, token)
        elif op < 0.40:
            per_block = rng.choice((0, 1, 1, 2))
            chosen = rng.sample(universe[per_block], rng.randrange(1, 4))
            hashes = [e[0] for e in chosen]
            flat = [k for e in chosen for k in e[1:]]
            want = model.store(pod, hashes, flat, max(per_block, 1))
            got = ours.store_engine_blocks(pod, hashes, flat, max(per_block, 1))  # type: ignore[arg-type]
            assert got == want, step
        elif op < 0.52:
            every = universe[0] + universe[1] + universe[2]
            hashes = [e[0] for e in rng.sample(every, rng.randrange(1, 5))]
            assert ours.remove_engine_blocks(pod, hashes) == model.remove(pod, hashes), step
        elif op < 0.55:
            engine_hash = rng.choice(universe[0])[0]
            got = ours.relearn_engine_block(pod, engine_hash, cut)  # type: ignore[arg-type]
            assert got == model.relearn(pod, engine_hash, cut), step
        elif op < 0.60:
            token = rng.choice(tokens)
            ours.completed(token, clock[0])
            model.completed(token, clock[0])
        elif op < 0.62:
            assert ours.expire(clock[0]) == model.expire(clock[0]), step
        elif op < 0.67:
            precise = rng.random() < 0.7
            ours.set_precise(pod, precise)
            model.set_precise(pod, precise)
        elif op < 0.69:
            size = rng.randrange(40, capacity + 10)  # above the 38 engine blocks a pod can hold
            ours.set_capacity(pod, size)
            model.set_capacity(pod, size)
        elif op < 0.70:
            unit = rng.choice((1, 2, 3))
            ours.set_match_unit(pod, unit)
            model.units[pod] = unit
        elif op < 0.71:
            ours.clear_pod(pod)
            model.clear_pod(pod)
        elif op < 0.72:
            ours.remove_pod(pod)
            model.remove_pod(pod)
        elif op < 0.76:
            key = rng.choice(cut)
            assert ours.reported(pod, BlockHash(key)) == model.reported(pod, key), step
        elif op < 0.78:
            check_pod(ours, model, pod, step)
        else:
            assert ours.match(cut) == model.match(cut), step  # type: ignore[arg-type]
        assert ours.predictions_capped == model.capped, step
    for prefix in prefixes:
        assert ours.match(prefix) == model.match(prefix)  # type: ignore[arg-type]
    for pod in pods:
        check_pod(ours, model, pod, -1)
    assert ours.nodes == model.nodes()
    assert ours.predictions == model.predictions()
    assert ours.entries == sum(p.size() for p in model.pods.values())
    assert ours.precise_capacity_evictions == 0  # the one bound the model leaves out
