"""A real tokenizer for the pods and the EPP alike, trained on the workload's own text.

Precise mode keys the engine's blocks by the router's hash of their token ids, so a live
comparison of the index modes needs the pods (`epp sim --tokenizer DIR`) and the EPP
(`tokenizers:`) on the same tokenizer files, as a deployment configures the model's own.
The simulator's built-in tokenizer is not one the EPP can load, and the small tokenizers
of the tests cut the workloads' pseudo-words into 1-2 byte pieces, which would make every
prompt 2-3x longer in tokens than the workload was sized for. So: a byte-level BPE
trained, with `tokenizers`, on the workload's texts, about 4 bytes per token on them (the
workloads count 4 bytes per token), and a plain chat template. Training takes well under
a second; the files are written once per directory and reused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from epp_bench.workloads.types import Workload

VOCAB_SIZE = 4096
SPECIAL = "<|endoftext|>"
# Prefix-stable: a conversation that grows by a turn keeps the text of every earlier one.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _texts(workloads: list[Workload]) -> Iterator[str]:
    for workload in workloads:
        for request in workload.requests:
            if request.prompt is not None:
                yield request.prompt
            for message in request.messages or ():
                yield message.content


def ensure_tokenizer(directory: Path, workloads: list[Workload], vocab: int = VOCAB_SIZE) -> Path:
    """`directory` with tokenizer.json and tokenizer_config.json, trained if missing."""
    model = directory / "tokenizer.json"
    if model.is_file() and (directory / "tokenizer_config.json").is_file():
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(workloads), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "bos_token": SPECIAL,
        "eos_token": SPECIAL,
        "pad_token": SPECIAL,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return directory
