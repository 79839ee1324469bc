"""The report's per-request and per-family sections: accounting, KV events, the event
streams, block contents and /metrics. Each returns its lines, ending with a blank one."""

from __future__ import annotations

from .accounting import accounting_rows
from .blocks import block_origins
from .captures import Capture, step, step_events
from .events import describe, stream_summary
from .metrics import canonical_families, epp_parse, info_labels, metrics_diff
from .report_format import number, origin_text, short, table_row

# (stream_summary key, row label) of the event-stream table.
STREAM_ROWS = (
    ("messages", "batches (live)"),
    ("first_seq", "first sequence number"),
    ("contiguous", "sequence without gaps"),
    ("topics", "topic"),
    ("dp_ranks", "data_parallel_rank"),
    ("types", "events by type"),
    ("block_sizes", "BlockStored block_size"),
    ("media", "medium"),
    ("parents", "parent_block_hash: root / earlier block / unknown"),
    ("duplicate_stores", "hashes stored while already cached"),
    ("unknown_removals", "removals of hashes not cached"),
    ("salt_keys", "non-empty extra_keys"),
    ("replay_batches", "replay from 0: batches"),
    ("replay_layouts", "replay frames (after the empty delimiter)"),
    ("replay_end_marker", "replay end marker"),
)


def accounting_section(vllm: Capture, sim: Capture) -> list[str]:
    """Prompt, cached, Δqueries and Δhits per generation step, vLLM / sim."""
    lines = [
        "## Prefix-hit accounting, request by request",
        "",
        "`prompt` and `cached` are the response's `usage.prompt_tokens` and "
        "`usage.prompt_tokens_details.cached_tokens`; `Δq` and `Δh` the change of "
        "`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` across the "
        "request.",
        "",
        table_row(
            "step", "what", "prompt vLLM/sim", "cached vLLM/sim", "Δq vLLM/sim", "Δh vLLM/sim"
        ),
        table_row("---", "---", "---", "---", "---", "---"),
    ]
    sim_rows = {r["name"]: r for r in accounting_rows(sim)}
    for r in accounting_rows(vllm):
        s = sim_rows.get(r["name"], {})
        pairs = (
            f"{number(r[k])} / {number(s.get(k))}"
            for k in ("prompt_tokens", "cached_tokens", "queries", "hits")
        )
        lines.append(table_row(f"`{r['name']}`", r["note"], *pairs))
    return [*lines, ""]


def step_events_section(vllm: Capture, sim: Capture) -> list[str]:
    """Each step's KV events, described, side by side."""
    lines = [
        "## KV events, request by request",
        "",
        "`Stored b blk/t tok (root|child)`: one BlockStored of b blocks and t tokens, whose "
        "`parent_block_hash` is None (root) or an earlier block (child). `Removed n`: n "
        "BlockRemoved events of one hash each.",
        "",
        table_row("step", "vLLM", "epp sim"),
        table_row("---", "---", "---"),
    ]
    for rec in vllm["steps"]:
        srec = step(sim, rec["name"])
        sim_text = describe(step_events(sim, srec)) if srec else "-"
        lines.append(table_row(f"`{rec['name']}`", describe(step_events(vllm, rec)), sim_text))
    return [*lines, ""]


def streams_section(vllm: Capture, sim: Capture) -> list[str]:
    """The stream summaries side by side, then the BlockStored field names."""
    vs, ss = stream_summary(vllm), stream_summary(sim)
    return [
        "### The event streams",
        "",
        table_row("", "vLLM", "epp sim"),
        table_row("---", "---", "---"),
        *(table_row(label, short(vs.get(key)), short(ss.get(key))) for key, label in STREAM_ROWS),
        "",
        "BlockStored fields: vLLM `"
        + ", ".join(vs["fields"].get("BlockStored", []))
        + "`; sim `"
        + ", ".join(ss["fields"].get("BlockStored", []))
        + "`.",
        "",
    ]


def block_contents_section(vllm: Capture, sim: Capture) -> list[str]:
    """Where each stored block of a token-id step sits in its request, per step."""
    v_orig, s_orig = block_origins(vllm), block_origins(sim)
    lines = [
        "Block contents (token-id steps; vLLM returned the generated ids with "
        "`return_token_ids`, the sim returns none, so its continuation used fixed ids):",
        "",
        table_row(
            "step",
            "vLLM: first block, blocks, holds output",
            "sim: first block, blocks, holds output",
        ),
        table_row("---", "---", "---"),
    ]
    for name in dict.fromkeys(o["step"] for o in v_orig + s_orig):
        lines.append(
            table_row(
                f"`{name}`",
                "; ".join(origin_text(o) for o in v_orig if o["step"] == name) or "-",
                "; ".join(origin_text(o) for o in s_orig if o["step"] == name) or "-",
            )
        )
    return [*lines, ""]


def _family_items(names: list[str], families: dict) -> list[str]:
    return [
        f"- `{n}` ({families[n]['type']}; labels: {', '.join(families[n]['labels']) or '-'})"
        for n in names
    ]


def _shape_diff_items(diff: dict) -> list[str]:
    """Families of both with another type or other label names, or `- none`."""
    items = [f"- `{n}`: type vLLM {a}, sim {b}" for n, a, b in diff["type_diff"]]
    items += [
        f"- `{n}`: labels only in vLLM {a or '-'}, only in the sim {b or '-'}"
        for n, a, b in diff["label_diff"]
    ]
    return items or ["- none"]


def _cache_config_line(vllm: Capture, sim: Capture) -> str:
    v_cc = info_labels(vllm["metrics_page_first"], "vllm:cache_config_info")
    s_cc = info_labels(sim["metrics_page_first"], "vllm:cache_config_info")
    differing = sorted(k for k in set(v_cc) | set(s_cc) if v_cc.get(k) != s_cc.get(k))
    pairs = ", ".join(
        f"`{k}` {v_cc.get(k, '(absent)')} → {s_cc.get(k, '(absent)')}" for k in differing
    )
    return f"`vllm:cache_config_info` label values that differ (vLLM → sim): {pairs or 'none'}."


def _epp_lines(vllm: Capture, sim: Capture) -> list[str]:
    """What the EPP's scraper reads from each first page (nothing when epp is absent)."""
    v_epp, s_epp = epp_parse(vllm["metrics_page_first"]), epp_parse(sim["metrics_page_first"])
    if v_epp is None:
        return []
    return [
        "What the EPP's own scraper (`epp.datalayer.metrics_parser`) reads from the first "
        f"page of each: vLLM `{v_epp}`; sim `{s_epp}`.",
        "",
    ]


def metrics_section(vllm: Capture, sim: Capture) -> list[str]:
    """Family counts, the families on one side only, shape differences, cache_config_info."""
    diff = metrics_diff(vllm["metrics_families"], sim["metrics_families"])
    vf = canonical_families(vllm["metrics_families"])
    sf = canonical_families(sim["metrics_families"])
    return [
        "## /metrics",
        "",
        f"Families (without the `_created` gauges): vLLM {len(vf)}, sim {len(sf)}, "
        f"in both {len(diff['both'])}. The full lists, with types and label names, are in "
        "the captures (`metrics_families`).",
        "",
        "Only in vLLM:",
        "",
        *_family_items(diff["only_vllm"], vf),
        "",
        "Only in the sim:",
        "",
        *(_family_items(diff["only_sim"], sf) or ["- none"]),
        "",
        "Same name, different type or labels:",
        "",
        *_shape_diff_items(diff),
        "",
        _cache_config_line(vllm, sim),
        "",
        *_epp_lines(vllm, sim),
    ]
