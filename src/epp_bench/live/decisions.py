"""Engine-side stale routing of a live run: the EPP's predictions against what the pods reused.

The EPP, at log level info, logs every decision (`request_routed`: request id, prompt
tokens, chosen pod, cache match = matched blocks / prompt blocks). The client keeps, per
request, the id Envoy echoes (`x-epp-request-id`), the serving pod (`x-sim-pod`) and the
engine's own `usage.prompt_tokens_details.cached_tokens`. Joined, they give the
definition `docs/benchmarks/precise.md` uses in virtual time, the same for both index
modes:

- a decision is **checked** when the EPP predicted at least one block on the pod that then
  served the request (a request Envoy retried on another pod is left out);
- the prediction is matched blocks x block size, capped at what an engine can reuse (it
  always computes the prompt's last token: `(prompt_tokens - 1) // block_size` blocks of
  the engine's prompt);
- it is **stale** when the engine reused fewer than `required` (half) of those tokens.

The EPP tokenizes with the pods' tokenizer in these runs (`--tokenizer`), so its prompt
tokens are the engine's and the match converts to tokens exactly; without it, the
prediction is scaled to the engine's prompt length as virtual time does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epp_bench.workloads.types import RequestOutcome

ROUTED_EVENT = "request_routed"
DEFAULT_REQUIRED = 0.5


@dataclass(frozen=True, slots=True)
class LoggedDecision:
    pod: str
    prompt_tokens: int  # the EPP's count
    cache_match: float | None  # matched blocks / prompt blocks on the chosen pod


def parse_decisions(lines: Iterable[str]) -> dict[str, LoggedDecision]:
    """`request_routed` lines of an EPP log by request id (other lines are skipped)."""
    out: dict[str, LoggedDecision] = {}
    for line in lines:
        if ROUTED_EVENT not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("event") != ROUTED_EVENT:
            continue
        request_id, pod = entry.get("request_id"), entry.get("pod")
        if not isinstance(request_id, str) or not isinstance(pod, str):
            continue
        match = entry.get("cache_match")
        out[request_id] = LoggedDecision(
            pod=pod,
            prompt_tokens=int(entry.get("input_tokens") or 0),
            cache_match=float(match) if isinstance(match, int | float) else None,
        )
    return out


def read_decisions(path: Path) -> dict[str, LoggedDecision]:
    with path.open(errors="replace") as lines:
        return parse_decisions(lines)


def predicted_tokens(decision: LoggedDecision, engine_prompt_tokens: int, block_size: int) -> int:
    """Tokens the EPP expected the engine to reuse, capped as the engine caps a hit."""
    if not decision.cache_match or decision.prompt_tokens <= 0 or engine_prompt_tokens <= 0:
        return 0
    # The log rounds the ratio to 4 digits: rounding the product recovers the whole
    # number of blocks for any prompt under 5,000 blocks.
    blocks = round(decision.cache_match * (decision.prompt_tokens // block_size))
    tokens = blocks * block_size
    if decision.prompt_tokens != engine_prompt_tokens:
        tokens = tokens * engine_prompt_tokens // decision.prompt_tokens
    cap = (engine_prompt_tokens - 1) // block_size * block_size
    return min(tokens, cap)


def engine_stale(
    outcomes: Sequence[RequestOutcome],
    request_ids: Mapping[int, str],
    decisions: Mapping[str, LoggedDecision],
    block_size: int,
    required: float = DEFAULT_REQUIRED,
) -> dict[str, Any]:
    """Checked and stale decisions of a run, and the share of predicted tokens reused."""
    joined = moved = checked = stale = 0
    predicted_total = reused_total = 0
    for outcome in outcomes:
        if not outcome.ok:
            continue
        decision = decisions.get(request_ids.get(outcome.index, ""))
        if decision is None:
            continue
        joined += 1
        if outcome.pod != decision.pod:
            moved += 1  # served elsewhere (a retry): the prediction was for another pod
            continue
        predicted = predicted_tokens(decision, outcome.prompt_tokens, block_size)
        if predicted < block_size:
            continue
        checked += 1
        reused = min(outcome.cached_tokens, predicted)
        predicted_total += predicted
        reused_total += reused
        if outcome.cached_tokens < required * predicted:
            stale += 1
    return {
        "joined": joined,
        "served_elsewhere": moved,
        "checked": checked,
        "stale": stale,
        "rate": stale / checked if checked else None,
        "predicted_tokens": predicted_total,
        "predicted_reused": reused_total / predicted_total if predicted_total else None,
    }
