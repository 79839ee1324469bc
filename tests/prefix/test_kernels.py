"""The compiled prefix kernels (src/epp/prefix/_kernels.c) against their pure-Python
twins, the reference: the same inputs give the same outputs and leave the same state."""

from __future__ import annotations

import gc
import os
import random
import shutil
import sys
import sysconfig
from array import array

import pytest
import xxhash

from epp import kernels
from epp.prefix import approximate
from epp.prefix.hashing import block_hashes, python_block_hashes
from epp.prefix.holders import Holders
from epp.prefix.pod_blocks import PodBlocks

compiled = kernels.PREFIX
needs_compiled = pytest.mark.skipif(compiled is None, reason="compiled kernels not built")


def test_the_kernels_are_built_where_a_c_compiler_is():
    """pip builds the extension when it can (setup.py: optional): a machine with a C
    compiler and Python's headers that ends up without it has a broken build."""
    if os.environ.get("EPP_KERNELS", "").lower() == "python":
        pytest.skip("EPP_KERNELS=python: the pure-Python kernels were asked for")
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") and headers):
        pytest.skip("no C compiler or Python headers here: pure Python is expected")
    assert compiled is not None
    assert kernels.KERNELS == "compiled"


@needs_compiled
def test_xxh64_equals_the_xxhash_library_on_every_length_and_seed():
    rng = random.Random(1)
    seeds = [0, 1, 2**63, 2**64 - 1, *(rng.getrandbits(64) for _ in range(20))]
    for length in range(0, 140):
        data = rng.randbytes(length)
        for seed in rng.sample(seeds, 4):
            assert compiled.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed), (length, seed)
    assert compiled.xxh64(b"", 0) == 0xEF46DB3751D8E999  # the spec's empty-input value


@needs_compiled
def test_the_chain_equals_the_python_twin():
    rng = random.Random(2)
    for _ in range(300):
        tokens = array("I", (rng.getrandbits(32) for _ in range(rng.randrange(0, 300))))
        block_size = rng.choice((1, 2, 3, 7, 16, 64))
        seed = rng.getrandbits(64)
        full = len(tokens) // block_size
        blocks = rng.randrange(0, full + 1)
        step = block_size * 4
        expected = python_block_hashes(memoryview(tokens).cast("B"), step, seed, blocks)
        assert compiled.xxh64_chain(tokens, step, seed, blocks) == expected


@needs_compiled
def test_the_chain_refuses_more_blocks_than_the_data_holds():
    with pytest.raises(ValueError, match="exceeds the data"):
        compiled.xxh64_chain(array("I", range(16)), 64, 0, 2)
    with pytest.raises(ValueError, match="exceeds the data"):
        compiled.xxh64_chain(b"", 0, 0, 0)
    with pytest.raises(ValueError, match="exceeds the data"):
        compiled.xxh64_chain(b"\0" * 8, 4, 0, -1)
    with pytest.raises(TypeError):
        compiled.xxh64_chain("text", 4, 0, 1)


def random_holders(rng: random.Random, pods: int, keys: list[int]) -> Holders:
    """Holders whose blocks are held by random pods, some marked, several blocks sharing
    one int object as the index's do."""
    holders = Holders()
    ids = [holders.add_pod(f"pod-{i}") for i in range(pods)]
    if pods > 2 and rng.random() < 0.5:
        holders.remove_pod(ids[1])  # a freed id: its bit is in hold_all, on no block
    shared = {pod_id: 1 << (2 * pod_id) for pod_id in ids}
    for key in keys:
        mask = 0
        for pod_id in rng.sample(ids, rng.randrange(0, min(pods, 4) + 1)):
            if pod_id == 1 and holders.names[1] is None:
                continue
            bit = shared[pod_id] if rng.random() < 0.5 else 1 << (2 * pod_id)
            mask |= bit if rng.random() < 0.7 else bit | bit << 1
        if mask:
            holders.bits[key] = mask  # type: ignore[index]
    return holders


@needs_compiled
@pytest.mark.parametrize("pods", [1, 3, 8, 40, 300])
def test_the_walk_answers_as_the_python_match(pods, monkeypatch):
    rng = random.Random(pods)
    keys = [rng.getrandbits(64) for _ in range(60)]
    for _ in range(200):
        holders = random_holders(rng, pods, keys)
        # Long shared runs: a path most pods follow, then drop out of one by one.
        path = rng.sample(keys, rng.randrange(1, 40))
        live = sum(1 << (2 * i) for i, name in enumerate(holders.names) if name is not None)
        for depth, key in enumerate(path):
            if rng.random() < 0.8:
                holders.bits[key] = live  # type: ignore[index]
            elif depth and rng.random() < 0.5:
                holders.bits.pop(key, None)  # type: ignore[call-overload]
        with monkeypatch.context() as patch:
            patch.setattr("epp.prefix.holders.COMPILED", None)
            expected = holders.match(path)  # type: ignore[arg-type]
        got = holders.match(path)  # type: ignore[arg-type]
        assert got == expected
        assert list(got) == list(expected)  # the same order, pod by pod


