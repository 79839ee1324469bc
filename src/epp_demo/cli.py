"""`epp demo`: the same seeded workload through the EPP, then through cache-blind baselines.

Each run gets a fresh stack (fresh pods, so every run starts with cold caches), the pods'
prefix-cache counters are scraped before and after, and the summaries are printed side
by side: the table on stdout, progress on stderr.

The simulated pods are tuned so the difference shows in seconds on two cores: a cold
1,500-token system prompt costs ~300 ms of prefill and a warm one a few ms, and a pod's KV
cache (300 blocks of 16 tokens) holds about one group of conversations (a system prompt
of ~95 blocks plus 8 conversations of ~22 blocks each), so a router that keeps each group
on one pod stays warm, while one that scatters the groups over every pod keeps evicting
what the next request needs. Measured: the two runs take ~10 s together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from epp_demo.client import run_workload, scrape_pod_metrics
from epp_demo.report import RunSummary, format_table, summarize
from epp_demo.workload import Workload, WorkloadSpec, generate
from epp_harness.stack import LocalStack, StackError, StackMode, sigterm_as_keyboard_interrupt

# Engine timings of the simulated pods (see the module docstring for why these).
DEMO_SIM_ARGS: tuple[str, ...] = (
    "--num-gpu-blocks", "300",
    "--max-num-seqs", "8",
    "--prefill-overhead-ms", "2",
    "--prefill-per-token-ms", "0.2",
    "--decode-per-token-ms", "2",
)  # fmt: skip

RUN_LABELS: dict[StackMode, str] = {
    "epp": "EPP (prefix+load aware)",
    "round_robin": "Envoy round robin",
    "least_request": "Envoy least request",
}
_PROGRESS_STEPS = 10
_EXIT_FAILED = 1
_EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp demo",
        description="Run a multi-turn shared-prefix chat workload through the EPP and "
        "through Envoy round robin (fresh pods each), and compare.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=4, help="simulated vLLM pods")
    parser.add_argument("--conversations", type=int, default=32, help="chat conversations")
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument(
        "--system-prompts", type=int, default=4, help="distinct shared system prompts"
    )
    parser.add_argument(
        "--system-prompt-tokens", type=int, default=1500, help="tokens per system prompt"
    )
    parser.add_argument(
        "--user-message-tokens", type=int, default=64, help="tokens per user message"
    )
    parser.add_argument("--max-tokens", type=int, default=24, help="output tokens per answer")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    parser.add_argument(
        "--seed", type=int, default=0, help="workload seed (same seed, same prompts)"
    )
    parser.add_argument(
        "--body-mode",
        choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
        default="FULL_DUPLEX_STREAMED",
        help="how Envoy sends request bodies to the EPP",
    )
    parser.add_argument(
        "--baseline",
        action="append",
        choices=["round_robin", "least_request"],
        help="baseline stack(s) to compare with (repeatable; default round_robin)",
    )
    parser.add_argument(
        "--sim-args",
        default=shlex.join(DEMO_SIM_ARGS),
        help="arguments for every simulated pod",
    )
    parser.add_argument("--epp-config", type=Path, help="EPP config YAML file")
    parser.add_argument("--json", type=Path, help="write the summaries to this JSON file")
    parser.add_argument(
        "--keep-logs", type=Path, help="keep each stack's configs and logs under this directory"
    )
    return parser


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _drive(stack: LocalStack, workload: Workload, label: str, concurrency: int) -> RunSummary:
    metrics_urls = {pod.name: pod.metrics_url for pod in stack.pods}
    total = workload.total_requests
    step = max(1, total // _PROGRESS_STEPS)

    def on_progress(done: int, _total: int) -> None:
        if done % step == 0 or done == total:
            _progress(f"  [{label}] {done}/{total} requests done")

    before = await scrape_pod_metrics(metrics_urls)
    started = time.monotonic()
    records = await run_workload(
        stack.envoy_url, workload, concurrency=concurrency, progress=on_progress
    )
    duration = time.monotonic() - started
    after = await scrape_pod_metrics(metrics_urls)
    return summarize(
        label,
        records,
        duration_s=duration,
        metrics_before=before,
        metrics_after=after,
        pods=list(metrics_urls),
    )


def _run_one(
    mode: StackMode, workload: Workload, args: argparse.Namespace, epp_config: str | None
) -> RunSummary:
    label = RUN_LABELS[mode]
    work_dir = args.keep_logs / mode if args.keep_logs else None
    stack = LocalStack(
        pods=args.pods,
        mode=mode,
        body_mode=args.body_mode,
        sim_args=shlex.split(args.sim_args),
        epp_config_yaml=epp_config if mode == "epp" else None,
        work_dir=work_dir,
    )
    _progress(f"starting stack: {label} ({args.pods} pods, {args.body_mode})")
    started = time.monotonic()
    with stack:
        _progress(f"  ready in {time.monotonic() - started:.1f} s at {stack.envoy_url}")
        summary = asyncio.run(_drive(stack, workload, label, args.concurrency))
    for error in summary.error_samples:
        _progress(f"  [{label}] error: {error}")
    return summary


def _write_json(path: Path, spec: WorkloadSpec, summaries: Sequence[RunSummary]) -> None:
    document = {"workload": asdict(spec), "runs": [s.to_dict() for s in summaries]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = WorkloadSpec(
            seed=args.seed,
            system_prompts=args.system_prompts,
            system_prompt_tokens=args.system_prompt_tokens,
            conversations=args.conversations,
            turns=args.turns,
            user_message_tokens=args.user_message_tokens,
            max_tokens=args.max_tokens,
        )
    except ValueError as exc:
        print(f"epp demo: {exc}", file=sys.stderr)
        return 2
    if args.concurrency < 1 or args.pods < 1:
        print("epp demo: --concurrency and --pods must be at least 1", file=sys.stderr)
        return 2
    epp_config = args.epp_config.read_text() if args.epp_config else None
    workload = generate(spec)
    modes: list[StackMode] = ["epp", *(args.baseline or ["round_robin"])]
    _progress(
        f"workload: {spec.conversations} conversations x {spec.turns} turns "
        f"({workload.total_requests} requests), {spec.system_prompts} system prompts of "
        f"~{spec.system_prompt_tokens} tokens, concurrency {args.concurrency}, seed {spec.seed}"
    )
    summaries: list[RunSummary] = []
    failed = False
    demo_started = time.monotonic()
    with sigterm_as_keyboard_interrupt():
        try:
            for mode in modes:
                try:
                    summary = _run_one(mode, workload, args, epp_config)
                except StackError as exc:
                    _progress(f"stack {RUN_LABELS[mode]!r} failed: {exc}")
                    failed = True
                    continue
                summaries.append(summary)
                failed = failed or summary.failed > 0
        except KeyboardInterrupt:
            _progress("interrupted; every process was stopped")
            return _EXIT_INTERRUPTED
    if summaries:
        print(format_table(summaries), end="", flush=True)
    if args.json:
        _write_json(args.json, spec, summaries)
    _progress(f"demo took {time.monotonic() - demo_started:.1f} s")
    return _EXIT_FAILED if failed else 0
