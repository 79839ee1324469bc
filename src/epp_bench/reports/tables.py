"""Benchmark reports: markdown tables, JSON results, PNG plots. Used by every runner.

Public API (the live benchmark calls it too; keep the names):
`summarize`, `markdown_table`, `ladder_table`, `plot_ttft_cdf`, `plot_vs_rate`,
`save_results`, `load_results`; plus `saturation` for ladders.

The JSON file holds, per run, the RunResult's fields, its summary and (by default) its
outcomes stored column by column, which is everything the tables and plots need. Saved
without outcomes, a run keeps its summary and 101 TTFT percentiles, enough to redraw the
tables and the CDF.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from epp_bench.reports.summary import summarize
from epp_bench.workloads.types import RequestOutcome, RunResult
from epp_harness.stats import percentile

__all__ = [
    "FORMAT",
    "ladder_table",
    "load_results",
    "markdown_table",
    "plot_ttft_cdf",
    "plot_vs_rate",
    "saturation",
    "save_results",
    "summarize",
]

FORMAT = "epp-bench-results/1"
# A run is saturated when it completes requests more slowly than this share of the
# offered rate (requests pile up), or when it refuses any.
SATURATION_RATIO = 0.9
_OUTCOME_FIELDS = tuple(f.name for f in fields(RequestOutcome))


# -- formatting -----------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1000:.0f} ms" if value >= 0.01 else f"{value * 1000:.1f} ms"
    return f"{value:.2f} s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _rate(value: float | None) -> str:
    return "closed loop" if value is None else f"{value:g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("ok / failed", lambda s: f"{s['ok']} / {s['failed']}"),
    ("TTFT p50", lambda s: _seconds(s["ttft_p50_s"])),
    ("TTFT p90", lambda s: _seconds(s["ttft_p90_s"])),
    ("TTFT p99", lambda s: _seconds(s["ttft_p99_s"])),
    ("latency p50", lambda s: _seconds(s["latency_p50_s"])),
    ("latency p90", lambda s: _seconds(s["latency_p90_s"])),
    ("latency p99", lambda s: _seconds(s["latency_p99_s"])),
    ("output tok/s", lambda s: _number(s["output_tokens_per_s"])),
    ("hit rate (pods)", lambda s: _percent(s["pod_hit_rate"])),
    ("load max/mean", lambda s: _number(s["load_max_over_mean"], 2)),
    ("load CV", lambda s: _number(s["load_cv"], 2)),
    ("EPP CPU/decision", lambda s: _cpu(s["epp_cpu_us_per_decision"])),
)


def _cpu(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} µs"


def markdown_table(results: Sequence[RunResult]) -> str:
    """One row per run (router), a column per summary metric.

    Workload and rate get their own columns only when they differ between the runs.
    """
    summaries = [summarize(r) for r in results]
    varying = [
        (key, title)
        for key, title in (("workload", "workload"), ("rate", "rate (req/s)"))
        if len({repr(s[key]) for s in summaries}) > 1
    ]
    header = ["router", *(title for _, title in varying), *(name for name, _ in _COLUMNS)]
    rows = [
        [
            s["router"],
            *(s[key] if key == "workload" else _rate(s[key]) for key, _ in varying),
            *(cell(s) for _, cell in _COLUMNS),
        ]
        for s in summaries
    ]
    return _table(header, rows, right_from=1 + len(varying))


def ladder_table(results: Sequence[RunResult]) -> str:
    """A rate ladder: one row per (rate, router), rates ascending, saturated runs marked."""
    summaries = sorted(
        (summarize(r) for r in results),
        key=lambda s: (math.inf if s["rate"] is None else s["rate"], s["router"]),
    )
    header = [
        "rate (req/s)",
        "router",
        "ok / failed",
        "completed req/s",
        "TTFT p50",
        "TTFT p90",
        "latency p90",
        "output tok/s",
        "hit rate (pods)",
        "saturated",
    ]
    rows = [
        [
            _rate(s["rate"]),
            s["router"],
            f"{s['ok']} / {s['failed']}",
            _number(s.get("completion_rps"), 1),
            _seconds(s["ttft_p50_s"]),
            _seconds(s["ttft_p90_s"]),
            _seconds(s["latency_p90_s"]),
            _number(s["output_tokens_per_s"]),
            _percent(s["pod_hit_rate"]),
            "yes" if is_saturated(s) else "",
        ]
        for s in summaries
    ]
    return _table(header, rows, right_from=2)


def is_saturated(summary: dict[str, Any]) -> bool:
    """Completes below SATURATION_RATIO of the offered rate, or refused requests."""
    if summary["failed"]:
        return True
    offered = summary.get("offered_rps")
    completed = summary.get("completion_rps")
    if offered is None or completed is None:
        return False
    return completed < SATURATION_RATIO * offered


def saturation(results: Sequence[RunResult]) -> dict[str, float | None]:
    """Per router, the lowest rate of the ladder at which it is saturated (None: never)."""
    lowest: dict[str, float | None] = {}
    for s in sorted((summarize(r) for r in results if r.rate is not None), key=lambda s: s["rate"]):
        lowest.setdefault(s["router"], None)
        if lowest[s["router"]] is None and is_saturated(s):
            lowest[s["router"]] = s["rate"]
    return lowest


# -- JSON ------------------------------------------------------------------------------------


def _round(value: Any) -> Any:
    return round(value, 6) if isinstance(value, float) else value


def _ttft_quantiles(result: RunResult) -> list[float | None]:
    ttfts = [o.ttft_s for o in result.outcomes if o.ok and o.ttft_s is not None]
    return [_round(percentile(ttfts, p)) for p in range(101)] if ttfts else []


def _encode(result: RunResult, with_outcomes: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "router": result.router,
        "workload": result.workload,
        "rate": result.rate,
        "pods": result.pods,
        "duration_s": result.duration_s,
        "pod_hit_rate": result.pod_hit_rate,
        "epp_cpu_us_per_decision": result.epp_cpu_us_per_decision,
        "mode": result.mode,
        "extra": {k: v for k, v in result.extra.items() if k not in ("summary", "ttft_quantiles")},
        "summary": summarize(result),
        "ttft_quantiles": result.extra.get("ttft_quantiles") or _ttft_quantiles(result),
    }
    if with_outcomes and result.outcomes:
        entry["outcomes"] = {
            name: [_round(getattr(o, name)) for o in result.outcomes] for name in _OUTCOME_FIELDS
        }
    return entry


def save_results(
    results: Sequence[RunResult],
    path: str | Path,
    outcomes: bool | Callable[[RunResult], bool] = True,
) -> Path:
    """Write `results` as JSON; `outcomes` says whether (or for which runs) every outcome
    is stored. Without them a run keeps its summary and TTFT percentiles."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    keep = outcomes if callable(outcomes) else (lambda _: outcomes)
    document = {"format": FORMAT, "results": [_encode(r, keep(r)) for r in results]}
    target.write_text(json.dumps(document, separators=(",", ":")) + "\n")
    return target


