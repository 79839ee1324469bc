"""Build a tiny, randomly initialised Llama and a byte-level BPE tokenizer for vLLM on CPU.

Runs in the vLLM venv (it needs torch and transformers, which the project venv does not
have):

    .bench/vllm-venv/bin/python tools/vllm_check/build_model.py --out .bench/tiny-llama

No weights are downloaded: the model is random (seeded) and the tokenizer is trained in a
second on generated text. Shapes follow tooling.md: hidden 128, 2 layers, 2 heads of
head_dim 64 (16 fails on this CPU), bf16, under 1 M parameters.

The tokenizer copies Llama 3's conventions, so that the engine's behaviour a router must
reproduce shows up: completions get a BOS token (`add_special_tokens=True` runs the
post-processor), chats do not (the chat template writes `{{ bos_token }}` itself and vLLM
tokenizes rendered chats with `add_special_tokens=False`), and the template wraps each
message in header and end-of-turn special tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Llama 3's template, without the tool and date preamble.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "for",
    "with",
    "by",
    "from",
    "about",
    "system",
    "user",
    "assistant",
    "model",
    "router",
    "cache",
    "prefix",
    "block",
    "token",
    "request",
    "response",
    "engine",
    "pod",
    "gateway",
    "envoy",
    "kubernetes",
    "latency",
    "throughput",
    "queue",
    "memory",
    "score",
    "load",
    "health",
    "adapter",
    "prompt",
    "conversation",
    "question",
    "answer",
    "please",
    "explain",
    "describe",
    "summarize",
    "translate",
    "write",
    "code",
    "python",
    "function",
    "class",
    "data",
    "value",
    "number",
    "time",
    "first",
    "last",
    "next",
    "previous",
    "because",
    "therefore",
    "however",
    "which",
    "what",
    "where",
    "when",
    "why",
    "how",
    "you",
    "we",
    "they",
    "it",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "have",
    "has",
    "had",
    "do",
    "does",
    "did",
    "can",
    "could",
    "will",
    "would",
    "should",
    "may",
    "might",
    "must",
    "not",
    "no",
    "yes",
    "all",
    "any",
    "some",
    "many",
    "more",
    "most",
    "other",
    "such",
    "only",
    "own",
    "same",
    "so",
    "than",
    "too",
    "very",
    "just",
    "now",
    "then",
    "here",
    "there",
    "this",
    "that",
    "these",
    "those",
]


def training_corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 30))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100000)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","])
        corpus.append(sentence)
    # Every printable ASCII character, so nothing falls outside the learned merges.
    corpus.append("".join(chr(c) for c in range(32, 127)))
    return corpus


def build_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed, 20000), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Llama 3: BOS before every sequence encoded with add_special_tokens=True.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": "<|eot_id|>",
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": "<|eot_id|>", "pad_token": EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def build_model(out: Path, vocab_size: int, seed: int) -> int:
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id("<|eot_id|>"),
        pad_token_id=tok.token_to_id(EOS),
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".bench/tiny-llama"))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    out: Path = args.out
    if (out / "config.json").exists() and (out / "tokenizer.json").exists() and not args.force:
        print(f"{out} already built (use --force to rebuild)")
        return
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    build_tokenizer(out, args.vocab_size, args.seed)
    params = build_model(out, args.vocab_size, args.seed)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"built {out}: {params} parameters, vocab {len(tok)}, {size / 1e6:.1f} MB, "
        f"{time.monotonic() - start:.1f} s; completion 'hello' -> {tok('hello').input_ids}; "
        f"chat renders {chat!r}"
    )


if __name__ == "__main__":
    main()
