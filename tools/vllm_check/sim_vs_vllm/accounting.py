"""Prefix-hit accounting: per request, what `usage` and the /metrics counters say.

vLLM's rules, read off its source and checked on its capture:

- cached tokens are whole blocks, and never include the last prompt token;
- prefix_cache_queries grows by the prompt tokens, prefix_cache_hits by the cached ones;
- prompt_tokens_cached and prompt_tokens_by_source agree with `usage`.
"""

from __future__ import annotations

from typing import Any

from .captures import Capture, Record, block_size, delta, usage

AccountingRow = dict[str, Any]


def accounting_row(rec: Record) -> AccountingRow:
    """Tokens, cached tokens and the counter changes on /metrics of one generation step."""
    by_source = "vllm:prompt_tokens_by_source_total"
    return {
        "name": rec["name"],
        "note": rec["note"],
        "status": rec.get("status"),
        "prompt_tokens": usage(rec, "prompt_tokens"),
        "cached_tokens": usage(rec, "cached_tokens"),
        "queries": delta(rec, "vllm:prefix_cache_queries_total"),
        "hits": delta(rec, "vllm:prefix_cache_hits_total"),
        "prompt_tokens_total": delta(rec, "vllm:prompt_tokens_total"),
        "prompt_tokens_cached": delta(rec, "vllm:prompt_tokens_cached_total"),
        "by_source_hit": delta(rec, by_source, source="local_cache_hit"),
        "by_source_compute": delta(rec, by_source, source="local_compute"),
    }


def accounting_rows(cap: Capture) -> list[AccountingRow]:
    """One row per generation step (completion or chat), in workload order."""
    return [accounting_row(rec) for rec in cap["steps"] if rec["kind"] in ("completion", "chat")]


def row_violations(row: AccountingRow, bs: int, checks_cached_total: bool) -> list[str]:
    """The rules one successful request breaks (see the module docstring)."""
    name, prompt, cached = row["name"], row["prompt_tokens"], row["cached_tokens"]
    if cached is None:
        return [f"{name}: no usage.prompt_tokens_details.cached_tokens"]
    out = []
    if cached % bs:
        out.append(f"{name}: cached {cached} is not a multiple of the block size {bs}")
    if cached > (prompt - 1) // bs * bs:
        out.append(f"{name}: cached {cached} covers the last prompt token ({prompt} tokens)")
    if row["queries"] != prompt:
        out.append(f"{name}: prefix_cache_queries +{row['queries']:g}, prompt {prompt}")
    if row["hits"] != cached:
        out.append(f"{name}: prefix_cache_hits +{row['hits']:g}, cached {cached}")
    if checks_cached_total and row["prompt_tokens_cached"] != cached:
        out.append(
            f"{name}: prompt_tokens_cached +{row['prompt_tokens_cached']:g}, cached {cached}"
        )
    if row["by_source_hit"] + row["by_source_compute"] not in (0.0, prompt):
        out.append(f"{name}: prompt_tokens_by_source does not add up to {prompt}")
    return out


def accounting_violations(cap: Capture) -> list[str]:
    """Where a capture breaks vLLM's accounting rules (empty for real vLLM by definition
    of the rules). prompt_tokens_cached is checked only where the page has it."""
    bs = block_size(cap)
    checks_cached_total = "vllm:prompt_tokens_cached_total" in cap.get("metrics_families", {})
    return [
        problem
        for row in accounting_rows(cap)
        if row["status"] == 200
        for problem in row_violations(row, bs, checks_cached_total)
    ]