@needs_compiled
def test_the_walk_stops_when_no_pod_is_left():
    """Events name the pods that dropped out at each depth; once none is left the walk
    ends, with no trailing empty event."""
    bits = {1: 0b101, 2: 0b1, 3: 0b101}
    assert compiled.walk(bits, [1, 2, 3, 1], 0b101) == [(1, 0b100), (4, 0b1)]
    assert compiled.walk(bits, [1, 9, 1, 1], 0b101) == [(1, 0b101)]
    assert compiled.walk(bits, [1, 2, 9, 3], 0b101) == [(1, 0b100), (2, 0b1)]


@needs_compiled
def test_the_kernels_keep_no_reference_and_no_buffer_after_a_call():
    """Every path, errors included, gives back what it took. A leaked reference keeps an
    argument alive (its refcount grows) or an object the caller never sees (the count of
    allocated blocks grows, as CPython's own leak hunt measures it); a buffer not released
    locks the array."""
    args = Args()
    for _ in range(200):  # warm up free lists and anything cached on first use
        calls(args)
    gc.collect()
    refs = args.refcounts()
    blocks = sys.getallocatedblocks()
    for _ in range(2000):
        calls(args)
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 200  # one leak per call: >= 2000
    assert args.refcounts() == refs
    args.tokens.append(0)  # BufferError if an export was left behind
    args.queue.append(0)


class Args:
    def __init__(self) -> None:
        self.tokens = array("I", range(64))
        self.active = (1 << 100) | 0b101  # not a cached small int: its refcount is its own
        self.hashes = [1, 2, 3]
        self.unfit = [1, 2, -1]
        self.unhashable = [1, [2]]
        self.bits = {1: self.active, 2: self.active, 3: 0b1}
        self.names = [f"pod-{i}" for i in range(51)]
        self.short_names = self.names[:2]  # no name for the pod of bit 100: IndexError
        # Depths and bit lengths past the small-int cache: each a new int.
        self.deep = (1 << 600) | 0b1
        self.deep_path = [7] * 300
        self.deep_names = [f"pod-{i}" for i in range(301)]
        self.run_value = 1 << 200  # the run cache holds it when the next block fails
        self.queue = array("Q", [1, 2, 3])
        self.signed_queue = array("q", [1, 2, 3])

    def refcounts(self) -> list[int]:
        return [sys.getrefcount(x) for x in vars(self).values()]


def calls(a: Args) -> None:
    compiled.xxh64(a.tokens, 1)
    compiled.xxh64_chain(a.tokens, 64, 1, 4)
    for bad in ((a.tokens, 64, 1, 5), (a.tokens, 64, "seed", 1)):
        with pytest.raises((ValueError, TypeError)):
            compiled.xxh64_chain(*bad)
    assert compiled.walk(a.bits, a.hashes, a.active) == [(2, a.active ^ 0b1), (3, 0b1)]
    assert compiled.walk(a.bits, a.hashes[:2], a.active) == [(2, a.active)]
    assert compiled.walk({1: a.active}, a.hashes, a.active) == [(1, a.active)]
    with pytest.raises(TypeError):
        compiled.walk(a.bits, a.unhashable, a.active)
    matched = compiled.match(a.bits, a.hashes, a.active, a.names)
    assert matched == {"pod-0": 3, "pod-1": 2, "pod-50": 2}
    with pytest.raises(IndexError):
        compiled.match(a.bits, a.hashes, a.active, a.short_names)
    with pytest.raises(TypeError):
        compiled.match(a.bits, a.unhashable, a.active, a.names)
    assert len(compiled.match({7: a.deep}, a.deep_path, a.deep, a.deep_names)) == 2
    compiled.record_new({1: a.active, 2: 0b1000, 3: 0b1}, a.hashes, 0b1, 0b10, 0b11)
    assert compiled.record_new({}, a.unfit, 0b1, 0b10, 0b11) is None
    with pytest.raises(TypeError):
        compiled.record_new({2: "x"}, a.hashes, 0b1, 0b10, 0b11)
    with pytest.raises(TypeError):
        compiled.record_new({3: a.run_value, 2: "x"}, a.hashes, 0b1, 0b10, 0b11)
    # evict: a second chance, an eviction of a block others hold, one alone, then errors.
    clock = {1: a.run_value | 0b11, 2: a.run_value | 0b1, 3: 0b1}
    assert compiled.evict(clock, a.queue, 0, 2, 0b1, 0b10, 0b11) == (3, a.queue[:1].tobytes())
    assert clock == {1: a.run_value | 0b1, 2: a.run_value}
    with pytest.raises(TypeError):
        compiled.evict({1: "x"}, a.queue, 0, 1, 0b1, 0b10, 0b11)
    with pytest.raises(IndexError):
        compiled.evict({}, a.queue, 0, 1, 0b1, 0b10, 0b11)
    with pytest.raises(TypeError):
        compiled.evict({}, a.signed_queue, 0, 1, 0b1, 0b10, 0b11)


