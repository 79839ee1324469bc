from __future__ import annotations

import pytest

from epp.request import parse_request
from epp_bench.picker.pause import SHAPES, Phase, _fmt_phases, _fmt_steps, in_process, make_body


def test_bodies_of_every_shape_parse_and_have_about_the_size_asked():
    for shape in SHAPES:
        path, body = make_body(shape, 100_000)
        assert 80_000 < len(body) < 120_000
        parse_request(path, body, {})


def test_in_process_times_every_step_for_every_shape():
    rows = in_process([0.05], repeats=1)
    assert [r.shape for r in rows] == list(SHAPES)
    steps = ("json_loads_ms", "msgspec_ms", "parse_ms", "blocks_ms", "match_ms", "record_ms")
    for row in rows:
        assert row.mib == pytest.approx(0.05, rel=0.2)  # the body size asked for
        assert all(getattr(row, step) > 0 for step in steps), row
        assert row.total_ms == pytest.approx(
            row.parse_ms + row.blocks_ms + row.match_ms + row.record_ms
        )
    assert "| chat-many |" in _fmt_steps(rows)


def test_phase_buckets_from_cumulative_counts():
    phase = Phase("x", lag_buckets={"0.01": 5, "0.05": 7, "0.1": 9, "+Inf": 9})
    assert phase.worst_lag_bucket() == (0.05, 0.1)
    assert phase.lag_over(0.05) == 2 and phase.lag_samples == 9
    phase.route_buckets = {"100.0": 3, "51200.0": 4, "+Inf": 4}
    assert phase.worst_route_bucket_us() == (100.0, 51200.0)
    assert "| x |" in _fmt_phases([phase])
