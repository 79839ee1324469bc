"""What the live-benchmark tests share (tests/epp_bench): where `.bench/` is, and simulator
arguments that make a pod answer in milliseconds."""

from __future__ import annotations

from epp_bench.live.bench_dir import BenchDir, default_bench_dir

BENCH = BenchDir(default_bench_dir())
FAST_SIM = (
    "--prefill-overhead-ms", "1",
    "--prefill-per-token-ms", "0.01",
    "--decode-per-token-ms", "1",
)  # fmt: skip