@needs_compiled
def test_the_walk_raises_what_a_key_lookup_raises():
    with pytest.raises(TypeError):
        compiled.walk({1: 1}, [[1]], 1)  # an unhashable key
    with pytest.raises(TypeError):
        compiled.walk([], [1], 1)


def _twin_states(
    rng: random.Random, capacity: int, pods: int = 5
) -> tuple[dict, PodBlocks, dict, PodBlocks]:
    bits: dict = {}
    slot = PodBlocks(pod_id=rng.randrange(0, pods), capacity=capacity)
    other = 1 << (2 * (slot.pod_id + 1))
    for _ in range(rng.randrange(0, 30)):  # other pods' blocks, some marked
        bits[rng.getrandbits(64)] = other | (other << 1 if rng.random() < 0.5 else 0)
    copy = PodBlocks(pod_id=slot.pod_id, capacity=capacity)
    return bits, slot, dict(bits), copy


@needs_compiled
@pytest.mark.parametrize("pods", [5, 1000])  # masks past 64 bits at 1,000 pods
@pytest.mark.parametrize("capacity", [5, 40, 10_000])
def test_record_leaves_the_state_the_python_twin_leaves(capacity, pods):
    """Record and its CLOCK eviction, compiled, against `python_record` (the twin of
    both)."""
    rng = random.Random(capacity)
    for _ in range(40):
        bits_c, slot_c, bits_p, slot_p = _twin_states(rng, capacity, pods)
        keys = [*bits_c, *(rng.getrandbits(64) for _ in range(80))]
        for _ in range(30):
            prefix = rng.sample(keys, rng.randrange(0, 25))
            approximate.record(bits_c, slot_c, prefix)
            approximate.python_record(bits_p, slot_p, prefix)
            assert bits_c == bits_p
            assert list(slot_c.log[slot_c.log_pos :]) == list(slot_p.log[slot_p.log_pos :])
            assert (slot_c.count, slot_c.log_pos) == (slot_p.count, slot_p.log_pos)
            assert type(slot_c.log) is array


def _clock_states(rng: random.Random, pods: int) -> tuple[dict, PodBlocks]:
    """A pod at capacity whose blocks are shared with other pods, marked or not."""
    slot = PodBlocks(pod_id=rng.randrange(0, pods), capacity=rng.randrange(1, 60))
    bits: dict = {}
    for _ in range(slot.capacity):
        block = rng.getrandbits(64)
        other = 1 << (2 * rng.randrange(0, pods + 1))
        other = 0 if other == slot.hold else other | (other << 1 if rng.random() < 0.3 else 0)
        bits[block] = (slot.both if rng.random() < 0.5 else slot.hold) | (
            other if rng.random() < 0.4 else 0
        )
        slot.log.append(block)
    slot.count = slot.capacity
    return bits, slot


@needs_compiled
@pytest.mark.parametrize("pods", [3, 500])
def test_evict_leaves_the_state_the_python_twin_leaves(pods):
    """Every block marked or none, shared or alone: the compiled CLOCK evicts the same
    blocks, clears the same marks and requeues in the same order as the twin, including
    when the queue runs past its end into the blocks it just requeued."""
    rng = random.Random(pods)
    for _ in range(300):
        bits_c, slot_c = _clock_states(rng, pods)
        if rng.random() < 0.2:  # all marked: every one gets its second chance first
            for block in slot_c.log:
                bits_c[block] |= slot_c.mark
        bits_p = dict(bits_c)
        slot_p = PodBlocks(pod_id=slot_c.pod_id, capacity=slot_c.capacity)
        slot_p.log = array("Q", slot_c.log)
        slot_p.count = slot_c.count
        shrink = rng.randrange(1, slot_c.capacity + 1)
        for slot in (slot_c, slot_p):
            slot.capacity -= shrink
        approximate.evict(bits_c, slot_c)
        approximate.python_evict(bits_p, slot_p)
        assert bits_c == bits_p
        assert list(slot_c.log[slot_c.log_pos :]) == list(slot_p.log[slot_p.log_pos :])
        assert (slot_c.count, slot_c.log_pos) == (slot_p.count, slot_p.log_pos)
        for block, mask in bits_c.items():  # the pod's own object where the twin puts it
            assert (mask is slot_c.hold) == (bits_p[block] is slot_p.hold)


