"""`epp bench live`: routers side by side on real processes, fresh pods for each.

    epp bench live [--routers epp,envoy_round_robin,...] [--workload shared-prefix-small]
                   [--rates 4,8,10] [--pods 4] [--sim-args "..."]
                   [--client ours|inference-perf|both] [--duration-s N] [--repeats N]
                   [--out docs/benchmarks/live]
    epp bench live --replot .bench/results/<file>.json --out DIR
    epp bench live --precise-report DIR --out docs/benchmarks/precise-live.md

Precise against approximate mode: `--routers epp_precise,epp_approx,envoy_round_robin
--tokenizer DIR` (the pods publish KV events on ports of their own and the EPP follows
them; pods and EPP share a tokenizer trained on the workload; tools/bench/precise_live.sh).

Prints the tables, writes `<out>/<stem>.json` (per router and rate, the repeats pooled:
summaries, TTFT quantiles, CPU, occupancy, placement), `<out>/<stem>-meta.json` (machine,
settings, git state, the command, skipped runs) and PNG plots, and prints the command
that reproduces them. Every request of every repeat goes to `.bench/results/`, outside
the repository, from which `--replot` redoes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epp_bench.live.bench_dir import BenchDir, default_bench_dir, repo_root
from epp_bench.live.frozen_code import children_import, choose_code
from epp_bench.live.inference_perf import InferencePerfError
from epp_bench.live.precise_report import write_page
from epp_bench.live.routers import ROUTERS, RouterSpec, unavailable_reason
from epp_bench.live.runner import (
    DEFAULT_SIM_ARGS,
    ClientKind,
    LiveSettings,
    git_state,
    live_workload,
    run_once,
    sim_config,
    wait_for_quiet,
)
from epp_bench.live.workload_tokenizer import ensure_tokenizer
from epp_bench.reports import tables as report
from epp_bench.reports.live import (
    cpu_table,
    diagnosis_table,
    pool_repeats,
    repeats_table,
    target_checks,
    targets_table,
)
from epp_bench.workloads.catalog import WORKLOADS
from epp_bench.workloads.types import RunResult
from epp_harness.stack import StackError

DEFAULT_ROUTERS = tuple(name for name, spec in ROUTERS.items() if spec.in_default_set)


def build_parser() -> argparse.ArgumentParser:
    defaults = LiveSettings()
    parser = argparse.ArgumentParser(
        prog="epp bench live",
        description=(
            "Run each router in front of fresh simulated pods on 127.0.0.1 and drive the "
            "same workload through it: our EPP behind Envoy, Envoy's own round robin and "
            "least request, sglang-router and vllm-router (cache_aware). Peers and "
            "inference-perf come from .bench/ (.venv/bin/python tools/bench/install_peers.py)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--routers", default=",".join(DEFAULT_ROUTERS), help=f"subset of {list(ROUTERS)}"
    )
    parser.add_argument("--workload", default=defaults.workload, choices=WORKLOADS)
    parser.add_argument(
        "--rates",
        default=",".join(f"{r:g}" for r in defaults.rates),
        help="offered rates (req/s; conversations/s for multi-turn)",
    )
    parser.add_argument("--pods", type=int, default=defaults.pods)
    parser.add_argument(
        "--epp-config",
        type=Path,
        default=None,
        help="`epp serve --config` file for the EPP routers (e.g. other scorer weights)",
    )
    parser.add_argument(
        "--sim-args",
        default=" ".join(DEFAULT_SIM_ARGS),
        help="arguments for every `epp sim` pod",
    )
    parser.add_argument(
        "--client", choices=["ours", "inference-perf", "both"], default="ours", help="load client"
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=defaults.duration_s,
        help="requests arriving later are dropped (bounds every run)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=defaults.drain_s,
        help="after the last arrival, hard deadline for requests in flight",
    )
    parser.add_argument("--max-in-flight", type=int, default=defaults.max_in_flight)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (rate, router)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/live"))
    parser.add_argument(
        "--logs", type=Path, default=None, help="keep process logs here (default: .bench/logs)"
    )
    parser.add_argument(
        "--code",
        default="head",
        help="code the pods and the EPP run: 'head' (HEAD's commit, frozen for the whole "
        "campaign), a commit, or 'worktree' (the work tree as it is at each start)",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="redo tables, plots and --out files from a raw results file of .bench/results/",
    )
    parser.add_argument(
        "--setup",
        action="store_true",
        help="install missing tools under .bench/ first (runs tools/bench/install_peers.py)",
    )
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.5,
        help="before each run, wait until the machine uses fewer cores than this",
    )
    parser.add_argument(
        "--quiet-wait-s", type=float, default=60.0, help="longest wait for a quiet machine"
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="every pod publishes KV events (on by itself when a router needs them, e.g."
        " epp_precise, so that every router of the run has the same pods)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer directory for the pods (--tokenizer) and the EPP (tokenizers:);"
        " trained on the workload's text there if it has no tokenizer.json",
    )
    parser.add_argument(
        "--name", default=None, help="stem of the output files (default: the workload)"
    )
    parser.add_argument(
        "--precise-report",
        type=Path,
        default=None,
        help="write the precise-vs-approximate page (--out FILE.md) from the *-runs.json"
        " files in this directory, without running",
    )
    return parser


def _install_peers(repo: Path, bench: BenchDir) -> None:
    """Run the installer of the peers and inference-perf (missing tools are not fatal)."""
    tool = repo / "tools" / "bench" / "install_peers.py"
    argv = [sys.executable, str(tool), "--bench-dir", str(bench.root)]
    subprocess.run(argv, stdout=sys.stderr, check=False)


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(part) for part in text.split(",") if part.strip())
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates must be positive numbers, got {text!r}")
    return rates


def _block_size(epp_config: Path | None) -> int:
    """The EPP's prefix.block_size (what turns its logged cache match into tokens)."""
    config = yaml.safe_load(epp_config.read_text()) if epp_config else None
    prefix = (config or {}).get("prefix") or {}
    return int(prefix.get("block_size", 16))


