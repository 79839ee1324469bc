"""The /metrics pages: families (name, type, label names) on each side, the series a router
reads, label values of the info gauges, and what the EPP's own scraper makes of a page."""

from __future__ import annotations

import re
from typing import Any

Families = dict[str, Any]

# The series the EPP's scraper reads (epp.datalayer.metrics_parser).
ROUTER_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:cache_config_info",
    "vllm:lora_requests_info",
)

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def canonical_families(families: Families) -> Families:
    """Families without the `_created` gauges prometheus_client adds to counters and
    histograms (they carry no information a router uses)."""
    out = {}
    for name, fam in families.items():
        if name.endswith("_created"):
            base = name[: -len("_created")]
            if base in families or base + "_total" in families:
                continue
        out[name] = fam
    return out


def metrics_diff(vllm: Families, sim: Families) -> dict[str, Any]:
    """Family names only on one side or on both, and those of both whose type or label
    names differ: (name, vLLM's, the sim's) and (name, labels only in vLLM, only in the sim)."""
    v, s = canonical_families(vllm), canonical_families(sim)
    both = sorted(set(v) & set(s))
    return {
        "only_vllm": sorted(set(v) - set(s)),
        "only_sim": sorted(set(s) - set(v)),
        "both": both,
        "type_diff": [
            (n, v[n]["type"], s[n]["type"]) for n in both if v[n]["type"] != s[n]["type"]
        ],
        "label_diff": [
            (
                n,
                sorted(set(v[n]["labels"]) - set(s[n]["labels"])),
                sorted(set(s[n]["labels"]) - set(v[n]["labels"])),
            )
            for n in both
            if v[n]["labels"] != s[n]["labels"]
        ],
    }


def router_series_gaps(vllm: Families, sim: Families) -> tuple[list[str], list[str]]:
    """Of the ROUTER_METRICS vLLM has: those the sim lacks, and those it has with another
    type or other label names."""
    vf, sf = canonical_families(vllm), canonical_families(sim)
    missing = [n for n in ROUTER_METRICS if n in vf and n not in sf]
    unlike = [
        n
        for n in ROUTER_METRICS
        if n in vf
        and n in sf
        and (vf[n]["type"], vf[n]["labels"]) != (sf[n]["type"], sf[n]["labels"])
    ]
    return missing, unlike


def info_labels(page: str, metric: str) -> dict[str, str]:
    """The label values of the first series of `metric` on a page (an info gauge)."""
    for line in page.splitlines():
        if line.startswith(metric + "{"):
            return dict(_LABEL.findall(line.split("{", 1)[1].rsplit("}", 1)[0]))
    return {}


def epp_parse(page: str) -> dict[str, Any] | None:
    """What the EPP's own scraper reads from a page (None when epp is not importable)."""
    try:
        from epp.datalayer.metrics_parser import parse_vllm_metrics
    except ImportError:
        return None
    m = parse_vllm_metrics(page)
    return {
        "waiting": m.waiting,
        "running": m.running,
        "kv_usage": m.kv_usage,
        "prefix_queries": m.prefix_queries,
        "prefix_hits": m.prefix_hits,
        "block_size": m.block_size,
        "num_gpu_blocks": m.num_gpu_blocks,
        "model": m.model,
    }
