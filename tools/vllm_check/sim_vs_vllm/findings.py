"""All findings, in the order the report lists them."""

from __future__ import annotations

from collections.abc import Callable

from .captures import Capture
from .finding import Finding
from .findings_accounting import (
    cached_tokens_on_token_ids,
    hit_counters,
    tokenization_and_chat_template,
    whole_blocks_and_last_token,
)
from .findings_events import (
    all_blocks_cleared_timing,
    block_stored_fields,
    duplicate_stores,
    eviction_order,
    output_blocks,
    replay_framing,
)
from .findings_metrics import metrics_names_types_labels

Topic = Callable[[Capture, Capture], Finding]

TOPICS: tuple[Topic, ...] = (
    cached_tokens_on_token_ids,
    whole_blocks_and_last_token,
    output_blocks,
    duplicate_stores,
    all_blocks_cleared_timing,
    replay_framing,
    block_stored_fields,
    eviction_order,
    tokenization_and_chat_template,
    metrics_names_types_labels,
    hit_counters,
)


def findings(vllm: Capture, sim: Capture) -> list[Finding]:
    """One Finding per topic, comparing the sim's capture with vLLM's."""
    return [topic(vllm, sim) for topic in TOPICS]
