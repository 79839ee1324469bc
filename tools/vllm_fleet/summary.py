"""Pure helpers for the vLLM fleet experiment: metrics parsing, per-run summary, tables.

No I/O, no clock: `run.py` records raw runs (one dict per request, engine counters before
and after) and everything reported is computed here, so the test can check it on plain
data and a saved JSON can be re-summarised later (`run.py --resummarize FILE`).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The engine counters recorded before and after every run (summed over label sets).
ENGINE_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
)
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}.

    Comment lines and unparseable lines are skipped; NaN and +Inf parse as floats.
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        out[match["name"]].append((labels, value))
    return dict(out)


def metric_sum(
    parsed: Mapping[str, list[tuple[dict[str, str], float]]],
    name: str,
    **label_filter: str,
) -> float | None:
    """Sum of `name` over the label sets that match `label_filter`; None if absent."""
    samples = parsed.get(name)
    if not samples:
        return None
    total = 0.0
    found = False
    for labels, value in samples:
        if all(labels.get(k) == v for k, v in label_filter.items()):
            total += value
            found = True
    return total if found else None


def engine_snapshot(text: str) -> dict[str, float | None]:
    """The counters and gauges of one vLLM /metrics page that the experiment records."""
    parsed = parse_metrics(text)
    return {name: metric_sum(parsed, name) for name in (*ENGINE_COUNTERS, *ENGINE_GAUGES)}


def counter_deltas(
    before: Mapping[str, float | None], after: Mapping[str, float | None]
) -> dict[str, float | None]:
    """after - before for every counter present in both."""
    out: dict[str, float | None] = {}
    for name in ENGINE_COUNTERS:
        b, a = before.get(name), after.get(name)
        out[name] = None if a is None or b is None else a - b
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


def in_flight_profile(
    requests: Sequence[Mapping[str, Any]], servers: Sequence[str]
) -> dict[str, Any]:
    """Client-side in-flight requests per server over the run, from start and latency.

    Returns the peak per server and the time-weighted mean of (largest - smallest) in-flight
    count across servers: 0 when the servers always carry the same number of requests.
    """
    events: list[tuple[float, int, str]] = []
    for r in requests:
        server = r.get("server")
        if server not in servers or r.get("latency_s") is None:
            continue
        start = float(r["started_s"])
        events.append((start, 1, server))
        events.append((start + float(r["latency_s"]), -1, server))
    # Ends before starts at the same instant.
    events.sort(key=lambda e: (e[0], e[1]))
    current = dict.fromkeys(servers, 0)
    peak = dict.fromkeys(servers, 0)
    weighted = 0.0
    span = 0.0
    last: float | None = None
    for t, delta, server in events:
        if last is not None and t > last and any(current.values()):
            gap = max(current.values()) - min(current.values())
            weighted += gap * (t - last)
            span += t - last
        current[server] += delta
        peak[server] = max(peak[server], current[server])
        last = t
    return {"peak": peak, "mean_gap": round(weighted / span, 2) if span else None}


def summarize_run(run: Mapping[str, Any]) -> dict[str, Any]:
    """One run's numbers: split per server, TTFT / latency percentiles, hits per server.

    `run["requests"]`: dicts with conversation, turn, system_prompt, server, ok, ttft_s,
    latency_s, prompt_tokens, cached_tokens. `run["servers"]`: the server names in order.
    `run["engine_deltas"]`: {server: counter deltas}.
    """
    servers: list[str] = list(run["servers"])
    requests: list[Mapping[str, Any]] = list(run["requests"])
    ok = [r for r in requests if r.get("ok")]
    failed = [r for r in requests if not r.get("ok")]

    per_server = Counter(r.get("server") or "?" for r in ok)
    by_conversation: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in sorted(ok, key=lambda r: (r["conversation"], r["turn"])):
        by_conversation[r["conversation"]].append(r)
    # A conversation belongs to the server that served its first turn.
    conv_home = {c: rs[0].get("server") or "?" for c, rs in by_conversation.items()}
    conversations_per_server = Counter(conv_home.values())
    moved_turns = sum(
        1 for c, rs in by_conversation.items() for r in rs[1:] if r.get("server") != conv_home[c]
    )
    split_conversations = sum(
        1 for rs in by_conversation.values() if len({r.get("server") for r in rs}) > 1
    )
    groups: dict[int, Counter[str]] = defaultdict(Counter)
    for c, rs in by_conversation.items():
        groups[rs[0]["system_prompt"]][conv_home[c]] += 1

    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    latency = [r["latency_s"] for r in ok if r.get("latency_s") is not None]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)

    deltas: Mapping[str, Mapping[str, float | None]] = run.get("engine_deltas") or {}
    engine: dict[str, dict[str, Any]] = {}
    total_hits = total_queries = 0.0
    for server in servers:
        d = deltas.get(server) or {}
        hits = d.get("vllm:prefix_cache_hits_total")
        queries = d.get("vllm:prefix_cache_queries_total")
        total_hits += hits or 0.0
        total_queries += queries or 0.0
        engine[server] = {
            "hits": hits,
            "queries": queries,
            "hit_rate": _ratio(hits, queries),
            "requests_ok": d.get("vllm:request_success_total"),
            "preemptions": d.get("vllm:num_preemptions_total"),
        }
    peaks = run.get("engine_peaks") or {}

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000.0, 1)

    return {
        "router": run["router"],
        "load": run["load"],
        "concurrency": run["concurrency"],
        "repeat": run["repeat"],
        "wall_s": run.get("wall_s"),
        "requests": len(requests),
        "ok": len(ok),
        "failed": len(failed),
        "failure_samples": sorted({str(r.get("error"))[:160] for r in failed})[:5],
        "requests_per_server": {s: per_server.get(s, 0) for s in servers},
        "unknown_server_requests": sum(v for k, v in per_server.items() if k not in servers),
        "conversations_per_server": {s: conversations_per_server.get(s, 0) for s in servers},
        "split_conversations": split_conversations,
        "moved_turns": moved_turns,
        "groups_per_server": {
            str(g): {s: groups[g].get(s, 0) for s in servers} for g in sorted(groups)
        },
        "ttft_ms": {
            "p50": ms(percentile(ttft, 50)),
            "p90": ms(percentile(ttft, 90)),
            "p99": ms(percentile(ttft, 99)),
            "max": ms(max(ttft) if ttft else None),
        },
        "latency_ms": {
            "p50": ms(percentile(latency, 50)),
            "p90": ms(percentile(latency, 90)),
            "p99": ms(percentile(latency, 99)),
            "max": ms(max(latency) if latency else None),
        },
        "client_cached_ratio": _ratio(cached, prompt),
        "engine": engine,
        "engine_hit_rate": _ratio(total_hits, total_queries),
        "engine_peak_waiting": {s: (peaks.get(s) or {}).get("waiting") for s in servers},
        "in_flight": in_flight_profile(requests, servers),
        "path_ms": request_path(ok),
        "engine_peak_running": {s: (peaks.get(s) or {}).get("running") for s in servers},
        # Slowest GET /metrics the harness saw (every 0.25 s); None for older records.
        "engine_metrics_get_max_ms": {
            s: (peaks.get(s) or {}).get("metrics_get_max_ms") for s in servers
        },
    }


def split_label(counts: Mapping[str, int]) -> str:
    """{"vllm-0": 48, "vllm-1": 16} -> "48/16" (in server order)."""
    return "/".join(str(v) for v in counts.values())


def is_even_split(counts: Mapping[str, int], tolerance: int = 0) -> bool:
    """True when the largest and smallest share differ by at most `tolerance` (+1 if odd)."""
    values = list(counts.values())
    if not values:
        return False
    odd = sum(values) % len(values) != 0
    return max(values) - min(values) <= tolerance + (1 if odd else 0)


def pair_runs(summaries: Iterable[Mapping[str, Any]]) -> list[tuple[dict, dict]]:
    """(epp, round_robin) summaries of the same load and repeat."""
    index: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for s in summaries:
        index[(s["load"], s["repeat"])][s["router"]] = dict(s)
    pairs = []
    for key in sorted(index):
        routers = index[key]
        if "epp" in routers and "round_robin" in routers:
            pairs.append((routers["epp"], routers["round_robin"]))
    return pairs


def verdicts(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The counts the known problem is stated in: uneven splits, pairs the EPP loses."""
    epp = [s for s in summaries if s["router"] == "epp"]
    pairs = pair_runs(summaries)

    def worse(metric: str, key: str) -> int:
        n = 0
        for e, r in pairs:
            ev, rv = e[metric][key], r[metric][key]
            if ev is not None and rv is not None and ev > rv:
                n += 1
        return n

    return {
        "epp_runs": len(epp),
        "epp_uneven_request_splits": sum(
            1 for s in epp if not is_even_split(s["requests_per_server"])
        ),
        "epp_uneven_conversation_splits": sum(
            1 for s in epp if not is_even_split(s["conversations_per_server"])
        ),
        "epp_request_splits": [split_label(s["requests_per_server"]) for s in epp],
        "pairs": len(pairs),
        "epp_worse_ttft_max": worse("ttft_ms", "max"),
        "epp_worse_ttft_p99": worse("ttft_ms", "p99"),
        "epp_worse_ttft_p90": worse("ttft_ms", "p90"),
        "epp_worse_ttft_p50": worse("ttft_ms", "p50"),
        "epp_failures": sum(s["failed"] for s in epp),
        "round_robin_failures": sum(s["failed"] for s in summaries if s["router"] != "epp"),
    }


