"""Hostile arguments never crash the process: each compiled kernel reads copies of the
lists a Python hook it calls (`__float__`, `__hash__`, a property, an int subclass's
`to_bytes`) could empty, and checks what such hooks return. Each probe runs in its own
process: a crash is a signal there, not the end of the test run (without the copies,
several of these probes segfault or abort)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epp import kernels

pytestmark = pytest.mark.skipif(
    kernels.PREFIX is None or kernels.SCHEDULING is None, reason="compiled kernels not built"
)

PROBES = {
    "tied: a total's __float__ empties the totals": """
totals = []
class F:
    def __float__(self):
        totals.clear(); return 1.0
totals.extend([F()] + [float(i) for i in range(1000)])
k.tied(totals, 0.1)
""",
    "weighted_sum: a score's __float__ empties its column": """
col = []
class F:
    def __float__(self):
        col.clear(); return 1.0
col.extend([F()] + [float(i) for i in range(1000)])
k.weighted_sum((1.0,), [col])
""",
    "weighted_sum: a score's __float__ empties the weights": """
w = [1.0, 2.0]
class F:
    def __float__(self):
        w.clear(); return 1.0
k.weighted_sum(w, [[F()], [1.0]])
""",
    "prefill: a candidate's property empties the candidates": """
cands = []
class E:
    def __init__(s, n): s.name = n
    @property
    def configured_slots(s):
        cands.clear(); return None
cands.extend([E("a")] + [E(str(i)) for i in range(1000)])
k.prefill(cands, {}, {}, 0.0, 0.0, 0.1, 0.1, 0.1, 10, 16)
""",
    "prefill: a candidate's __hash__ empties the candidates": """
cands = []
class E:
    configured_slots = None
    def __init__(s, n): s.name = n
    def __hash__(s):
        cands.clear(); return 1
    def __eq__(s, o): return s is o
cands.extend([E("a")] + [E(str(i)) for i in range(1000)])
k.prefill(cands, {E("zz"): 1}, {}, 0.0, 0.0, 0.1, 0.1, 0.1, 10, 16)
""",
    "queue_scores: a candidate's property empties the candidates": """
cands = []
class E:
    @property
    def queue_depth(s):
        cands.clear(); return 1.0
cands.extend([E() for i in range(1000)])
k.queue_scores(cands, 20.0)
""",
    "match: a name's __hash__ empties the names": """
names = []
class N(str):
    def __hash__(self):
        names.clear(); return 1
names.extend([N("a")] + [str(i) for i in range(1000)])
mask = sum(1 << (2 * i) for i in range(1001))
p.match({5: mask}, [5], mask, names)
""",
    "match: an int subclass's to_bytes returns a list": """
class M(int):
    def to_bytes(self, *a, **kw):
        return list(range(10**6))
m = M(1)
p.match({5: m}, [5], m, ["a"])
""",
}

PRELUDE = """
from epp.scheduling import _kernels as k
from epp.prefix import _kernels as p
try:
{body}
except Exception as exc:
    print("raised", type(exc).__name__)
print("alive")
"""


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_hostile_argument_is_refused_or_read_safely(probe, tmp_path):
    body = "\n".join("    " + line for line in PROBES[probe].strip().splitlines())
    script = tmp_path / "probe.py"
    script.write_text(PRELUDE.format(body=body))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{probe}: exit {done.returncode}\n{done.stderr[-2000:]}"
    assert done.stdout.strip().endswith("alive")


def test_a_match_times_block_size_past_64_bits_is_left_to_the_twin():
    """The prefill kernel multiplies in 64-bit ints: a product that would overflow is
    left to the twin (Python ints), which scores it right."""
    from helpers import endpoint

    from epp.scheduling.scorers.prefill import _FRESH, PrefillCost, PrefillScorer
    from epp.scheduling.types import SchedulingRequest

    fleet = [endpoint("a"), endpoint("b", port=9001)]
    scorer = PrefillScorer(PrefillCost(0.01, 0.001, 0.0001))
    for big in (2**60, 2**62, 2**63 - 1):
        request = SchedulingRequest(
            request_id="r", base_model="m", block_hashes=[], prefix_match={"a": big, "b": 1},
            prompt_tokens=100, block_size=16, now=0.0,
        )  # fmt: skip
        args = (fleet, scorer._pods, request.prefix_match, 0.0, _FRESH.lane_end)
        assert kernels.SCHEDULING.prefill(*args, 0.01, 0.001, 0.0001, 100, 16) is None
        scores = scorer.score(request, fleet)
        assert scores == scorer.python_score(request, fleet)
        assert scores[0] == 1.0 and scores[1] < 1.0  # the full match is the best
