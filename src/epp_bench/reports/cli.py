"""`epp bench report --from RESULTS.json... --out docs/benchmarks/NAME.md`

Rebuilds a markdown report from saved results (`epp_bench.reports.tables.save_results`): one
section per input file with the command that produced it, a table per rate, the ladder
table and the saturation rates when the file holds several rates, and the plots (written
next to the report, under NAME/). When the output file already exists and contains the
markers below, only the text between them is replaced, so hand-written analysis around
the generated tables survives a rebuild.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from epp_bench.reports.tables import (
    ladder_table,
    load_results,
    markdown_table,
    plot_ttft_cdf,
    plot_vs_rate,
    saturation,
)
from epp_bench.workloads.types import RunResult

BEGIN = "<!-- epp-bench-report:begin -->"
END = "<!-- epp-bench-report:end -->"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "results"


def _rate_key(result: RunResult) -> float:
    return float("inf") if result.rate is None else result.rate


def _describe(results: Sequence[RunResult]) -> list[str]:
    first = results[0]
    extra = first.extra
    lines = []
    if extra.get("workload_description"):
        lines.append(f"Workload: {extra['workload_description']}.")
    engine = extra.get("engine") or {}
    if engine:
        parts = [f"{first.pods} pods"]
        if extra.get("preset"):
            parts.append(f"preset `{extra['preset']}`")
        parts.append(
            f"{engine.get('num_gpu_blocks')} KV blocks of {engine.get('block_size')} tokens each"
        )
        if extra.get("kv_fraction") is not None:
            parts.append(f"sized for a KV fraction of {extra['kv_fraction']:g}")
        parts.append(
            f"{engine.get('max_num_seqs')} running slots, queue {engine.get('max_waiting')}"
        )
        parts.append(
            f"prefill {engine.get('prefill_overhead_s', 0) * 1000:g} ms + "
            f"{engine.get('prefill_per_token_s', 0) * 1e6:g} µs/token, decode "
            f"{engine.get('decode_per_token_s', 0) * 1000:g} ms/token"
        )
        if engine.get("max_num_batched_tokens"):
            parts.append(
                "prefills one after the other (first come, first served), decode steps "
                f"carrying prefill chunks of {engine['max_num_batched_tokens']} tokens"
            )
        if engine.get("lookup_at_admission"):
            parts.append("what-if: prefix looked up at admission")
        lines.append("Pods: " + ", ".join(parts) + ".")
    if extra.get("command"):
        lines.append(f"Command: `{extra['command']}`")
    return lines


def _headline_rate(results: Sequence[RunResult], rates: Sequence[float]) -> float:
    """The rate recorded as the one to plot (`cdf_rate`), else the highest."""
    wanted = results[0].extra.get("cdf_rate")
    return float(wanted) if wanted is not None and float(wanted) in rates else rates[-1]


def section(
    results: Sequence[RunResult], heading: str, slug: str, plots_dir: Path, link_base: Path
) -> str:
    """The markdown of one results file; writes its plots under `plots_dir`.

    A single rate gets its table; a ladder gets the table at its headline rate (the
    recorded CDF rate, else the highest), the ladder table, saturation rates and plots.
    """
    ordered = sorted(results, key=lambda r: (_rate_key(r), r.router))
    rates = sorted({_rate_key(r) for r in ordered})
    headline = _headline_rate(ordered, rates)
    out = [f"## {heading}", "", *(f"{line}\n" for line in _describe(ordered))]
    runs = [r for r in ordered if _rate_key(r) == headline]
    label = "closed loop" if headline == float("inf") else f"{headline:g} req/s"
    out += [f"### {label}", "", markdown_table(runs)]
    if len(rates) > 1:
        out += ["### Rate ladder", "", ladder_table(ordered)]
        saturated = saturation(ordered)
        out.append(
            "Lowest rate at which each router saturates (completes < 90% of the offered rate,"
            " or refuses requests): "
            + ", ".join(
                f"{router} {'never' if rate is None else f'{rate:g} req/s'}"
                for router, rate in saturated.items()
            )
            + ".\n"
        )
        vs_rate = plot_vs_rate(ordered, plots_dir / f"{slug}-vs-rate.png", title=heading)
        out.append(f"![{heading}: against the rate]({_relative(vs_rate, link_base)})\n")
    cdf = plot_ttft_cdf(
        runs, plots_dir / f"{slug}-ttft-cdf.png", title=f"TTFT CDF at {label}: {heading}"
    )
    out.append(f"![{heading}: TTFT CDF]({_relative(cdf, link_base)})\n")
    return "\n".join(out)


def _relative(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


def build_report(inputs: Sequence[Path], out: Path, plots_dir: Path, title: str) -> str:
    command = "epp bench report " + " ".join(
        ["--from", *(shlex.quote(str(p)) for p in inputs), "--out", shlex.quote(str(out))]
    )
    parts = [
        f"_Generated by `{command}`; edit outside the markers, the text between them is rebuilt._\n"
    ]
    for path in inputs:
        results = load_results(path)
        if not results:
            continue
        first = results[0]
        heading = f"{first.workload} ({first.mode}, {first.pods} pods)"
        slug = _slug(heading)
        if len(inputs) > 1:
            heading = f"{path.stem}: {heading}"
            slug = _slug(path.stem)
        parts.append(section(results, heading, slug, plots_dir, out.parent))
    body = "\n".join(parts)
    return f"# {title}\n\n{BEGIN}\n{body}\n{END}\n"


def write_report(out: Path, generated: str) -> None:
    """Write `generated`, or splice its marked part into an existing file with markers."""
    if out.exists():
        current = out.read_text()
        if BEGIN in current and END in current:
            inner = generated[generated.index(BEGIN) : generated.index(END) + len(END)]
            head = current[: current.index(BEGIN)]
            tail = current[current.index(END) + len(END) :]
            out.write_text(head + inner + tail)
            return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(generated)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="epp bench report", description="Rebuild a markdown report from saved JSON results."
    )
    parser.add_argument("--from", dest="inputs", nargs="+", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument(
        "--plots-dir", type=Path, help="where the PNGs go (default: next to --out, in NAME/)"
    )
    parser.add_argument("--title", default=None, help="report title (new files only)")
    args = parser.parse_args(argv)
    plots_dir = args.plots_dir or args.out.with_suffix("")
    title = args.title or f"Benchmark: {args.out.stem}"
    try:
        generated = build_report(args.inputs, args.out, plots_dir, title)
    except (OSError, ValueError, KeyError) as exc:
        print(f"epp bench report: {exc}", file=sys.stderr)
        return 2
    write_report(args.out, generated)
    print(f"wrote {args.out}")
    return 0
