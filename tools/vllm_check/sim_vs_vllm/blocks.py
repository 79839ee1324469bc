"""Block contents and evictions: which request positions a stored block covers, whether
it holds generated tokens, which step's blocks each removal evicted, and whether a chat's
event tokens are /tokenize's rendering of it.

Blocks are compared by position, size, parent links and token contents, never by hash.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .captures import Capture, Record, block_size, messages, step, step_events

Origin = dict[str, Any]


def _aligned_offset(full: list[int], tokens: list[int], bs: int) -> int | None:
    """The block-aligned offset at which `tokens` occur in `full`, if any."""
    for start in range(0, max(1, len(full) - len(tokens) + 1), bs):
        if full[start : start + len(tokens)] == tokens:
            return start
    return None


def _aligned_prefix_offset(prompt: list[int], tokens: list[int], bs: int) -> int | None:
    """The block-aligned offset at which `tokens` start with the rest of `prompt` and run
    past its end, if any."""
    for start in range(0, len(prompt), bs):
        head = prompt[start:]
        if len(head) < len(tokens) and tokens[: len(head)] == head:
            return start
    return None


def stored_origin(rec: Record, event: dict[str, Any], bs: int) -> Origin:
    """Where one BlockStored of the token-id step `rec` sits in its request."""
    prompt = rec["request"]["prompt_ids"]
    full = list(prompt) + list(rec.get("output_token_ids") or [])
    tokens = event["token_ids"]
    start = _aligned_offset(full, tokens, bs)
    origin: Origin = {
        "step": rec["name"],
        "blocks": len(event["block_hashes"]),
        "tokens": len(tokens),
        "first_block": None if start is None else start // bs,
    }
    if start is None:
        # Output tokens we were not told (the sim returns no token ids): a block that
        # starts inside the prompt and runs past it.
        k = _aligned_prefix_offset(prompt, tokens, bs)
        origin["holds_output"] = k is not None
        origin["first_block"] = None if k is None else k // bs
        origin["matched"] = k is not None
    else:
        origin["holds_output"] = start + len(tokens) > len(prompt)
        origin["matched"] = True
    return origin


def block_origins(cap: Capture) -> list[Origin]:
    """For each BlockStored of a token-id step: which block positions of the request it
    covers and whether those blocks hold generated (output) tokens."""
    bs = block_size(cap)
    return [
        stored_origin(rec, event, bs)
        for rec in cap["steps"]
        if (rec.get("request") or {}).get("prompt_ids")
        for event in step_events(cap, rec)
        if event.get("type") == "BlockStored"
    ]


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


def victim_summary(victims: list[tuple[str, str]]) -> str:
    """`step count, ...` of evicted blocks by the step that stored them, or `none`."""
    counts: Counter[str] = Counter(origin for _, origin in victims)
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


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
