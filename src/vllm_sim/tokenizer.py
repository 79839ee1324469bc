"""The simulated model's tokenizer and chat template.

The simulated pod keys its KV blocks by token ids, so it needs a tokenizer; this one is
deliberately not the router's (`epp.tokenization.estimate`, 4 UTF-8 bytes per
pseudo-token, a chat rendered as `<|role|>` text tags). A router in front of these pods, like one in front of
real vLLM pods, cannot reproduce the engine's token ids by construction: an approximate
router must be consistent with itself, and a precise one must read the ids from the
pod's KV events. It works like a real pre-tokenizer plus a fixed vocabulary:

- Text is cut into pieces by a regex shaped like tiktoken's (cl100k / Llama 3): an
  optional leading space or punctuation mark plus a run of letters, runs of up to three
  digits, runs of punctuation, and runs of whitespace (newlines apart).
- A piece of more than `MAX_PIECE_BYTES` UTF-8 bytes is split, on character boundaries,
  into chunks of at most that many bytes, of about equal size (a stand-in for BPE
  cutting a long word into sub-words): an ASCII piece into the fewest such chunks, a CJK
  run into one character per token, as BPE vocabularies roughly do.
- A piece's id is a stable hash (BLAKE2b) of its UTF-8 bytes into `VOCAB_SIZE` regular
  ids: the same in every process, unlike Python's `hash`. Distinct pieces may share an
  id, as they would share a row of a finite vocabulary.

Size, measured: on the benchmark workloads (`epp_bench.workloads.catalog`: random words
of 2-9 letters, lengths counted in the router's pseudo-tokens of 4 bytes) completion
prompts come out at 4.0 UTF-8 bytes per token (shared-prefix 4.01, shared-prefix-small
4.00, multi-LoRA 4.00, no-reuse 4.00, burst 4.01), i.e. 0.997-1.000 tokens per
pseudo-token, and the multi-turn chats at 1.006 tokens per pseudo-token (each side's
template included), so prompts keep the lengths the workloads were sized for. Common
English words are shorter than the workloads' words but long ones are split more often
than BPE would: the prose of this repository's README gives 3.2 bytes per token, where
real BPE vocabularies give about 4 to 4.5.

The chat template is Llama 3's, without its date preamble and without trimming content:

    <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>...
    <|start_header_id|>assistant<|end_header_id|>\\n\\n      (add_generation_prompt)

Special tokens are ids above the regular vocabulary and never come out of text: the
text between them (a role name, "\\n\\n" plus the content) is encoded on its own, as HF
tokenizers encode the text between special tokens. A completion prompt starts with
<|begin_of_text|> (vLLM tokenizes completions with `add_special_tokens=True`, chats,
whose template writes it, without). The rendering is prefix-stable: a conversation that
grows by a turn keeps every earlier id, and a generation prompt is the start of the
assistant turn that answers it, so a client that sends the reply back reuses the
engine's blocks.

`HfDirTokenizer` replaces all of this with a real model's tokenizer files
(`epp sim --tokenizer DIR`): its BPE and its chat template, so that a harness run with
the router configured with the same files shows the two agree (tests/tokenization).

Content is kept verbatim: Llama 3's template trims it, which would drop the leading space
of the simulator's output (`vllm_sim.openai_response`), so that a reply quoted back would
no longer re-encode to the ids generated.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from itertools import chain
from pathlib import Path
from typing import Protocol

VOCAB_SIZE = 128_000  # regular ids are 0 .. VOCAB_SIZE - 1
MAX_PIECE_BYTES = 5

# Llama 3's special tokens, at their ids.
BEGIN_OF_TEXT = 128_000
END_OF_TEXT = 128_001
START_HEADER = 128_006
END_HEADER = 128_007
END_OF_TURN = 128_009
SPECIAL_TOKENS = {
    "<|begin_of_text|>": BEGIN_OF_TEXT,
    "<|end_of_text|>": END_OF_TEXT,
    "<|start_header_id|>": START_HEADER,
    "<|end_header_id|>": END_HEADER,
    "<|eot_id|>": END_OF_TURN,
}

# tiktoken's cl100k pattern in Python's `re`: \p{L} is [^\W\d_] (word characters that
# are neither digits nor "_"), \p{N} is \d, and "_" counts as punctuation.
_PIECES = re.compile(
    r"""'(?i:[sdmt]|ll|ve|re)"""  # contractions
    r"""|[^\r\n\w]?[^\W\d_]+|_[^\W\d_]+"""  # letters, after at most one space or mark
    r"""|\d{1,3}"""  # digits in groups of three
    r"""| ?(?:[^\s\w]|_)+[\r\n]*"""  # punctuation
    r"""|\s*[\r\n]+"""  # newlines, with the spaces before them
    r"""|\s+(?!\S)"""  # spaces before spaces (the last one joins the next piece)
    r"""|\s+"""
)
_PIECE_CACHE_LIMIT = 1 << 20  # distinct pieces remembered before the cache starts over


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn, its content as text."""

    role: str
    content: str


class Tokenizer(Protocol):
    """What the simulated pod needs from a tokenizer."""

    name: str

    def encode(self, text: str, *, add_special_tokens: bool = False) -> array[int]:
        """Token ids of `text` (uint32); with `add_special_tokens`, after the BOS token."""
        ...

    def encode_chat(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> array[int]:
        """Token ids of a conversation rendered through the chat template."""
        ...


def split_pieces(text: str) -> list[str]:
    """The pre-tokenizer's pieces of `text` (before long pieces are split); they join
    back to `text`."""
    return _PIECES.findall(text)


def piece_chunks(piece: str) -> list[str]:
    """`piece` cut into the fewest chunks of at most `MAX_PIECE_BYTES` UTF-8 bytes, of about
    equal size, on character boundaries (one chunk when it is short enough)."""
    raw = piece.encode("utf-8", "surrogatepass")
    if len(raw) <= MAX_PIECE_BYTES:
        return [piece]
    count = -(-len(raw) // MAX_PIECE_BYTES)
    if len(raw) == len(piece):  # ASCII: bytes are characters
        size, extra = divmod(len(piece), count)
        chunks = []
        start = 0
        for index in range(count):
            end = start + size + (index < extra)
            chunks.append(piece[start:end])
            start = end
        return chunks
    # Fill each chunk up to about its share of the bytes, never past MAX_PIECE_BYTES.
    target = -(-len(raw) // count)
    chunks = []
    current: list[str] = []
    used = 0
    for char in piece:
        width = len(char.encode("utf-8", "surrogatepass"))
        if current and (used + width > MAX_PIECE_BYTES or used >= target):
            chunks.append("".join(current))
            current, used = [], 0
        current.append(char)
        used += width
    chunks.append("".join(current))
    return chunks


def piece_id(chunk: str) -> int:
    """The vocabulary id of one chunk: a stable hash of its UTF-8 bytes."""
    digest = hashlib.blake2b(chunk.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB_SIZE


class _PieceIds(dict[str, tuple[int, ...]]):
    """piece -> its ids, filled on first sight (bounded: it starts over when full)."""

    def __missing__(self, piece: str) -> tuple[int, ...]:
        if len(self) >= _PIECE_CACHE_LIMIT:
            self.clear()
        ids = self[piece] = tuple(piece_id(chunk) for chunk in piece_chunks(piece))
        return ids


class SimTokenizer:
    """The simulator's default tokenizer (module docstring): pieces, hashed ids, and
    Llama 3's chat template."""

    name = "vllm-sim-pieces"

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids = _PieceIds()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> array[int]:
        ids: array[int] = array("I", (BEGIN_OF_TEXT,) if add_special_tokens else ())
        ids.extend(self._text_ids(text))
        return ids

    def encode_chat(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> array[int]:
        ids: array[int] = array("I", (BEGIN_OF_TEXT,))
        for message in messages:
            ids.append(START_HEADER)
            ids.extend(self._text_ids(message.role))
            ids.append(END_HEADER)
            ids.extend(self._text_ids("\n\n" + message.content))
            ids.append(END_OF_TURN)
        if add_generation_prompt:
            ids.append(START_HEADER)
            ids.extend(self._text_ids("assistant"))
            ids.append(END_HEADER)
            ids.extend(self._text_ids("\n\n"))
        return ids

    def _text_ids(self, text: str) -> Iterable[int]:
        return chain.from_iterable(map(self._ids.__getitem__, _PIECES.findall(text)))


class HfDirTokenizer:
    """A real model's tokenizer for the simulated pod (`epp sim --tokenizer DIR`).

    DIR holds `tokenizer.json` and `tokenizer_config.json` (its `chat_template`, or a
    `chat_template.jinja` beside it, and the named special tokens). Written for the
    simulator, apart from the router's `epp.tokenization`, so that a parity check between
    them compares two implementations: the template renders in a sandboxed Jinja
    environment set up as transformers sets it up (trim_blocks, lstrip_blocks,
    loopcontrols, `tojson` without HTML escaping, `raise_exception`, `strftime_now`), with
    `messages`, `add_generation_prompt` and the special tokens; the text is encoded with
    `add_special_tokens=False` for a chat and `True` for a completion, as vLLM does. The
    simulator's chat turns are plain text (no tools, no template arguments).
    """

    __slots__ = ("_special", "_template", "_tok", "name")

    def __init__(self, directory: str | Path) -> None:
        import jinja2.ext
        import jinja2.sandbox
        from tokenizers import Tokenizer as HfTokenizer

        path = Path(directory)
        self.name = f"hf:{path.name}"
        self._tok = HfTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self._special = {
            key: value["content"] if isinstance(value, dict) else value
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if isinstance(value := config.get(key), str | dict)
        }
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            source = jinja_file.read_text()
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source) if isinstance(source, str) else None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> array[int]:
        return array("I", self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_chat(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> array[int]:
        import jinja2

        from vllm_sim.openai_errors import ApiError

        if self._template is None:
            raise ApiError(400, f"The tokenizer {self.name} has no chat template.")
        try:
            text = self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self._special,
            )
        except jinja2.TemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The pod's tokenizer: a real one from DIR, or the simulator's own."""
    return SimTokenizer() if directory is None else HfDirTokenizer(directory)
