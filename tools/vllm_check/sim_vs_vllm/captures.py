"""Loading the two captures and reading steps, usage and counter changes out of them.

A capture is the dict run_check.py saves (see capture.py for its shape): `meta`, `steps`
(one record per workload step), `kv_events` (the live batches and the replay) and the
`/metrics` families and pages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Capture = dict[str, Any]
Record = dict[str, Any]


def load(directory: Path) -> tuple[Capture, Capture]:
    """(vllm, sim) captures from a directory holding vllm.json and sim.json."""
    vllm = json.loads((directory / "vllm.json").read_text())
    sim = json.loads((directory / "sim.json").read_text())
    return vllm, sim


def block_size(cap: Capture) -> int:
    return int(cap["meta"]["block_size"])


def step(cap: Capture, name: str) -> Record | None:
    """The record of the step called `name`, or None."""
    return next((s for s in cap["steps"] if s["name"] == name), None)


def delta(record: Record, metric: str, **labels: str) -> float:
    """A counter's change across one step, summed over series matching `labels`."""
    total = 0.0
    for key, value in (record.get("counter_deltas") or {}).items():
        name, _, rest = key.partition("{")
        if name != metric:
            continue
        series = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p)
        if all(series.get(k) == v for k, v in labels.items()):
            total += value
    return total


def usage(record: Record | None, key: str) -> int | None:
    """One field of a step's `usage` (prompt_tokens, cached_tokens), or None."""
    if not record or not record.get("usage"):
        return None
    return record["usage"].get(key)


def cached_tokens(cap: Capture, name: str) -> int | None:
    return usage(step(cap, name), "cached_tokens")


def prompt_tokens(cap: Capture, name: str) -> int | None:
    return usage(step(cap, name), "prompt_tokens")


def messages(cap: Capture) -> list[dict[str, Any]]:
    """The live KV-event batches, in arrival order."""
    return (cap.get("kv_events") or {}).get("messages") or []


def step_events(cap: Capture, rec: Record) -> list[dict[str, Any]]:
    """The KV events that arrived while the step `rec` ran."""
    span = rec.get("event_messages")
    if not span:
        return []
    return [e for m in messages(cap)[span[0] : span[1]] for e in m["events"]]


def named_step_events(cap: Capture, name: str) -> list[dict[str, Any]]:
    """The KV events of the step called `name` (none when there is no such step)."""
    rec = step(cap, name)
    return step_events(cap, rec) if rec else []