def load_results(path: str | Path) -> list[RunResult]:
    """Read a file written by `save_results` back into RunResults."""
    document = json.loads(Path(path).read_text())
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{path}: not an {FORMAT} file")
    results = []
    for entry in document["results"]:
        columns = entry.get("outcomes") or {}
        count = len(columns.get("index", ()))
        outcomes = [
            RequestOutcome(**{name: columns[name][i] for name in _OUTCOME_FIELDS})
            for i in range(count)
        ]
        extra = dict(entry.get("extra") or {})
        extra["summary"] = entry["summary"]
        extra["ttft_quantiles"] = entry.get("ttft_quantiles") or []
        results.append(
            RunResult(
                router=entry["router"],
                workload=entry["workload"],
                rate=entry["rate"],
                pods=entry["pods"],
                duration_s=entry["duration_s"],
                outcomes=outcomes,
                pod_hit_rate=entry["pod_hit_rate"],
                epp_cpu_us_per_decision=entry["epp_cpu_us_per_decision"],
                mode=entry["mode"],
                extra=extra,
            )
        )
    return results


# -- plots -----------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line_width(router: str) -> float:
    # Ours stands out in every plot; the baselines share one weight.
    return 2.4 if router == "epp" else 1.2


def _label(result: RunResult, several_rates: bool) -> str:
    return f"{result.router} @ {_rate(result.rate)}" if several_rates else result.router


def _cdf_points(result: RunResult) -> tuple[list[float], list[float]]:
    ttfts = sorted(o.ttft_s for o in result.outcomes if o.ok and o.ttft_s is not None)
    if ttfts:
        n = len(ttfts)
        return ttfts, [(i + 1) / n for i in range(n)]
    stored = [q for q in result.extra.get("ttft_quantiles") or [] if q is not None]
    return stored, [i / max(1, len(stored) - 1) for i in range(len(stored))]


def plot_ttft_cdf(results: Sequence[RunResult], path: str | Path, title: str | None = None) -> Path:
    """TTFT CDF per run, log-scale x; PNG."""
    plt = _pyplot()
    several = len({r.rate for r in results}) > 1
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    for result in results:
        xs, ys = _cdf_points(result)
        if xs:
            ax.step(
                [max(x, 1e-4) for x in xs],
                ys,
                where="post",
                label=_label(result, several),
                linewidth=_line_width(result.router),
            )
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of successful requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if title is None and results:
        first = results[0]
        rates = "" if several else f", {_rate(first.rate)} req/s"
        title = f"TTFT CDF: {first.workload}, {first.pods} pods{rates}"
    ax.set_title(title or "TTFT CDF", fontsize=10)
    return _save(fig, plt, path)


def plot_vs_rate(results: Sequence[RunResult], path: str | Path, title: str | None = None) -> Path:
    """Per router against the offered rate: TTFT p90 (log), output tokens/s, pod hit rate."""
    plt = _pyplot()
    by_router: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        if result.rate is not None:
            by_router.setdefault(result.router, []).append(summarize(result))
    fig, axes = plt.subplots(1, 3, figsize=(12.0, 3.6), dpi=80)
    panels = (
        ("ttft_p90_s", "TTFT p90 (s, log)", True),
        ("output_tokens_per_s", "output tokens/s", False),
        ("pod_hit_rate", "prefix-cache hit rate (pods)", False),
    )
    for ax, (key, label, log) in zip(axes, panels, strict=True):
        for router, summaries in by_router.items():
            points = sorted((s["rate"], s[key]) for s in summaries if s[key] is not None)
            if points:
                ax.plot(
                    *zip(*points, strict=True),
                    marker="o",
                    markersize=3,
                    label=router,
                    linewidth=_line_width(router),
                )
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    if title is None and results:
        title = f"{results[0].workload}, {results[0].pods} pods"
    fig.suptitle(title or "", fontsize=10)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(target, format="png")
    plt.close(fig)
    return target
