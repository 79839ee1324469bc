"""Where `Router.route`'s time goes with a model's tokenizer: each part's mean, timed by a
wrapper around it (about 0.1 us each), for new 4,096-token chats (one pod whose index fills
and evicts) and for turn N (the same chat's turn N-1 routed just before it).

Parts nest (the tokenizer's head inside its chat encode, the record inside dispatch):
read each against its parent, not as a sum.

    .venv/bin/python tools/bench/route_parts.py [--decisions 400]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

import bench_tokenizer  # noqa: E402

import epp_bench.picker.tokenize as tb  # noqa: E402
from epp.observability.logs import configure_logging  # noqa: E402
from epp.prefix import approximate  # noqa: E402
from epp.request import IncomingRequest  # noqa: E402
from epp.routing import dispatch, observation, preparation  # noqa: E402
from epp.tokenization import hf, load_tokenizer_dir  # noqa: E402

PARTS: tuple[tuple[Any, str, str], ...] = (
    (preparation.Preparation, "_parse", "parse (JSON body, model)"),
    (preparation.Preparation, "_prepared", "tokenize and hash"),
    (hf.HfTokenizer, "encode_chat_prefix", "  tokenizer: chat encode"),
    (hf.HfTokenizer, "render_chat", "    template"),
    (hf.HfTokenizer, "encode_text_head", "    text head"),
    (hf.HfTokenizer, "_boundaries", "      special tokens and cache keys"),
    (hf.HfTokenizer, "_cached_base", "      prefix cache lookup"),
    (hf.HfTokenizer, "_fast_from", "      fast path (kernel calls)"),
    (hf.HfTokenizer, "_store", "      prefix cache store"),
    (dispatch.Dispatcher, "dispatch", "dispatch"),
    (dispatch.Dispatcher, "_scheduling_request", "  index match"),
    (dispatch.Dispatcher, "_schedule", "  filter, score, pick"),
    (approximate, "record", "  index record (and eviction)"),
    (observation.DecisionObserver, "_count", "  decision metrics"),
    (observation.DecisionObserver, "_log_routed", "  decision log line"),
)


class Timers:
    def __init__(self) -> None:
        self.spent: dict[str, int] = {}
        self.on = False

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0) + time.perf_counter_ns() - start

        setattr(owner, name, timed)


async def run(directory: Path, decisions: int, timers: Timers) -> dict[str, list[float]]:
    cold = load_tokenizer_dir(directory, cache_bytes=0)
    warm = 100
    chats = [tb._conversation(random.Random(60_000 + i), cold, 4096, 8) for i in range(warm + decisions)]  # fmt: skip
    router, store = tb._router(9, {"path": str(directory)})
    routes: dict[str, list[float]] = {"new chat": [], "turn N": []}
    spent: dict[str, dict[str, int]] = {}
    for case in routes:
        timers.spent = spent[case] = {}
        for i, chat in enumerate(chats):
            turns = [(chat[:-2], "turn N-1"), (chat, "turn N")] if case == "turn N" else [(chat, "new chat")]  # fmt: skip
            for messages, what in turns:
                body = tb._chat_body(messages)
                measured = i >= warm and what == case
                tb._fresh_page(store)
                timers.on = measured
                start = time.perf_counter_ns()
                routed = await router.route(IncomingRequest(path=tb.CHAT, body=body, request_id=f"{case}-{what}-{i}"))  # fmt: skip
                elapsed = time.perf_counter_ns() - start
                timers.on = False
                router.complete(routed.token, 200)
                if measured:
                    routes[case].append(elapsed / 1000)
        # Turn N's chats are new ones again (their seeds differ from the new-chat pass).
        chats = [tb._conversation(random.Random(70_000 + i), cold, 4096, 8) for i in range(warm + decisions)]  # fmt: skip
    for case, values in routes.items():
        p10 = statistics.quantiles(values, n=10)[0]
        print(f"\n{case}: Router.route p10 {p10:,.0f} us, p50 {statistics.median(values):,.0f} us, "
              f"mean {statistics.mean(values):,.0f} us over {len(values)}; parts (mean us):")  # fmt: skip
        for _, _, label in PARTS:
            print(f"  {label:<40} {spent[case].get(label, 0) / len(values) / 1000:8.1f}")
    return routes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=400)
    bench_tokenizer.add_argument(parser)
    args = parser.parse_args(argv)
    args.tokenizer = bench_tokenizer.directory(args.tokenizer)
    configure_logging("info", stream=open(os.devnull, "w"))  # noqa: SIM115 - for the process
    timers = Timers()
    for owner, name, label in PARTS:
        timers.wrap(owner, name, label)
    asyncio.run(run(args.tokenizer, args.decisions, timers))
    print(f"\ncommand: .venv/bin/python tools/bench/route_parts.py --decisions {args.decisions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
