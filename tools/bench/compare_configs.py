"""Mean and median over seeds of the virtual benchmark, per EPP configuration.

One seed of the shared-prefix workload says little: TTFT p90 of the same router moves
1.7-11 s between seeds at 3.5 req/s. This runs each case for N seeds and prints the mean
and median of TTFT p90 and output tokens/s, per configuration (EPP YAML files) and
baseline (round_robin, least_outstanding).

    .venv/bin/python tools/bench/compare_configs.py --seeds 4 \\
        docs/benchmarks/virtual/configs/*.yaml round_robin least_outstanding
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

CASES = (
    ("shared-prefix", ["--kv-fraction", "0.7"], "3.5"),
    ("shared-prefix", ["--kv-fraction", "1.37"], "5.5"),
    ("no-reuse", [], "10,25"),
    ("multi-turn", [], "8"),
)
BASELINES = ("round_robin", "least_outstanding", "random", "consistent_hash")


def run(case: tuple[str, list[str], str], config: str, seed: int, out: Path) -> list[dict]:
    workload, extra, rates = case
    json_path = out / "run.json"
    args = [
        ".venv/bin/epp", "bench", "virtual", "--pods", "8", "--preset", "llama-8b-a100",
        "--out", str(out), "--json", str(json_path), "--json-outcomes", "none",
        "--no-progress", "--workload", workload, "--rates", rates, "--seed", str(seed), *extra,
    ]  # fmt: skip
    if config in BASELINES:
        args += ["--routers", config]
    else:
        args += ["--routers", "epp", "--epp-config", config]
    subprocess.run(args, check=True, capture_output=True)
    return json.loads(json_path.read_text())["results"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("configs", nargs="+", help="EPP YAML files, or baseline router names")
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    print("| case | rate | config | TTFT p90 mean | TTFT p90 median | output tok/s |")
    print("|---|---:|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            rows: dict[tuple[float, str], list[tuple[float, float]]] = {}
            for config in args.configs:
                for seed in range(args.seeds):
                    for result in run(case, config, seed, Path(tmp)):
                        summary = result["summary"]
                        key = (result["rate"], Path(config).stem)
                        rows.setdefault(key, []).append(
                            (summary["ttft_p90_s"], summary["output_tokens_per_s"])
                        )
            name = " ".join([case[0], *case[1][1:]])
            for (rate, config), values in sorted(rows.items()):
                p90 = [v[0] for v in values]
                tok = [v[1] for v in values]
                print(
                    f"| {name} | {rate:g} | {config} | {statistics.mean(p90):.2f} s"
                    f" | {statistics.median(p90):.2f} s | {statistics.mean(tok):,.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
