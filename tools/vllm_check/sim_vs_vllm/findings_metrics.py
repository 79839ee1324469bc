"""The finding on /metrics: the series a router reads, and cache_config_info's labels."""

from __future__ import annotations

from .captures import Capture
from .finding import Finding, verdict
from .metrics import (
    ROUTER_METRICS,
    canonical_families,
    info_labels,
    metrics_diff,
    router_series_gaps,
)


def _cache_config_pairs(vllm: Capture, sim: Capture) -> str:
    """`block_size 32 / 32, ...` for the cache_config_info labels a router may read."""
    v_cc = info_labels(vllm["metrics_page_first"], "vllm:cache_config_info")
    s_cc = info_labels(sim["metrics_page_first"], "vllm:cache_config_info")
    keys = ("block_size", "num_gpu_blocks", "hash_block_size", "prefix_caching_hash_algo")
    return ", ".join(f"{k} {v_cc.get(k)} / {s_cc.get(k)}" for k in keys)


def metrics_names_types_labels(vllm: Capture, sim: Capture) -> Finding:
    v_fams, s_fams = vllm["metrics_families"], sim["metrics_families"]
    missing, unlike = router_series_gaps(v_fams, s_fams)
    diff = metrics_diff(v_fams, s_fams)
    vf = canonical_families(v_fams)
    vllm_only_vllm = ", ".join(n for n in diff["only_vllm"] if n.startswith("vllm:"))
    return Finding(
        "/metrics names, types and labels",
        verdict(not missing and not unlike),
        f"of the series a router reads ({', '.join(n for n in ROUTER_METRICS if n in vf)}), "
        f"missing in the sim: {missing or 'none'}; other type or labels: {unlike or 'none'}. "
        f"In all, {len(diff['only_vllm'])} families only in vLLM (`http_*`, `process_*`, "
        f"`python_*` from the API server, and {vllm_only_vllm or 'none'}), "
        f"{len(diff['only_sim'])} only in the sim. cache_config_info: "
        f"{_cache_config_pairs(vllm, sim)} (vLLM / sim).",
        "Read the block size from `block_size`: the API server prints "
        '`hash_block_size="None"` (it is resolved in the engine process), so it cannot '
        "be relied on. On CPU the block size is 32 or more (128 by default), never the "
        "GPU's 16.",
        'metrics_page.py (cache_config_info): print hash_block_size="None" and '
        'prefix_caching_hash_algo="sha256" as vLLM 0.32 does, drop '
        "simple_cpu_offload_num_blocks if the target is 0.32; optionally add "
        "vllm:iteration_tokens_total and the estimated_*_per_gpu counters.",
    )
