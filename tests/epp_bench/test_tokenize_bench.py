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