def reply_mismatches(runs: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(turns whose reply differs between runs, turns compared): were histories the same?"""
    seen: dict[tuple[int, int], set[str]] = defaultdict(set)
    for run in runs:
        for r in run["requests"]:
            if r.get("ok") and r.get("reply_sha"):
                seen[(r["conversation"], r["turn"])].add(r["reply_sha"])
    return sum(1 for v in seen.values() if len(v) > 1), len(seen)


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def runs_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table, one row per run, in the order the runs were made."""
    header = (
        "| # | load (conc.) | router | requests/server | convs/server | split convs "
        "| TTFT p50 / p90 / p99 / max (ms) | latency p50 / p99 (ms) | failed "
        "| engine hit rate (per server) | peak waiting | in-flight gap | wall (s) "
        "| slowest /metrics (ms) |"
    )
    lines = [header, "|" + "---|" * 14]
    for i, s in enumerate(summaries, 1):
        t, lat = s["ttft_ms"], s["latency_ms"]
        per_server_hits = " / ".join(_pct(e["hit_rate"]) for e in s["engine"].values())
        waiting = "/".join(_fmt(v) for v in s["engine_peak_waiting"].values())
        lines.append(
            f"| {i} | {s['load']} ({s['concurrency']}) | {s['router']} "
            f"| {split_label(s['requests_per_server'])} "
            f"| {split_label(s['conversations_per_server'])} | {s['split_conversations']} "
            f"| {_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])} / {_fmt(t['max'])} "
            f"| {_fmt(lat['p50'])} / {_fmt(lat['p99'])} | {s['failed']} "
            f"| {_pct(s['engine_hit_rate'])} ({per_server_hits}) | {waiting} "
            f"| {_fmt(s['in_flight']['mean_gap'], 2)} | {_fmt(s['wall_s'], 1)} "
            f"| {'/'.join(_fmt(v) for v in (s.get('engine_metrics_get_max_ms') or {}).values())} |"
        )
    return "\n".join(lines)


def aggregate_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per (load, router), the median over repeats and the range of each metric."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for s in summaries:
        groups[(s["load"], s["router"])].append(s)
    lines = [
        "| load (conc.) | router | runs | even request splits | TTFT p50 (ms) | TTFT p90 (ms) "
        "| TTFT p99 (ms) | TTFT max (ms) | latency p50 (ms) | latency p99 (ms) | engine hit rate "
        "| in-flight gap | failed |",
        "|" + "---|" * 13,
    ]

    def med(values: list[float | None]) -> str:
        vals = [v for v in values if v is not None]
        if not vals:
            return "-"
        m = percentile(vals, 50)
        return f"{m:.0f} ({min(vals):.0f}-{max(vals):.0f})"

    def load_order(key: tuple[str, str]) -> tuple[int, str]:
        return (0 if key[0] == "low" else 1, key[1])

    for key in sorted(groups, key=load_order):
        rs = groups[key]
        hit = [s["engine_hit_rate"] for s in rs if s["engine_hit_rate"] is not None]
        hit_txt = "-"
        if hit:
            hit_txt = (
                f"{100 * percentile(hit, 50):.1f}% ({100 * min(hit):.1f}-{100 * max(hit):.1f})"
            )
        even = sum(1 for s in rs if is_even_split(s["requests_per_server"]))
        gaps = [s["in_flight"]["mean_gap"] for s in rs if s["in_flight"]["mean_gap"] is not None]
        gap_txt = f"{percentile(gaps, 50):.2f}" if gaps else "-"
        lines.append(
            f"| {key[0]} ({rs[0]['concurrency']}) | {key[1]} | {len(rs)} | {even}/{len(rs)} "
            f"| {med([s['ttft_ms']['p50'] for s in rs])} "
            f"| {med([s['ttft_ms']['p90'] for s in rs])} "
            f"| {med([s['ttft_ms']['p99'] for s in rs])} "
            f"| {med([s['ttft_ms']['max'] for s in rs])} "
            f"| {med([s['latency_ms']['p50'] for s in rs])} "
            f"| {med([s['latency_ms']['p99'] for s in rs])} "
            f"| {hit_txt} | {gap_txt} | {sum(s['failed'] for s in rs)} |"
        )
    return "\n".join(lines)


# -- EPP configuration --------------------------------------------------------------------

PREFILL_KEYS = ("overhead_s", "per_token_s", "per_cached_token_s")


def parse_calibration(text: str) -> dict[str, float]:
    """`epp calibrate`'s printed YAML -> its scheduling.prefill_estimate (floats).

    The snippet is plain `key: value` lines under `scheduling:` / `prefill_estimate:`;
    parsed by hand so this module needs no YAML library.
    """
    values: dict[str, float] = {}
    section: list[str] = []
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        indent = len(raw) - len(raw.lstrip())
        key, _, value = raw.strip().partition(":")
        depth = indent // 2
        section = section[:depth]
        if not value.strip():
            section.append(key)
            continue
        if section == ["scheduling", "prefill_estimate"] and key in PREFILL_KEYS:
            values[key] = float(value)
    missing = [k for k in PREFILL_KEYS if k not in values]
    if missing:
        raise ValueError(f"epp calibrate output lacks {', '.join(missing)}: {text[:300]!r}")
    return values


def with_prefill_estimate(config: Mapping[str, Any], estimate: Mapping[str, float]) -> dict:
    """A copy of an EPP config mapping with scheduling.prefill_estimate set to `estimate`
    (other keys of the config, and of its scheduling section, kept)."""
    out = dict(config)
    scheduling = dict(out.get("scheduling") or {})
    scheduling["prefill_estimate"] = {k: float(estimate[k]) for k in PREFILL_KEYS}
    out["scheduling"] = scheduling
    return out


# -- placement and pairs ------------------------------------------------------------------


def _median_range(values: Sequence[float | None], fmt: str = "{:.0f}") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    m = percentile(vals, 50)
    return f"{fmt.format(m)} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def placement_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Markdown, per (load, router): request and conversation splits of every run,
    even-split counts, split conversations, each engine's own hit rate (Δhits/Δqueries)."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for s in summaries:
        groups[(s["load"], s["router"])].append(s)
    servers: list[str] = []
    for s in summaries:
        for name in s["requests_per_server"]:
            if name not in servers:
                servers.append(name)
    lines = [
        "| load (conc.) | router | requests/server | convs/server (first turn) "
        "| even conv splits | split convs | "
        + " | ".join(f"hit rate {n}" for n in servers)
        + " | failed |",
        "|" + "---|" * (6 + len(servers) + 1),
    ]
    for key in sorted(groups, key=lambda k: (0 if k[0] == "low" else 1, k[1])):
        rs = groups[key]
        even = sum(1 for s in rs if is_even_split(s["conversations_per_server"]))
        hits = [
            _median_range(
                [(s["engine"].get(n) or {}).get("hit_rate") for s in rs],
                "{:.1%}",
            )
            for n in servers
        ]
        lines.append(
            f"| {key[0]} ({rs[0]['concurrency']}) | {key[1]} "
            f"| {', '.join(split_label(s['requests_per_server']) for s in rs)} "
            f"| {', '.join(split_label(s['conversations_per_server']) for s in rs)} "
            f"| {even}/{len(rs)} | {_median_range([s['split_conversations'] for s in rs])} "
            f"| {' | '.join(hits)} | {sum(s['failed'] for s in rs)} |"
        )
    return "\n".join(lines)


def pair_counts_by_load(
    summaries: Sequence[Mapping[str, Any]], quantiles: Sequence[str] = ("p50", "p90", "p99", "max")
) -> dict[str, dict[str, dict[str, int]]]:
    """Per load and TTFT quantile: in how many (same load, same repeat) pairs the EPP's
    TTFT is lower (better), higher (worse) or equal to round robin's."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    pairs = pair_runs(summaries)
    loads = sorted({e["load"] for e, _ in pairs}, key=lambda x: (0 if x == "low" else 1, x))
    for load in loads:
        mine = [(e, r) for e, r in pairs if e["load"] == load]
        counts: dict[str, dict[str, int]] = {}
        for q in quantiles:
            c = {"better": 0, "worse": 0, "equal": 0, "pairs": len(mine)}
            for e, r in mine:
                ev, rv = e["ttft_ms"][q], r["ttft_ms"][q]
                if ev is None or rv is None:
                    continue
                c["better" if ev < rv else "worse" if ev > rv else "equal"] += 1
            counts[q] = c
        out[load] = counts
    return out


def debug_endpoints_summary(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`--epp-debug` samples of the EPP's /debug/endpoints ({"t": "HH:MM:SS.mmm", "pods":
    [...]}) -> per pod: samples, how many showed it excluded / below health 0.3 / with
    scrape failures, its lowest health, its highest in-flight, queue depth and learned
    running slots, and the first and last time it was seen excluded."""
    out: dict[str, dict[str, Any]] = {}
    for sample in samples:
        for pod in sample.get("pods") or []:
            name = pod.get("name", "?")
            o = out.setdefault(
                name,
                {"samples": 0, "excluded": 0, "health_below_0.3": 0, "scrape_failures": 0,
                 "min_health": None, "max_in_flight": 0, "max_queue_depth": 0,
                 "running_slots": [], "excluded_first": None, "excluded_last": None},
            )  # fmt: skip
            o["samples"] += 1
            health = pod.get("health")
            if health is not None:
                o["min_health"] = (
                    health if o["min_health"] is None else min(o["min_health"], health)
                )
                o["health_below_0.3"] += health < 0.3
            if pod.get("excluded"):
                o["excluded"] += 1
                o["excluded_first"] = o["excluded_first"] or sample.get("t")
                o["excluded_last"] = sample.get("t")
            o["scrape_failures"] += bool(pod.get("scrape_failures"))
            o["max_in_flight"] = max(o["max_in_flight"], pod.get("in_flight") or 0)
            o["max_queue_depth"] = max(o["max_queue_depth"], pod.get("queue_depth") or 0)
            slots = pod.get("running_slots")
            if slots is not None and slots not in o["running_slots"]:
                o["running_slots"].append(slots)
    return out


def request_path(requests: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Where a request's time before routing went, from wall-clock stamps on one machine:
    `to_envoy` = Envoy's start time - the client's send, `envoy_to_routed` = the EPP's
    `request_routed` log time - Envoy's start time. p50 / p99 / max in ms; None when the
    records have no stamps (older runs, or round robin for the second)."""
    legs: dict[str, list[float]] = {"to_envoy": [], "envoy_to_routed": []}
    for r in requests:
        sent, envoy, routed = (
            r.get("sent_unix"),
            r.get("envoy_start_unix"),
            r.get("epp_routed_unix"),
        )
        if sent is not None and envoy is not None:
            legs["to_envoy"].append(1000.0 * (envoy - sent))
        if envoy is not None and routed is not None:
            legs["envoy_to_routed"].append(1000.0 * (routed - envoy))
    out = {
        name: {
            "p50": round(percentile(v, 50), 1),
            "p99": round(percentile(v, 99), 1),
            "max": round(max(v), 1),
            "n": len(v),
        }
        for name, v in legs.items()
        if v
    }
    return out or None


def path_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """Markdown, one row per run: the request-path legs of `request_path`."""
    lines = [
        "| # | load (conc.) | router | client send -> Envoy | Envoy -> EPP routed |",
        "|---|---|---|---|---|",
    ]

    def leg(path: Mapping[str, Any] | None, name: str) -> str:
        v = (path or {}).get(name)
        return "-" if not v else f"{v['p50']:.1f} / {v['p99']:.0f} / {v['max']:.0f}"

    for i, s in enumerate(summaries, 1):
        path = s.get("path_ms")
        lines.append(
            f"| {i} | {s['load']} ({s['concurrency']}) | {s['router']} "
            f"| {leg(path, 'to_envoy')} | {leg(path, 'envoy_to_routed')} |"
        )
    return "\n".join(lines)
