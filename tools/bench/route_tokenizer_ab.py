"""`Router.route` for new chats with a model's tokenizer, a frozen commit against the work tree.

The `--engine` rows of `epp bench tokenize` (the whole decision for a new 4,096-token chat,
the tokenizer given as its files, one pod whose index fills and evicts as new
conversations arrive). Each code runs in its own child process, and the two take turns
in batches of `--batch` decisions: on a shared machine whose load moves within seconds,
a whole run per code compares two loads as much as two codes, while neighbouring batches
see the same one. Prints each code's p50 over all its decisions and the median of the
per-pair ratios (after / before).

    .venv/bin/python tools/bench/route_tokenizer_ab.py --before 143ca19 [--pairs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import bench_tokenizer

REPO = Path(__file__).resolve().parents[2]

# Reads a batch size per line and answers with that many decisions' times (us) as JSON.
# Every decision is a conversation not seen before (argv[2] of them are made: the warm-up's
# and the batches'), so none finds its prefix in the tokenizer's cache.
CHILD = r"""
import asyncio, json, os, random, sys, time
from pathlib import Path
import epp_bench.picker.tokenize as tb
from epp.observability.logs import configure_logging
from epp.request import IncomingRequest
from epp.tokenization import load_tokenizer_dir

configure_logging("info", stream=open(os.devnull, "w"))
directory = Path(sys.argv[1])
tok = load_tokenizer_dir(directory)
bodies = [tb._chat_body(tb._conversation(random.Random(50_000 + i), tok, 4096, 8)) for i in range(int(sys.argv[2]))]

async def main() -> None:
    router, store = tb._router(9, {"path": str(directory)})
    done = 0

    async def batch(n: int) -> list[float]:
        nonlocal done
        samples = []
        for _ in range(n):
            body = bodies[done]
            tb._fresh_page(store)
            start = time.perf_counter()
            routed = await router.route(IncomingRequest(path=tb.CHAT, body=body, request_id=f"r{done}"))
            samples.append((time.perf_counter() - start) * 1e6)
            router.complete(routed.token, 200)
            done += 1
        return samples

    await batch(100)  # warms the interpreter and the piece cache, fills the index
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(await batch(int(line))), flush=True)

asyncio.run(main())
"""


def _start(code: str, tokenizer: Path, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-P", "-c", CHILD, str(tokenizer), str(count)],
        env={**os.environ, "PYTHONPATH": code}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a commit, frozen with its kernels")
    parser.add_argument("--pairs", type=int, default=40, help="batches per code, alternated")
    parser.add_argument("--batch", type=int, default=10, help="decisions per batch")
    bench_tokenizer.add_argument(parser)
    args = parser.parse_args(argv)
    args.tokenizer = bench_tokenizer.directory(args.tokenizer)
    frozen = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench" / "freeze_code.py"), args.before],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    codes = {"before": json.loads(frozen.stdout)["path"], "after": str(REPO / "src")}
    count = 100 + args.pairs * args.batch
    children = {label: _start(code, args.tokenizer, count) for label, code in codes.items()}
    samples: dict[str, list[float]] = {label: [] for label in codes}
    ratios: list[float] = []
    try:
        for child in children.values():
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("a child did not start; run it alone to see why")
        for _ in range(args.pairs):
            p50 = {}
            # Either code first, by turns: the second of a pair finds the caches as the
            # first left them.
            for label, child in sorted(children.items(), reverse=len(ratios) % 2 == 1):
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{args.batch}\n")
                child.stdin.flush()
                batch = json.loads(child.stdout.readline())
                samples[label].extend(batch)
                p50[label] = statistics.median(batch)
            ratios.append(p50["after"] / p50["before"])
    finally:
        for child in children.values():
            if child.stdin is not None:
                child.stdin.close()
            child.wait(30)
    for label, values in samples.items():
        p10 = statistics.quantiles(values, n=10)[0]
        print(f"{label}: p10 {p10:,.0f} us, p50 {statistics.median(values):,.0f} us "
              f"over {len(values)} decisions")  # fmt: skip
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"after / before, median of {len(ratios)} neighbouring batches: "
          f"{statistics.median(ratios):.2f} (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f})")  # fmt: skip
    print(f"command: .venv/bin/python tools/bench/route_tokenizer_ab.py --before {args.before} "
          f"--pairs {args.pairs} --batch {args.batch}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
