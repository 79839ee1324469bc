"""Compare the captures of real vLLM and `epp sim` and write docs/benchmarks/sim-vs-vllm.md.

    .venv/bin/python tools/vllm_check/compare.py [--captures DIR] [--out FILE]

The comparison itself lives in the sim_vs_vllm package next to this file: pure functions
over the two captures, which tests/tools/test_vllm_check.py calls directly. This is the
command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_vs_vllm import findings, load, render

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "docs" / "benchmarks" / "sim-vs-vllm"
REPORT = ROOT / "docs" / "benchmarks" / "sim-vs-vllm.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--captures", type=Path, default=CAPTURES)
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    vllm, sim = load(args.captures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(vllm, sim))
    print(f"wrote {args.out}")
    for f in findings(vllm, sim):
        print(f"  {f.verdict:8s} {f.topic}")


if __name__ == "__main__":
    main()
