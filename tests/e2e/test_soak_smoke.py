"""`epp bench soak` end to end, one short minute at a low rate through the real stack
(real Envoy, `epp serve`, simulated pods): the bench runs, every request is answered, and
the EPP's own sampling works as the soak needs it (RSS and fds from /proc; the asyncio
task count, which is only non-zero when /metrics is rendered on the EPP's loop, and the
decision-latency histogram from its page).

No timing is asserted: a verdict on slopes or latency belongs to the benchmark's page
(docs/benchmarks/soak.md), not to a test on a shared machine."""

from __future__ import annotations

import json
import math

import pytest

from epp_bench.soak.cli import main

pytestmark = pytest.mark.e2e


def test_a_short_soak_runs_and_samples_the_epp(tmp_path):
    out = tmp_path / "soak.json"
    main(
        [
            "--minutes", "1", "--rate", "5", "--sample-seconds", "5",
            "--burst-seconds", "1", "--recovery-seconds", "5",
            "--out", str(tmp_path / "soak.md"), "--json", str(out),
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    (minute,) = result["minutes"]
    assert minute["requests"] == 300 and minute["failed"] == 0
    assert result["burst_statuses"] == {"200": 50}
    samples = result["samples"]
    assert len(samples) >= 5
    for sample in samples:
        assert sample["rss_mb"] > 10 and sample["open_fds"] > 5
        assert not math.isnan(sample["asyncio_tasks"]) and sample["asyncio_tasks"] >= 1
        assert sample["index_nodes"] >= 0
    # Every request was a decision: the histogram's +Inf bucket (JSON writes the key so).
    assert samples[-1]["decision_buckets"]["Infinity"] >= 300
    assert "## Burst of 10x" in (tmp_path / "soak.md").read_text()
