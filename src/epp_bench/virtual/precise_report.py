"""`epp bench precise-report`: the precise-vs-approximate tables of docs/benchmarks/precise.md.

Reads the JSON results of `epp bench virtual` runs named `<scenario>-s<seed>.json`
(tools/bench/precise.sh writes them), groups them by scenario and router, and prints per
scenario: hit rate, TTFT p90, the engine-side stale-routing rate (every EPP router, one
definition: `epp_bench.virtual.precise.engine_stale`), the precise router's own stale
rate from the KV events, and the share of predicted cached tokens the engines reused;
the mean over seeds, with the range when there are several.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from epp_bench.reports.tables import load_results
from epp_bench.workloads.types import RunResult

BEGIN = "<!-- precise-report:begin -->"
END = "<!-- precise-report:end -->"
_SEED = re.compile(r"-s(\d+)$")


def _fmt_pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _fmt_s(value: float) -> str:
    return f"{value:.2f} s"


def _cell(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    mean = fmt(statistics.fmean(present))
    if len(present) == 1:
        return mean
    return f"{mean} ({fmt(min(present))}-{fmt(max(present))})"


def _stat(result: RunResult, key: str) -> float | None:
    value = (result.extra.get("router_stats") or {}).get(key)
    return None if value is None else float(value)


def _scenario(path: Path) -> tuple[str, int | None]:
    match = _SEED.search(path.stem)
    if match is None:
        return path.stem, None
    return path.stem[: match.start()], int(match.group(1))


def render(paths: Sequence[Path]) -> str:
    groups: dict[str, list[tuple[int | None, list[RunResult]]]] = {}
    for path in paths:
        name, seed = _scenario(path)
        groups.setdefault(name, []).append((seed, load_results(path)))
    out: list[str] = []
    for name, runs in groups.items():
        runs.sort(key=lambda item: -1 if item[0] is None else item[0])
        first = runs[0][1][0]
        engine = first.extra.get("engine") or {}
        seeds = [s for s, _ in runs if s is not None]
        out.append(f"### {name}\n")
        out.append(
            f"{first.extra.get('workload_description', first.workload)}; "
            f"{first.rate:g} req/s, {first.pods} pods of "
            f"{engine.get('num_gpu_blocks', '?')} KV blocks"
            + (
                f" (`--kv-fraction {first.extra['kv_fraction']:g}`)"
                if first.extra.get("kv_fraction") is not None
                else ""
            )
            + f"; seeds {', '.join(map(str, seeds)) or '-'}.\n"
        )
        routers = list(dict.fromkeys(r.router for _, results in runs for r in results))
        out.append(
            "| router | hit rate (pods) | TTFT p90 | stale, engine side | stale, from events "
            "| predicted tokens reused | EPP CPU/decision |"
        )
        out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for router in routers:
            mine = [r for _, results in runs for r in results if r.router == router]
            summaries = [r.extra.get("summary") or {} for r in mine]
            cpu = [r.epp_cpu_us_per_decision for r in mine]
            out.append(
                f"| {router} "
                f"| {_cell([r.pod_hit_rate for r in mine], _fmt_pct)} "
                f"| {_cell([s.get('ttft_p90_s') for s in summaries], _fmt_s)} "
                f"| {_cell([_stat(r, 'stale_engine_rate') for r in mine], _fmt_pct)} "
                f"| {_cell([_stat(r, 'stale_events_rate') for r in mine], _fmt_pct)} "
                f"| {_cell([_stat(r, 'predicted_tokens_reused') for r in mine], _fmt_pct)} "
                f"| {_cell(cpu, lambda v: f'{v:.0f} µs')} |"
            )
        checked = [
            (r.router, _stat(r, "stale_engine_checked"), _stat(r, "stale_events_checked"))
            for _, results in runs[:1]
            for r in results
            if _stat(r, "stale_engine_checked") is not None
        ]
        if checked:
            out.append(
                "\nDecisions checked (first seed): "
                + "; ".join(
                    f"{router} {int(engine_n or 0)}"
                    + (f" (events {int(events_n)})" if events_n is not None else "")
                    for router, engine_n, events_n in checked
                )
                + "."
            )
        out.append(f"\nCommand (first seed): `{first.extra.get('command', '-')}`\n")
    return "\n".join(out)


def splice(document: str, body: str) -> str:
    """`document` with the text between the markers replaced by `body`."""
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        return f"{document.rstrip()}\n\n{BEGIN}\n{body}\n{END}\n"
    return f"{document[: start + len(BEGIN)]}\n{body}\n{document[end:]}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp bench precise-report", description=__doc__)
    parser.add_argument("--from", dest="paths", type=Path, nargs="+", required=True)
    parser.add_argument(
        "--out", type=Path, help="markdown file whose text between the markers is rebuilt"
    )
    args = parser.parse_args(argv)
    body = render(args.paths)
    if args.out is None:
        print(body)
        return 0
    existing = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(splice(existing, body))
    return 0
