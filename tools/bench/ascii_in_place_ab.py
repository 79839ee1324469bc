"""`Router.route` for new 4,096-token chats, an ASCII prompt's segments encoded in place
against sliced and checked one by one (`FastByteLevelBpe.takes_whole` answering False,
which is the code before bcdd233), in one process: batches of `--batch` decisions take
turns, so both arms see the same load and the same index.

    .venv/bin/python tools/bench/ascii_in_place_ab.py [--decisions 1000] [--batch 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

import bench_tokenizer  # noqa: E402

import epp_bench.picker.tokenize as tb  # noqa: E402
from epp.observability.logs import configure_logging  # noqa: E402
from epp.request import IncomingRequest  # noqa: E402
from epp.tokenization import load_tokenizer_dir  # noqa: E402
from epp.tokenization.fast import FastByteLevelBpe  # noqa: E402


async def run(directory: Path, decisions: int, batch: int) -> dict[str, list[float]]:
    tok = load_tokenizer_dir(directory)
    warm = 100
    bodies = [tb._chat_body(tb._conversation(random.Random(50_000 + i), tok, 4096, 8)) for i in range(warm + decisions)]  # fmt: skip
    router, store = tb._router(9, {"path": str(directory)})
    in_place = FastByteLevelBpe.takes_whole
    samples: dict[str, list[float]] = {"in place": [], "sliced": []}
    try:
        for i, body in enumerate(bodies):
            arm = "in place" if (i // batch) % 2 == 0 else "sliced"
            FastByteLevelBpe.takes_whole = in_place if arm == "in place" else lambda _s, _t: False  # type: ignore[method-assign]
            tb._fresh_page(store)
            start = time.perf_counter()
            routed = await router.route(
                IncomingRequest(path=tb.CHAT, body=body, request_id=f"r{i}")
            )
            elapsed = time.perf_counter() - start
            router.complete(routed.token, 200)
            if i >= warm:  # the first ones warm the interpreter and the piece cache
                samples[arm].append(elapsed * 1e6)
    finally:
        FastByteLevelBpe.takes_whole = in_place  # type: ignore[method-assign]
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=20)
    bench_tokenizer.add_argument(parser)
    args = parser.parse_args(argv)
    args.tokenizer = bench_tokenizer.directory(args.tokenizer)
    configure_logging("info", stream=open(os.devnull, "w"))  # noqa: SIM115 - for the process
    samples = asyncio.run(run(args.tokenizer, args.decisions, args.batch))
    for arm, values in samples.items():
        p10 = statistics.quantiles(values, n=10)[0]
        print(
            f"{arm}: p10 {p10:,.0f} us, p50 {statistics.median(values):,.0f} us over {len(values)}"
        )
    print(f"command: .venv/bin/python tools/bench/ascii_in_place_ab.py --decisions {args.decisions} "
          f"--batch {args.batch}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