@needs_compiled
def test_evict_refuses_a_queue_it_cannot_read_and_one_that_runs_out():
    with pytest.raises(TypeError):
        compiled.evict({}, array("q", [1]), 0, 1, 1, 2, 3)  # signed: the twin's list case
    with pytest.raises(TypeError):
        compiled.evict({}, [1], 0, 1, 1, 2, 3)
    with pytest.raises(ValueError):
        compiled.evict({}, array("Q", [1]), -1, 1, 1, 2, 3)
    # Nothing in the queue is held: the excess cannot be met (the twin's log[pos] fails too).
    with pytest.raises(IndexError):
        compiled.evict({1: 0b100}, array("Q", [1]), 0, 1, 0b1, 0b10, 0b11)


@needs_compiled
def test_a_hash_that_is_no_uint64_changes_nothing_and_the_twin_records_it():
    bits: dict = {5: 1 << 4}
    assert compiled.record_new(bits, [7, -3, 9], 1, 2, 3) is None
    assert compiled.record_new(bits, [7, 2**64, 9], 1, 2, 3) is None
    assert compiled.record_new(bits, [7, 9.0, 9], 1, 2, 3) is None
    assert bits == {5: 1 << 4}
    slot = PodBlocks(pod_id=0, capacity=100)
    approximate.record(bits, slot, [7, -3])  # type: ignore[list-item]
    assert bits == {5: 1 << 4, 7: 1, -3: 1}
    assert list(slot.log) == [-3, 7] and slot.count == 2


@needs_compiled
def test_the_compiled_chain_is_what_block_hashes_returns():
    tokens = array("I", range(100))
    assert block_hashes(tokens, 16, 3) == compiled.xxh64_chain(tokens, 64, 3, 6)


USE_AFTER_FREE = """
import sys
from epp.prefix import _kernels as k
hashes = []
class Key:  # a key whose hash empties the list being walked and reuses its memory
    def __hash__(self):
        hashes.clear()
        [bytearray(64) for _ in range(10000)]
        return 12345
    def __eq__(self, other):
        return self is other
class Mask(int):  # a value whose comparison does the same to the list being recorded
    def __eq__(self, other):
        hashes.clear()
        [bytearray(64) for _ in range(10000)]
        return False
    __hash__ = int.__hash__
key = Key()
if sys.argv[1] == "walk":
    hashes.extend([1, key, *range(2, 5002)])
    bits = {1: 1, key: 1, **{i: 1 for i in range(2, 5002)}}
    k.walk(bits, hashes, 1)
else:
    hashes.extend([*range(2, 5002), 1])
    k.record_new({1: Mask(9)}, hashes, 1, 2, 3)
print("ok")
"""


@needs_compiled
@pytest.mark.parametrize("kernel", ["walk", "record"])
def test_a_hash_list_emptied_during_the_call_does_not_crash_the_process(kernel, tmp_path):
    """The kernels walk a copy of `hashes`: Python code run by a key's hash or a value's
    comparison cannot free what they read (without the copy the record probe reads freed
    memory)."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(USE_AFTER_FREE)
    done = subprocess.run(
        [sys.executable, str(script), kernel], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_compiled
def test_match_refuses_a_hold_bit_past_the_names_as_the_twin_does():
    """A pod id with no name slot is an IndexError in both (a bounds check off by one
    reads past the list)."""
    holders = Holders()
    for i in range(3):
        holders.add_pod(f"pod-{i}")
    for bit in (1 << 6, 1 << 7, 1 << 200):
        for call in (holders.python_match, lambda h, a: compiled.match({}, h, a, holders.names)):
            with pytest.raises(IndexError):
                call([1, 2], bit | 1)
    assert compiled.match({}, [1], 1 << 4, holders.names) == {"pod-2": 0}


@needs_compiled
def test_record_gives_a_run_of_blocks_sharing_a_value_one_new_value_object():
    """Blocks that shared one value object before record share one new value object after
    it (one decision per run), so the next walk and record over them are identity checks;
    each case of the decision, with ints past the small-int cache."""
    hold, mark = 1 << 300, 1 << 301
    both, other = hold | mark, 1 << 400
    for before in (hold, other, other | hold, other | both):
        shared = before + 0  # one object (a big int: every result is a new object)
        hashes = list(range(1, 7))
        bits = {h: shared for h in hashes}
        bits[4] = before + 0  # an equal value, another object: a run of its own
        expected = {h: approximate_value(before, hold, mark) for h in hashes}
        compiled.record_new(bits, hashes, hold, mark, both)
        assert bits == expected
        assert len({id(bits[h]) for h in (1, 2, 3)}) == 1, before
        assert len({id(bits[h]) for h in (5, 6)}) == 1, before


def approximate_value(mask: int, hold: int, mark: int) -> int:
    """What approximate record makes of a block whose value is `mask`."""
    if not mask & hold:
        return mask | hold
    return mask | mark