def _clients(choice: str) -> list[ClientKind]:
    return ["ours", "inference-perf"] if choice == "both" else [choice]  # type: ignore[list-item]


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, unit="req", dynamic_ncols=True, leave=True)


def _reproduce_command(args: argparse.Namespace, settings: LiveSettings, commit: str) -> str:
    """Every setting spelled out, so that later changes of the defaults do not matter."""
    parts = [
        "epp", "bench", "live",
        "--routers", args.routers,
        "--workload", settings.workload,
        "--rates", ",".join(f"{r:g}" for r in settings.rates),
        "--pods", str(settings.pods),
        # As given: --tokenizer adds itself to the pods' arguments.
        "--sim-args", args.sim_args,
        "--client", args.client,
        "--duration-s", f"{settings.duration_s:g}",
        "--drain-s", f"{settings.drain_s:g}",
        "--max-in-flight", str(settings.max_in_flight),
        "--repeats", str(args.repeats),
        "--code", commit if args.code == "head" else args.code,
        "--seed", str(settings.seed),
        *(["--epp-config", str(args.epp_config)] if args.epp_config else []),
        *(["--kv-events"] if args.kv_events else []),
        *(["--tokenizer", str(args.tokenizer)] if args.tokenizer else []),
        *(["--name", args.name] if args.name else []),
        "--quiet-below", f"{args.quiet_below:g}",
        "--quiet-wait-s", f"{args.quiet_wait_s:g}",
        "--out", str(args.out),
    ]  # fmt: skip
    return " ".join(shlex.quote(p) for p in parts)


def _write_outputs(pooled: list[RunResult], out: Path, stem: str) -> list[Path]:
    """Summaries JSON (small: committed) and the plots, from the pooled results."""
    written = [report.save_results(pooled, out / f"{stem}.json", outcomes=False)]
    labels = sorted({r.workload for r in pooled})
    for label in labels:
        runs = [r for r in pooled if r.workload == label]
        # One workload: the plots take the files' stem (--name: two scenarios of one
        # workload must not overwrite each other's plots).
        plot = (
            stem
            if len(labels) == 1
            else label.replace(" (inference-perf)", "-inference-perf").replace(" ", "-")
        )
        if len({r.rate for r in runs}) > 1:
            written.append(report.plot_vs_rate(runs, out / f"{plot}-vs-rate.png"))
        for rate in sorted({r.rate for r in runs if r.rate is not None}):
            at_rate = [r for r in runs if r.rate == rate]
            written.append(report.plot_ttft_cdf(at_rate, out / f"{plot}-ttft-cdf-{rate:g}.png"))
    return written


