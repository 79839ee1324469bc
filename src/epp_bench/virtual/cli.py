"""`epp bench virtual`: replay a workload over simulated pods in virtual time.

Runs every (rate, router) pair on the same prompts, prints one markdown table per rate,
the ladder table and each router's saturation rate when there are several rates, and the
command that reproduces them; writes the results as JSON and the plots as PNG.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

from epp.config import EppConfig, load_config
from epp.observability.logs import configure_logging
from epp_bench.reports.tables import (
    ladder_table,
    markdown_table,
    plot_ttft_cdf,
    plot_vs_rate,
    saturation,
    save_results,
    summarize,
)
from epp_bench.virtual.prepare import prepare, size_kv_for_fraction
from epp_bench.virtual.runner import ROUTERS, run_virtual
from epp_bench.virtual.whatif import WHATIF_ROUTERS
from epp_bench.workloads import catalog as workloads
from epp_bench.workloads.types import RunResult
from vllm_sim import presets
from vllm_sim.engine import EngineConfig

DEFAULT_OUT = Path(".bench/virtual")


def _floats(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("rates must be positive")
    return values


def _routers(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    known = (*ROUTERS, *WHATIF_ROUTERS)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown router(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp bench virtual",
        description="Replay a workload over N simulated pods in virtual time, per router.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workload", choices=workloads.WORKLOADS, default="shared-prefix-small")
    parser.add_argument("--pods", type=int, default=8, help="simulated pods (1-4096)")
    parser.add_argument(
        "--preset",
        help=f"engine preset: {', '.join(presets.names())} (default: EngineConfig(), i.e. tiny)",
    )
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override one EngineConfig field, e.g. max_num_seqs=32 (repeatable)",
    )
    parser.add_argument(
        "--routers",
        type=_routers,
        default=list(ROUTERS),
        help=f"comma-separated; what-ifs (not run by default): {', '.join(WHATIF_ROUTERS)}",
    )
    parser.add_argument(
        "--rates", type=_floats, help="offered req/s, comma-separated (default: the workload's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-fraction",
        type=float,
        help="size each pod's KV so that all pods together hold this fraction of the "
        "workload's distinct prefix blocks (blocks in more than one prompt)",
    )
    parser.add_argument("--epp-config", type=Path, help="EPP YAML config (weights, max_queue...)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for JSON and PNGs")
    parser.add_argument(
        "--name", help="base name of the output files in OUT (default: the workload's name)"
    )
    parser.add_argument("--json", type=Path, help="results file (default: OUT/NAME.json)")
    parser.add_argument(
        "--json-outcomes",
        choices=("all", "cdf", "none"),
        default="cdf",
        help="store every request's outcome for all runs, only the --cdf-rate runs, or none "
        "(summaries and TTFT percentiles are always stored)",
    )
    parser.add_argument(
        "--cdf-rate",
        type=float,
        help="rate whose TTFT CDF is plotted (default: the lowest rate at which round_robin "
        "saturates, else the highest)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--sheddable-fraction",
        type=float,
        default=0.0,
        help="share of requests sent with priority -1 (sheddable), seeded by --seed",
    )
    return parser


def engine_config(preset: str | None, overrides: Sequence[str]) -> EngineConfig:
    if preset:
        try:
            config = presets.get(preset)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
    else:
        config = EngineConfig()
    types = {f.name: f.type for f in fields(EngineConfig)}
    changes: dict[str, float | int | bool] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(
                f"--engine {item!r}: expected FIELD=VALUE with FIELD in {', '.join(types)}"
            )
        kind = types[key]
        if kind in ("bool", bool):
            if value.lower() not in ("0", "1", "false", "true"):
                raise ValueError(f"--engine {item!r}: expected {key}=true or {key}=false")
            changes[key] = value.lower() in ("1", "true")
        else:
            changes[key] = int(value) if kind in ("int", int) else float(value)
    return replace(config, **changes)


def reproduce_command(args: argparse.Namespace) -> str:
    """Every option that shaped the run, spelled out (defaults included where they matter)."""
    parts = [
        "epp bench virtual",
        f"--workload {args.workload}",
        f"--pods {args.pods}",
        f"--routers {','.join(args.routers)}",
    ]
    if args.rates:
        parts.append(f"--rates {','.join(f'{r:g}' for r in args.rates)}")
    parts.append(f"--seed {args.seed}")
    if args.preset:
        parts.append(f"--preset {shlex.quote(args.preset)}")
    if args.kv_fraction is not None:
        parts.append(f"--kv-fraction {args.kv_fraction:g}")
    parts += [f"--engine {shlex.quote(item)}" for item in args.engine]
    if args.epp_config:
        parts.append(f"--epp-config {shlex.quote(str(args.epp_config))}")
    parts.append(f"--out {shlex.quote(str(args.out))}")
    if args.name:
        parts.append(f"--name {shlex.quote(args.name)}")
    if args.cdf_rate is not None:
        parts.append(f"--cdf-rate {args.cdf_rate:g}")
    if args.json:
        parts.append(f"--json {shlex.quote(str(args.json))}")
    if args.json_outcomes != "cdf":
        parts.append(f"--json-outcomes {args.json_outcomes}")
    return " ".join(parts)


def headline_rate(
    results: Sequence[RunResult], rates: Sequence[float | None], asked: float | None
) -> float | None:
    """The rate to plot and keep outcomes for: the asked one, else the lowest rate at
    which round robin saturates (the field's comparison point), else the highest."""
    if asked is not None:
        return asked
    saturated = saturation(results).get("round_robin")
    return saturated if saturated is not None else rates[-1]


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def comparisons(results: Sequence[RunResult]) -> list[str]:
    """Per rate: epp against round robin (TTFT p90, throughput) and the oracle (hit rate),
    and whether the EPP chose the best prefix match its own index saw."""
    by_key = {(r.rate, r.router): summarize(r) for r in results}
    ours_stats = {r.rate: r.extra.get("router_stats") for r in results if r.router == "epp"}
    lines = []
    for rate in dict.fromkeys(r.rate for r in results):
        ours = by_key.get((rate, "epp"))
        if ours is None:
            continue
        parts = []
        rr = by_key.get((rate, "round_robin"))
        if rr is not None:
            parts.append(
                f"TTFT p90 round_robin/epp {_ratio(rr['ttft_p90_s'], ours['ttft_p90_s'])},"
                " output tok/s epp/round_robin"
                f" {_ratio(ours['output_tokens_per_s'], rr['output_tokens_per_s'])}"
            )
        oracle = by_key.get((rate, "oracle"))
        if oracle is not None:
            parts.append(
                f"hit rate epp/oracle {_ratio(ours['pod_hit_rate'], oracle['pod_hit_rate'])}"
            )
        stats = ours_stats.get(rate) or {}
        if stats.get("mean_best_cache_match") is not None:
            parts.append(
                f"cache match chosen {stats['mean_chosen_cache_match']:.3f} vs best"
                f" {stats['mean_best_cache_match']:.3f},"
                f" {stats['decisions_below_best_match']} decisions below the best,"
                f" {stats['rejected_by_epp']} refused by the EPP"
            )
        if parts:
            label = "-" if rate is None else f"{rate:g} req/s"
            lines.append(f"\nepp @ {label}: " + "; ".join(parts))
    return lines


def _progress_bar(total: int, disabled: bool):  # -> tqdm or a no-op
    from tqdm import tqdm

    # `delay`: only long runs show a bar; short ones print nothing extra.
    return tqdm(total=total, unit="req", file=sys.stderr, delay=1.0, disable=disabled, leave=False)


def run_all(
    args: argparse.Namespace,
    base: workloads.Workload,
    rates: Sequence[float | None],
    engine: EngineConfig,
    epp_config: EppConfig | None,
    command: str,
) -> list[RunResult]:
    """Every (rate, router) pair on the same prepared prompts."""
    prepared = prepare(base, engine.block_size)
    if args.sheddable_fraction > 0:
        # A seeded share of the requests is sheddable (priority -1): an overload run shows
        # which traffic admission refuses.
        rng = random.Random(args.seed)
        prepared = tuple(
            replace(p, priority=-1) if rng.random() < args.sheddable_fraction else p
            for p in prepared
        )
    results: list[RunResult] = []
    with _progress_bar(len(rates) * len(args.routers) * len(prepared), args.no_progress) as bar:
        for rate in rates:
            # Every rung of a ladder is re-timed the same way; one rate keeps the workload's.
            workload = (
                base
                if rate is None or not args.rates
                else workloads.with_rate(base, rate, args.seed)
            )
            for router in args.routers:
                result = run_virtual(
                    workload,
                    router,
                    pods=args.pods,
                    engine=engine,
                    seed=args.seed,
                    prepared=prepared,
                    epp_config=epp_config,
                    progress=bar.update,
                )
                result.extra.update(
                    command=command,
                    kv_fraction=args.kv_fraction,
                    preset=args.preset,
                    engine_overrides=list(args.engine),
                )
                results.append(result)
    return results


def print_tables(results: Sequence[RunResult], rates: Sequence[float | None]) -> None:
    for rate in rates:
        print(f"\n## {'-' if rate is None else f'{rate:g} req/s'}\n")
        print(markdown_table([r for r in results if r.rate == rate]), end="")
    for line in comparisons(results):
        print(line)
    if len(rates) > 1:
        print("\n## rate ladder\n")
        print(ladder_table(results), end="")
        lowest = saturation(results)
        print(
            "\nsaturates at: "
            + ", ".join(f"{k} {'never' if v is None else f'{v:g}'}" for k, v in lowest.items())
        )


def write_outputs(
    args: argparse.Namespace, results: Sequence[RunResult], cdf_rate: float | None
) -> Path:
    """PNGs under --out, JSON at --json (default OUT/NAME.json); returns the JSON path."""
    slug = args.name or args.workload
    if len({r.rate for r in results}) > 1:
        plot_vs_rate(results, args.out / f"{slug}-vs-rate.png")
    plot_ttft_cdf([r for r in results if r.rate == cdf_rate], args.out / f"{slug}-ttft-cdf.png")
    keep = {"all": True, "none": False, "cdf": lambda r: r.rate == cdf_rate}[args.json_outcomes]
    return save_results(results, args.json or args.out / f"{slug}.json", outcomes=keep)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # Routing logs one line per request at info; the benchmark wants neither the noise
    # nor its cost in the CPU figure.
    configure_logging("warning")
    if not 1 <= args.pods <= 4096:
        print("epp bench virtual: --pods must be in [1, 4096]", file=sys.stderr)
        return 2
    try:
        engine = engine_config(args.preset, args.engine)
        epp_config: EppConfig | None = load_config(args.epp_config) if args.epp_config else None
        base = workloads.by_name(args.workload, seed=args.seed)
    except (OSError, ValueError) as exc:
        print(f"epp bench virtual: {exc}", file=sys.stderr)
        return 2
    rates: list[float | None] = list(args.rates or [base.params.get("rate")])
    if args.workload == "burst" and args.rates:
        print("epp bench virtual: burst has no rate (one herd); --rates ignored", file=sys.stderr)
        args.rates = None
        rates = [base.params.get("rate")]
    if args.kv_fraction is not None:
        engine = size_kv_for_fraction(
            engine, prepare(base, engine.block_size), args.pods, args.kv_fraction
        )
    command = reproduce_command(args)
    print(f"# {base.description}")
    print(f"# {args.pods} pods of {engine}")
    started = time.perf_counter()
    results = run_all(args, base, rates, engine, epp_config, command)
    wall = time.perf_counter() - started
    cdf_rate = headline_rate(results, rates, args.cdf_rate)
    for result in results:
        result.extra["cdf_rate"] = cdf_rate
    print_tables(results, rates)
    json_path = write_outputs(args, results, cdf_rate)
    print(
        f"\nwall time {wall:.1f} s for {len(results)} runs; results: {json_path}; plots: {args.out}/"
    )
    print(f"reproduce: {command}")
    return 0
