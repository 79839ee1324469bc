"""`Router.route` for new chats with a model's tokenizer, a frozen commit against the work tree.

The `--engine` rows of `epp bench tokenize` (the whole decision for a new 4,096-token chat,
the tokenizer given as its files, one pod whose index fills and evicts as new
conversations arrive), measured in a child process per code, the codes alternating over
`--rounds`; prints each round's p50 and the medians.

    .venv/bin/python tools/bench/route_tokenizer_ab.py --before 143ca19 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import asyncio, os, random, statistics, sys, time
from pathlib import Path
import epp_bench.picker.tokenize as tb
from epp.observability.logs import configure_logging
from epp.request import IncomingRequest
from epp.tokenization import load_tokenizer_dir

configure_logging("info", stream=open(os.devnull, "w"))
directory = Path(sys.argv[1])
tok = load_tokenizer_dir(directory)
bodies = [tb._chat_body(tb._conversation(random.Random(50_000 + i), tok, 4096, 8)) for i in range(500)]

async def main() -> None:
    router, store = tb._router(9, {"path": str(directory)})
    samples = []
    for i, body in enumerate(bodies):
        tb._fresh_page(store)
        start = time.perf_counter()
        routed = await router.route(IncomingRequest(path=tb.CHAT, body=body, request_id=f"r{i}"))
        if i >= 100:  # the first ones warm the interpreter and the piece cache
            samples.append(time.perf_counter() - start)
        router.complete(routed.token, 200)
    print(statistics.median(samples) * 1e6)

asyncio.run(main())
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a commit, frozen with its kernels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokenizer", type=Path, default=REPO / ".bench" / "tiny-llama")
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").is_file():
        args.tokenizer = REPO / "tests" / "fixtures" / "tokenizer" / "tiny-llama"
    frozen = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench" / "freeze_code.py"), args.before],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    codes = {"before": json.loads(frozen.stdout)["path"], "after": str(REPO / "src")}
    p50s: dict[str, list[float]] = {label: [] for label in codes}
    for _ in range(args.rounds):
        for label, code in codes.items():
            done = subprocess.run(
                [sys.executable, "-P", "-c", CHILD, str(args.tokenizer)],
                env={**os.environ, "PYTHONPATH": code}, capture_output=True, text=True,
                check=True,
            )  # fmt: skip
            p50s[label].append(float(done.stdout.strip().splitlines()[-1]))
    for label, values in p50s.items():
        rounds = " / ".join(f"{v:,.0f}" for v in values)
        print(f"{label}: p50 per round {rounds} us, median {statistics.median(values):,.0f} us")
    print(f"command: .venv/bin/python tools/bench/route_tokenizer_ab.py --before {args.before} "
          f"--rounds {args.rounds}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
