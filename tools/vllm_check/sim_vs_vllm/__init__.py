"""Compare the captures of real vLLM and `epp sim` (pure functions over the two capture
dicts, see ../capture.py for their shape) and render docs/benchmarks/sim-vs-vllm.md.

- captures: loading, and reading steps, usage, counter changes and events out of a capture;
- accounting: cached tokens and hit counters per request, and vLLM's rules for them;
- events: the KV-event stream (sequence, types, fields, implied cache, replay);
- blocks: what stored blocks contain, which steps' blocks were evicted;
- metrics: /metrics families, the series a router reads, info labels;
- finding, findings_*, findings: one Finding per topic, in report order;
- report_format, report_tables, report: the markdown.

Hash values are never compared across the two: they differ by design (vLLM: sha256 of
pickled tuples, the sim: sha256 of msgpack over its own token ids). Blocks are compared by position, size, parent
links and token contents instead.
"""

from __future__ import annotations

from .accounting import accounting_rows, accounting_violations
from .blocks import (
    block_origins,
    chat_tokens_match_tokenize,
    eviction_victims,
    removal_counts,
    victim_order,
)
from .captures import Capture, block_size, load, step, step_events
from .events import describe, stream_summary
from .finding import Finding
from .findings import TOPICS, findings
from .metrics import ROUTER_METRICS, canonical_families, epp_parse, info_labels, metrics_diff
from .report import render

__all__ = [
    "ROUTER_METRICS",
    "TOPICS",
    "Capture",
    "Finding",
    "accounting_rows",
    "accounting_violations",
    "block_origins",
    "block_size",
    "canonical_families",
    "chat_tokens_match_tokenize",
    "describe",
    "epp_parse",
    "eviction_victims",
    "findings",
    "info_labels",
    "load",
    "metrics_diff",
    "removal_counts",
    "render",
    "step",
    "step_events",
    "stream_summary",
    "victim_order",
]
