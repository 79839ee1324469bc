"""Findings on prefix-hit accounting and tokenization: cached_tokens per request, the
whole-block and last-token rules, the hit counters, and prompt token counts."""

from __future__ import annotations

from .accounting import accounting_rows, accounting_violations
from .blocks import chat_tokens_match_tokenize
from .captures import Capture, block_size, cached_tokens, prompt_tokens, step
from .finding import Finding, verdict


def cached_tokens_on_token_ids(vllm: Capture, sim: Capture) -> Finding:
    id_steps = [
        r["name"]
        for r in accounting_rows(vllm)
        if ((step(vllm, r["name"]) or {}).get("request") or {}).get("prompt_ids")
    ]
    differ = [n for n in id_steps if cached_tokens(vllm, n) != cached_tokens(sim, n)]
    listed = ", ".join(
        f"{n} (vLLM {cached_tokens(vllm, n)}, sim {cached_tokens(sim, n)})" for n in differ
    )
    return Finding(
        "cached_tokens on identical token-id prompts",
        verdict(not differ),
        f"{len(id_steps) - len(differ)}/{len(id_steps)} token-id steps give the same "
        "cached_tokens" + (f"; differ: {listed}" if differ else ""),
    )


def whole_blocks_and_last_token(vllm: Capture, sim: Capture) -> Finding:
    bs = block_size(vllm)
    p64, c64 = prompt_tokens(vllm, "ids_64_repeat"), cached_tokens(vllm, "ids_64_repeat")
    return Finding(
        "cached tokens: whole blocks, never the last prompt token",
        verdict(cached_tokens(sim, "ids_64_repeat") == c64),
        f"a prompt of exactly {p64} tokens ({p64 // bs if p64 else '?'} blocks of {bs}) sent "
        f"twice: vLLM reports cached_tokens={c64}, the sim "
        f"{cached_tokens(sim, 'ids_64_repeat')}. 100 ids repeated: vLLM "
        f"{cached_tokens(vllm, 'ids_repeat')}, sim {cached_tokens(sim, 'ids_repeat')} "
        f"(= floor(99/{bs})*{bs}). Rule violations: vLLM "
        f"{len(accounting_violations(vllm))}, sim {len(accounting_violations(sim))}.",
        "A fully cached prompt is never a 100% hit: the engine recomputes the last block "
        "(its last token must be computed to sample). A scorer that predicts the hit should "
        "cap it at floor((n-1)/block)*block; for ranking pods it changes nothing.",
    )


def tokenization_and_chat_template(vllm: Capture, sim: Capture) -> Finding:
    tok_chat = (step(vllm, "tokenize_chat") or {}).get("tokenize") or {}
    tok_text = (step(vllm, "tokenize_text") or {}).get("tokenize") or {}
    sim_tokenizes = (step(sim, "tokenize_chat") or {}).get("status") == 200
    return Finding(
        "tokenization and chat template",
        verdict(prompt_tokens(vllm, "chat_sys_q1") == prompt_tokens(sim, "chat_sys_q1")),
        f"chat (system + user): vLLM {prompt_tokens(vllm, 'chat_sys_q1')} tokens (template "
        f"with BOS and header tokens; /tokenize says {tok_chat.get('count')}), sim "
        f"{prompt_tokens(sim, 'chat_sys_q1')} (its own tokenizer, ~4 bytes per "
        f"token, and a Llama-3-style chat template). Text completion: vLLM {prompt_tokens(vllm, 'text_cold')} tokens, first "
        f"ids {tok_text.get('ids', [])[:3]} (BOS first), sim {prompt_tokens(sim, 'text_cold')}. "
        f"Shared system prompt hit: vLLM {cached_tokens(vllm, 'chat_sys_q2')}, sim "
        f"{cached_tokens(sim, 'chat_sys_q2')}. Event tokens of the chat equal /tokenize's "
        f"rendering: {chat_tokens_match_tokenize(vllm)}. The sim serves /tokenize: "
        f"{sim_tokenizes}.",
        "Precise routing from events needs the model's tokenizer and chat template "
        "(rendered with add_special_tokens=False for chats; completions get BOS), or "
        "vLLM's /tokenize or render endpoints. The approximate index only needs "
        "self-consistency, which the byte estimate gives.",
        "Optional: a --tokenizer DIR flag on epp sim (HF tokenizers + chat template, "
        "through the existing Tokenizer protocol) so token counts, BOS and template "
        "boundaries match a real model; and POST /tokenize.",
    )


def hit_counters(vllm: Capture, sim: Capture) -> Finding:
    v_viol, s_viol = accounting_violations(vllm), accounting_violations(sim)
    return Finding(
        "prefix_cache_queries / prefix_cache_hits counters",
        verdict(not v_viol and not s_viol),
        "per request, queries grow by prompt_tokens and hits by cached_tokens; "
        f"prompt_tokens_cached and prompt_tokens_by_source agree. vLLM violations: "
        f"{v_viol or 'none'}; sim: {s_viol or 'none'}.",
        "The pods' own hit rate (delta hits / delta queries) is comparable between the "
        "sim and vLLM, in tokens, with the last-token cap included.",
    )
