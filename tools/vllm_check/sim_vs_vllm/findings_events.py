"""Findings on the KV events: output blocks, duplicate stores, AllBlocksCleared timing,
replay framing, BlockStored fields and eviction order."""

from __future__ import annotations

from .blocks import (
    block_origins,
    eviction_victims,
    removal_counts,
    victim_order,
    victim_summary,
)
from .captures import Capture, cached_tokens, named_step_events
from .events import describe, stream_summary
from .finding import Finding, verdict


def output_blocks(vllm: Capture, sim: Capture) -> Finding:
    v_out = [o for o in block_origins(vllm) if o["holds_output"]]
    s_out = [o for o in block_origins(sim) if o["holds_output"]]
    vc, sc = cached_tokens(vllm, "ids_gen40_continue"), cached_tokens(sim, "ids_gen40_continue")
    return Finding(
        "full blocks holding generated tokens are cached and announced",
        verdict(bool(v_out) == bool(s_out) and vc == sc),
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


def duplicate_stores(vllm: Capture, sim: Capture) -> Finding:
    v_dups = stream_summary(vllm)["duplicate_stores"]
    s_dups = stream_summary(sim)["duplicate_stores"]
    v_removed = removal_counts(vllm)
    return Finding(
        "BlockStored for a hash already cached (recomputed last block)",
        verdict(bool(v_dups) == bool(s_dups)),
        f"vLLM: {len(v_dups)} duplicate store(s) "
        + ", ".join(f"{h} (later removed {v_removed.get(h, 0)}x)" for h in v_dups[:3])
        + f"; sim: {len(s_dups)}. In ids_64_repeat vLLM emitted: "
        f"{describe(named_step_events(vllm, 'ids_64_repeat'))}; "
        f"the sim: {describe(named_step_events(sim, 'ids_64_repeat'))}.",
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


def all_blocks_cleared_timing(vllm: Capture, sim: Capture) -> Finding:
    v_reset = describe(named_step_events(vllm, "reset"))
    s_reset = describe(named_step_events(sim, "reset"))
    v_next = describe(named_step_events(vllm, "ids_after_reset"))
    return Finding(
        "when AllBlocksCleared is published",
        verdict(v_reset == s_reset),
        f"during /reset_prefix_cache vLLM published: {v_reset}; with the next request: "
        f"{v_next}. The sim during the reset: {s_reset}.",
        "vLLM's events leave the engine with its next scheduler step, so on an idle pod "
        "the clear is only seen when the next request arrives. Harmless for routing "
        "(the pod is idle), but a router must not wait for it after calling the reset.",
        "Optional (kv_publisher.py / engine.py): hold AllBlocksCleared until the next "
        "batch of events instead of publishing it alone.",
    )


def replay_framing(vllm: Capture, sim: Capture) -> Finding:
    vs, ss = stream_summary(vllm), stream_summary(sim)
    return Finding(
        "replay framing",
        verdict(vs["replay_layouts"] == ss["replay_layouts"]),
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


def block_stored_fields(vllm: Capture, sim: Capture) -> Finding:
    vs, ss = stream_summary(vllm), stream_summary(sim)
    v_fields = set(vs["fields"].get("BlockStored", []))
    s_fields = set(ss["fields"].get("BlockStored", []))
    return Finding(
        "BlockStored fields",
        verdict(v_fields == s_fields),
        f"only in vLLM: {sorted(v_fields - s_fields)}; only in the sim: "
        f"{sorted(s_fields - v_fields)}; vLLM kv_cache_spec_kind values: "
        f"{vs['spec_kinds']}; medium: vLLM {vs['media']}, sim {ss['media']}; "
        f"cache_salt on block 0: vLLM {vs['salt_keys'][:1]}, sim {ss['salt_keys'][:1]}.",
        "Consumers must ignore unknown fields (vLLM adds them over releases).",
        "kv_events.py (BlockStored): add kv_cache_spec_kind='full_attention'."
        if v_fields - s_fields
        else "",
    )


def eviction_order(vllm: Capture, sim: Capture) -> Finding:
    v_vict, s_vict = eviction_victims(vllm), eviction_victims(sim)
    v_order, s_order = victim_order(v_vict), victim_order(s_vict)
    common = set(v_order) & set(s_order)
    same_order = [o for o in v_order if o in common] == [o for o in s_order if o in common]
    v_max = stream_summary(vllm)["max_removed_per_event"]
    s_max = stream_summary(sim)["max_removed_per_event"]
    return Finding(
        "eviction order (LRU of unused blocks, a request's tail before its head)",
        verdict(same_order and v_max == s_max),
        f"vLLM removed {len(v_vict)} blocks, the sim {len(s_vict)}, both with one hash "
        f"per BlockRemoved (max {v_max} / {s_max}). Victims by the step that stored them, "
        f"in eviction order: vLLM {victim_summary(v_vict)}; sim {victim_summary(s_vict)}. "
        f"Same order over the steps both evicted from: {same_order}. The counts differ "
        "only where the stored blocks differ (the duplicate copy, the output block, the "
        "text prompt's token count). cached_tokens for the first 100 ids after the long "
        f"prompt: vLLM {cached_tokens(vllm, 'ids_after_evict')}, sim "
        f"{cached_tokens(sim, 'ids_after_evict')}.",
    )
