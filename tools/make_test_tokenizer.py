"""Build the small tokenizers the tests use, into tests/fixtures/tokenizer/.

    .venv/bin/python tools/make_test_tokenizer.py            # rewrites both directories

Nothing is downloaded: each tokenizer is trained in a second with `tokenizers` on
generated text. Two shapes, chosen so that the behaviours a router must reproduce show up:

- `llama3/`: byte-level BPE with Llama 3's pre-tokenizer (a regex split, then byte-level
  mapping), a BOS token added by the post-processor for completions, and a Llama-3.1-like
  chat template written for these tests: a system turn that lists the tools as JSON,
  assistant tool calls, `ipython` tool results, `raise_exception` for unknown roles, and
  content trimmed. It iterates over no content parts: vLLM passes it string content.
- `chatml/`: a sentencepiece-style BPE (Metaspace, a "▁" prepended to the first piece
  only), no BOS, and a ChatML template (Qwen-like) that iterates over content parts (vLLM
  passes it content as a list of parts), lists tools, renders tool calls and tool
  responses, shows reasoning, and takes an `enable_thinking` template argument.

Both templates are this project's own text, shaped after the public conventions.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizer"

_WORDS_TEXT = (
    "the a an of to in on for with by from about system user assistant model router cache "
    "prefix block token request response engine pod gateway envoy latency throughput queue "
    "memory score load health adapter prompt conversation question answer please explain "
    "describe summarize translate write code python function class data value number time "
    "first last next because therefore however which what where when why how you we they "
    "it is are was be have has do does can could will would should may not no yes all any "
    "some many more most other such only same so than very just now then here there this "
    "that weather city temperature tool call result search file read json name arguments"
)
WORDS = _WORDS_TEXT.split()
UNICODE = ["café", "naïve", "中文", "日本語", "😀", "Ωmega", "über", "ß", "\u2013", "\u2026"]

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
# Llama 3's pre-tokenizer pattern (as in its tokenizer.json).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if tools is not none or system_message %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
{{- 'You may call these functions. Answer with a JSON object {"name": ..., "parameters": ...}.\\n\\n' }}
{%- for t in tools %}
{{- t | tojson(indent=4) }}
{{- '\\n\\n' }}
{%- endfor %}
{%- endif %}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception('Unsupported role: ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tool_call in message.tool_calls %}
            {%- set f = tool_call.function %}
            {{- '{"name": "' + f.name + '", "parameters": ' + (f.arguments | tojson) + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message['role'] in ['tool', 'ipython'] %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim }}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = """{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'text' -%}
                {{- part['text'] -}}
            {%- elif part['type'] == 'image' -%}
                {{- '<|vision_pad|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- render_content(messages[0]['content']) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0]['content']) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'system' %}
        {{- raise_exception('System message must be at the beginning.') }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- render_content(message.content) }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' + (tool_call.function.arguments | tojson) + '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 30))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100000)))
        if rng.random() < 0.1:
            words.append(rng.choice(UNICODE))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","])
        if rng.random() < 0.2:
            sentence = '{"name": "' + rng.choice(WORDS) + '", "arguments": {}}\n' + sentence
        out.append(sentence)
    out.append("".join(chr(c) for c in range(32, 127)))
    out.append(" ".join(UNICODE))
    return out


def build_llama3(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed, 8000), trainer=trainer)
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tok.token_to_id(bos))],
            ),
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
        "chat_template": LLAMA3_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_chatml(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    alphabet = sorted({c for line in corpus(seed, 200) for c in line} | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIALS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed + 1, 8000), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "model_max_length": 32768,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build_llama3(args.out / "llama3", 1024, args.seed)
    build_chatml(args.out / "chatml", 800, args.seed)
    for name in ("llama3", "chatml"):
        size = sum(f.stat().st_size for f in (args.out / name).iterdir())
        print(f"wrote {args.out / name} ({size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