def _print_tables(pooled: list[RunResult]) -> None:
    for label in sorted({r.workload for r in pooled}):
        runs = [r for r in pooled if r.workload == label]
        print(f"\n## {label}\n")
        for rate in sorted({r.rate for r in runs if r.rate is not None}):
            print(f"### {rate:g} req/s\n")
            print(report.markdown_table([r for r in runs if r.rate == rate]))
        if len({r.rate for r in runs}) > 1:
            print("### ladder\n")
            print(report.ladder_table(runs))
        print("### CPU (cores) and simulated-GPU occupancy\n")
        print(cpu_table(runs))
        print("### where the TTFT comes from\n")
        print(diagnosis_table(runs))
        if any(r.extra.get("repeats") for r in runs):
            print("### spread over the repeats\n")
            print(repeats_table(runs))
    checks = target_checks(pooled)
    if checks:
        print("\n## Targets: EPP vs sglang-router cache_aware (same pods)\n")
        print(targets_table(checks))


@dataclass(slots=True)
class _Campaign:
    """Everything a sequence of runs produced, for the report and the meta file."""

    results: list[RunResult] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    quiet_waits: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False


def _run_campaign(
    args: argparse.Namespace,
    settings: LiveSettings,
    bench: BenchDir,
    routers: list[RouterSpec],
    clients: list[ClientKind],
    campaign: _Campaign,
) -> None:
    """Every (repeat, rate, client, router) run in turn; fills `campaign` as runs finish."""
    workloads = {
        rate: live_workload(settings.workload, rate, settings.seed, settings.duration_s)
        for rate in settings.rates
    }
    per_round = sum(len(w.requests) for w in workloads.values()) * len(routers)
    total = per_round * args.repeats * clients.count("ours")
    bar = _progress_bar(total) if total else None
    logs_root = args.logs or bench.root / "logs"
    prefix = f"{args.name}-" if args.name else ""
    try:
        for repeat in range(args.repeats):
            for rate, workload in workloads.items():
                for client in clients:
                    for spec in router_order(routers, repeat):
                        label = f"{spec.name} @ {rate:g}" + (
                            "" if client == "ours" else " (inference-perf)"
                        )
                        if bar is not None:
                            bar.set_description(label)
                        busy = wait_for_quiet(args.quiet_below, args.quiet_wait_s)
                        campaign.quiet_waits.append(
                            {"run": label, "repeat": repeat, "busy_cores_before": round(busy, 3)}
                        )
                        try:
                            result = run_once(
                                spec,
                                bench,
                                workload,
                                rate,
                                settings,
                                client,
                                # Named after the scenario too: campaigns of one
                                # workload at one rate must not overwrite each other's.
                                work_dir=logs_root
                                / f"{prefix}{spec.name}-{rate:g}-{client}-{repeat}",
                                progress=(lambda _o: bar.update(1)) if bar is not None else None,
                            )
                        except (StackError, InferencePerfError, ValueError) as exc:
                            campaign.skipped.append({"run": label, "reason": str(exc)[:2000]})
                            print(f"\n{label} failed: {exc}", file=sys.stderr)
                            continue
                        result.extra["repeat"] = repeat
                        result.extra["busy_cores_before"] = round(busy, 3)
                        campaign.results.append(result)
    except KeyboardInterrupt:
        campaign.interrupted = True
        print("\ninterrupted: every process was stopped; reporting what finished", file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()


def router_order(routers: list[RouterSpec], repeat: int) -> list[RouterSpec]:
    """The routers of one round: reversed on odd repeats (A B C, C B A, ...), so that a
    machine getting busier or quieter during the campaign weighs on every router alike."""
    return list(routers) if repeat % 2 == 0 else list(reversed(routers))


def _output_stem(workload: str, client: str, name: str | None = None) -> str:
    """File names say the workload (or `--name`), and the client unless it is ours alone."""
    base = name or workload
    return base if client == "ours" else f"{base}-{client}"


def _report(results: list[RunResult], out: Path, stem: str, meta: dict[str, Any]) -> None:
    pooled = pool_repeats(results)
    _print_tables(pooled)
    written = _write_outputs(pooled, out, stem)
    # Every repeat on its own (summaries only): ratios measured side by side, run by run.
    written.append(report.save_results(results, out / f"{stem}-runs.json", outcomes=False))
    meta_path = out / f"{stem}-meta.json"
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    written.append(meta_path)
    print("\nwrote:")
    for path in written:
        print(f"  {path}")
    print(f"\nreproduce with:\n  {meta['command']}")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.precise_report is not None:
        print(f"wrote {write_page(args.precise_report, args.out)}")
        return 0
    if args.replot is not None:
        # Tables, plots and summaries again from a raw results file, without running.
        raw = json.loads(Path(str(args.replot).replace(".json", "-meta.json")).read_text())
        results = report.load_results(args.replot)
        settings = raw["settings"]
        stem = _output_stem(settings["workload"], raw.get("client_choice", "ours"), raw.get("name"))
        _report(results, args.out, stem, raw)
        return 0
    try:
        rates = _rates(args.rates)
    except ValueError as exc:
        parser.error(str(exc))
    names = [name.strip() for name in args.routers.split(",") if name.strip()]
    unknown = [name for name in names if name not in ROUTERS]
    if unknown:
        parser.error(f"unknown routers {unknown}; choose from {list(ROUTERS)}")
    try:
        sim_args = tuple(shlex.split(args.sim_args))
        if args.tokenizer is not None:
            # Absolute: the pods run in their own work directories.
            directory = ensure_tokenizer(
                args.tokenizer.resolve(), [live_workload(args.workload, rates[0], args.seed, 1e9)]
            )
            sim_args += ("--tokenizer", str(directory))
        sim_config(sim_args)
    except ValueError as exc:
        parser.error(str(exc))
    settings = LiveSettings(
        workload=args.workload,
        rates=rates,
        pods=args.pods,
        sim_args=sim_args,
        duration_s=args.duration_s,
        drain_s=args.drain_s,
        max_in_flight=args.max_in_flight,
        seed=args.seed,
        epp_args=("--config", str(args.epp_config.resolve())) if args.epp_config else (),
        kv_events=args.kv_events or any(ROUTERS[name].needs_kv_events for name in names),
        block_size=_block_size(args.epp_config),
    )
    bench = BenchDir(default_bench_dir())
    repo = repo_root()
    if repo is None:
        parser.error("the live benchmark runs from a clone of the repository (editable install)")
    if args.setup:
        _install_peers(repo, bench)
    campaign = _Campaign()
    routers = []
    for name in names:
        reason = unavailable_reason(ROUTERS[name], bench)
        if reason:
            campaign.skipped.append({"router": name, "reason": reason})
            print(f"skipping {name}: {reason}", file=sys.stderr)
        else:
            routers.append(ROUTERS[name])
    clients = _clients(args.client)
    if "inference-perf" in clients and not (
        bench.installed("inference-perf") and bench.tokenizer_ready()
    ):
        reason = f"inference-perf or its tokenizer not installed under {bench.root}"
        campaign.skipped.append({"client": "inference-perf", "reason": reason})
        print(f"skipping the inference-perf client: {reason}", file=sys.stderr)
        clients = [c for c in clients if c != "inference-perf"]

    try:
        code = choose_code(args.code, repo, bench.code_root)
    except RuntimeError as exc:
        parser.error(str(exc))
    started = time.monotonic()
    with children_import(code):
        print(f"pods and EPP run {code.choice} code ({code.commit[:12]}, {code.path})",
              file=sys.stderr)  # fmt: skip
        _run_campaign(args, settings, bench, routers, clients, campaign)
    wall_s = time.monotonic() - started
    if not campaign.results:
        print("no run finished", file=sys.stderr)
        return 130 if campaign.interrupted else 1
    meta = {
        "command": _reproduce_command(args, settings, code.commit),
        "wall_s": round(wall_s, 1),
        "settings": asdict(settings),
        "routers": {spec.name: spec.description for spec in routers},
        "clients": clients,
        "client_choice": args.client,
        "name": args.name,
        "skipped": campaign.skipped,
        "quiet_waits": campaign.quiet_waits,
        "machine": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "git": git_state(repo),
        "code": asdict(code),
    }
    # Every outcome of every repeat, outside the repository: enough to redo the report.
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = _output_stem(settings.workload, args.client, args.name)
    raw_path = bench.root / "results" / f"{stem}-{stamp}.json"
    report.save_results(campaign.results, raw_path, outcomes=True)
    raw_path.with_name(raw_path.name.replace(".json", "-meta.json")).write_text(
        json.dumps(meta, indent=1) + "\n"
    )
    _report(campaign.results, args.out, stem, meta)
    print(f"raw results (every request of every repeat): {raw_path}")
    print(f"wall time {wall_s:.0f} s")
    return 130 if campaign.interrupted else 0
