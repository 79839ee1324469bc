"""`epp bench tokenize` runs end to end and writes its page (a smoke test: timings are
measured by the benchmark, never asserted)."""

from __future__ import annotations

import json

from tokenizer_fixtures import FIXTURES

from epp_bench.cli import BENCHMARKS
from epp_bench.picker import tokenize as bench


def test_tokenize_bench_writes_its_page(tmp_path) -> None:
    assert "tokenize" in BENCHMARKS
    out = tmp_path / "tokenize"
    argv = ["--iterations", "3", "--prompt-tokens", "512", "--tokenizer", str(FIXTURES / "llama3")]
    assert bench.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    cases = [row["case"] for row in rows]
    assert any("turn N, cache warm" in c for c in cases) and any(
        "every word new" in c for c in cases
    )
    assert all(row["p50_us"] > 0 for row in rows)
    assert "epp bench tokenize" in out.with_suffix(".md").read_text()


def test_the_before_column_runs_a_code_in_a_child_and_pairs_the_rows(tmp_path) -> None:
    """`--before`: the rows come from a child process importing the given code (here the
    work tree), and the page pairs each row of both codes by tokenizer and case."""
    from epp_bench.picker.overhead import WORK_TREE_SRC

    rows = bench.child_rows(WORK_TREE_SRC, FIXTURES / "llama3", 3, 256)
    assert rows and all(isinstance(r, bench.Row) for r in rows)
    assert any(r.case == "decision: byte estimate" for r in rows)
    before = [bench.Row("t", "decision: a", 10, 200.0, 0.0, 0.0), bench.Row("t", "only before", 1, 5.0, 0, 0)]  # fmt: skip
    after = [bench.Row("t", "decision: a", 10, 50.0, 0.0, 0.0), bench.Row("t", "only after", 1, 5.0, 0, 0)]  # fmt: skip
    lines = bench.compared_markdown("abc1234", {"before": before, "after": after}, 3)
    assert "| t | decision: a | 200 | 50 | 0.25 |" in lines
    assert not [line for line in lines if "only" in line]
