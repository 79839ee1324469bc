"""The KV-event stream: a one-line description of a step's events, and a summary of the
whole stream (sequence numbers, event types and fields, the cache the events imply, the
replay).

Hash values are never compared across the two servers: they differ by design (vLLM:
sha256 of pickled tuples, the sim: sha256 of msgpack over its own token ids).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .captures import Capture, messages

Event = dict[str, Any]


def _stored_text(event: Event) -> str:
    parent = "root" if event.get("parent_block_hash") is None else "child"
    salt = ", salted" if any(event.get("extra_keys") or []) else ""
    return f"Stored {len(event['block_hashes'])} blk/{len(event['token_ids'])} tok ({parent}{salt})"


def describe(events: list[Event]) -> str:
    """`Stored 3 blk/96 tok (root); Removed 2` style summary of a step's events: runs of
    BlockRemoved are counted by hash."""
    parts = []
    removed = 0
    for event in events:
        kind = event.get("type")
        if kind == "BlockRemoved":
            removed += len(event.get("block_hashes") or [])
            continue
        if removed:
            parts.append(f"Removed {removed}")
            removed = 0
        if kind == "BlockStored":
            parts.append(_stored_text(event))
        elif kind == "AllBlocksCleared":
            parts.append("AllBlocksCleared")
        else:
            parts.append(str(kind))
    if removed:
        parts.append(f"Removed {removed}")
    return "; ".join(parts) or "-"


@dataclass
class ImpliedCache:
    """The cache the events imply: a multiset of hashes, +1 per BlockStored, -1 per
    BlockRemoved, emptied by AllBlocksCleared. It records duplicate stores (a hash stored
    while present), removals of hashes not present, and what each parent link points to."""

    present: Counter[str] = field(default_factory=Counter)
    ever: set[str] = field(default_factory=set)
    parents: dict[str, int] = field(default_factory=lambda: {"root": 0, "known": 0, "unknown": 0})
    duplicate_stores: list[str] = field(default_factory=list)
    unknown_removals: list[str] = field(default_factory=list)

    def apply(self, event: Event) -> None:
        kind = event.get("type")
        if kind == "BlockStored":
            self.store(event)
        elif kind == "BlockRemoved":
            self.remove(event["block_hashes"])
        elif kind == "AllBlocksCleared":
            self.present.clear()

    def store(self, event: Event) -> None:
        parent = event.get("parent_block_hash")
        if parent is None:
            self.parents["root"] += 1
        else:
            self.parents["known" if parent in self.ever else "unknown"] += 1
        for h in event["block_hashes"]:
            if self.present[h] > 0:
                self.duplicate_stores.append(h)
            self.present[h] += 1
            self.ever.add(h)

    def remove(self, hashes: list[str]) -> None:
        for h in hashes:
            if self.present[h] <= 0:
                self.unknown_removals.append(h)
            else:
                self.present[h] -= 1

    def cached_count(self) -> int:
        return sum(1 for v in self.present.values() if v > 0)


def event_census(events: list[Event]) -> dict[str, Any]:
    """What the events carry: types, fields per type, media, block sizes, spec kinds,
    non-empty extra keys, and the most hashes one BlockRemoved names."""
    types: Counter[str] = Counter()
    fields: dict[str, set[str]] = {}
    media: Counter[str] = Counter()
    sizes: Counter[Any] = Counter()  # block_size may be absent (None)
    kinds: Counter[str] = Counter()
    salts: list[Any] = []
    max_removed = 0
    for event in events:
        kind = event.get("type", "?")
        types[kind] += 1
        fields.setdefault(kind, set()).update(k for k in event if k != "type")
        if "medium" in event:
            media[str(event["medium"])] += 1
        if kind == "BlockStored":
            sizes[event.get("block_size")] += 1
            kinds[str(event.get("kv_cache_spec_kind"))] += 1
            salts.extend(k for k in event.get("extra_keys") or [] if k)
        elif kind == "BlockRemoved":
            max_removed = max(max_removed, len(event["block_hashes"]))
    return {
        "types": dict(types),
        "fields": {k: sorted(v) for k, v in sorted(fields.items())},
        "media": dict(media),
        "block_sizes": dict(sizes),
        "spec_kinds": dict(kinds),
        "salt_keys": salts,
        "max_removed_per_event": max_removed,
    }


def replay_summary(cap: Capture, live_seqs: list[Any]) -> dict[str, Any]:
    """What the replay from sequence 0 returned, against the live sequence numbers."""
    replay = (cap.get("kv_events") or {}).get("replay") or {}
    batches = replay.get("batches") or []
    return {
        "replay_batches": len(batches),
        "replay_seqs_match": [b["seq"] for b in batches] == live_seqs,
        "replay_end_marker": replay.get("end_marker"),
        "replay_layouts": replay.get("frame_layouts") or [],
        "replay_error": replay.get("error"),
    }


def stream_summary(cap: Capture) -> dict[str, Any]:
    """Sequence numbers, topics, event types and fields, the cache the events imply
    (see ImpliedCache) and the replay, for one capture's whole stream."""
    msgs = messages(cap)
    seqs: list[Any] = [m.get("seq") for m in msgs]
    events = [e for m in msgs for e in m["events"]]
    cache = ImpliedCache()
    for event in events:
        cache.apply(event)
    return {
        "enabled": bool((cap.get("kv_events") or {}).get("enabled")),
        "messages": len(msgs),
        "first_seq": seqs[0] if seqs else None,
        "last_seq": seqs[-1] if seqs else None,
        "contiguous": all(b == a + 1 for a, b in itertools.pairwise(seqs)),
        "topics": sorted({str(m.get("topic")) for m in msgs}),
        "dp_ranks": sorted({str(m.get("dp_rank")) for m in msgs}),
        **event_census(events),
        "parents": cache.parents,
        "duplicate_stores": cache.duplicate_stores,
        "unknown_removals": cache.unknown_removals,
        "cached_after": cache.cached_count(),
        **replay_summary(cap, seqs),
    }
