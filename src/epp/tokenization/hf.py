"""A model's own tokenizer, from its files, producing the token ids vLLM produces.

`load_tokenizer_dir(DIR)` (`hf_files`) reads `tokenizer.json` (HF `tokenizers`), and from
`tokenizer_config.json` the named special tokens and the chat template (or from
`chat_template.jinja`, which takes precedence as in transformers; a dict of named
templates uses `tool_use` when the request has tools, else `default`).

What vLLM does, and this reproduces:
- **Completions** are encoded with `add_special_tokens=True`: the tokenizer's
  post-processor adds what it adds (Llama 3: BOS first; ChatML models: nothing).
- **Chats** are rendered through the chat template (`chat_template.py`) and the text is
  encoded with `add_special_tokens=False` (the template writes its own BOS), unless the
  body sets `add_special_tokens: true`.
- The conversation the template sees is vLLM's (`hf_chat`): content as a string (text
  parts joined with "\\n") or, for a template that iterates over parts, as a list of
  parts (a string becomes one text part, no content an empty list); tool turns' text
  parts joined; tool call arguments decoded to objects; `developer` turns become
  `system` when the template does not name that role (then every system turn is merged
  into the first, joined with a blank line); an Anthropic body's inline system turns are
  merged into the first when the template refuses a later system turn.
- Template arguments: the configured defaults, then `tools`, then the body's
  `chat_template_kwargs`, then `add_generation_prompt`, `continue_final_message`,
  `documents`, `reasoning_effort` (and `enable_thinking`, which vLLM derives from it),
  later ones winning, null values skipped; the template receives only those it names.

Bounded work: `encode_prefix` / `encode_chat_prefix` return at most `max_tokens` ids,
encoding a slice of the text's head that grows until it holds `max_tokens` + 16 ids
and the kept ids end at least two pre-tokenizer pieces ahead of the cut (so a merge across
the cut cannot change them; the slice grows once at most for that, so a single "word"
longer than the slice is cut there, its last ids possibly not the engine's), and
estimate the rest of the count from the slice's characters per token. The fast path
(`fast.py`) reads windows of the text the same way. A rendered chat is cut the same way
(the template itself renders the whole conversation the parser kept: templates may look
ahead).

Multi-turn reuse (`cache.py`): before encoding a rendered chat, the longest prefix of it
that ends at a special token and was encoded before is taken from the cache, and only the
rest is encoded, after that special token as an anchor (it must come out as that token,
else the cache is not used for this request). New special-token boundaries of the kept
ids are stored, at least `min_segment_tokens` apart, and always the last one, so turn
N + 1 finds turn N's rendering up to its generation prompt.

`HfTokenizer` stays one class (~440 lines): the bounded head, the fast path's hand-over
to HF, the characters-per-token estimate and the cache's boundaries are one algorithm
over the same encoding state; the conversation shaping and the file loading are apart.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
import xxhash

from epp.tokenization.cache import PrefixTokenCache
from epp.tokenization.chat_template import ChatTemplate
from epp.tokenization.fast import FastByteLevelBpe, HandOver
from epp.tokenization.hf_chat import conversation, template_kwargs
from epp.tokenization.protocol import (
    DEFAULT_CHAT_OPTIONS,
    ChatMessage,
    ChatOptions,
    Encoded,
    TokenizationError,
)

MARGIN_TOKENS = 16  # ids encoded past the kept head, so merges across the cut cannot reach
MIN_SEGMENT_TOKENS = 32
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024

_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(slots=True)
class _Piece:
    """The ids of text[start:end] (after the anchor, if any) from one encoding pass:
    an HF encode of `anchor + text[start:end]` (`encoding`), or the fast path's
    (`counts`: special-token ends -> ids before them; `tail`: the HF pass it handed the
    rest of the text to, from `tail.start`, after `tail_offset` ids of its own)."""

    ids: Sequence[int]
    start: int
    end: int
    complete: bool
    encoding: tokenizers.Encoding | None = None
    skip: int = 0  # 1 when an anchor leads the encoded string
    anchor_len: int = 0
    counts: dict[int, int] | None = None
    tail: _Piece | None = None
    tail_offset: int = 0

    def tokens_before(self, pos: int) -> int | None:
        """How many of `ids` cover text[start:pos], when pos ends a special token."""
        if self.counts is not None:
            if self.tail is not None and pos > self.tail.start:
                inner = self.tail.tokens_before(pos)
                return None if inner is None else self.tail_offset + inner
            return self.counts.get(pos)
        assert self.encoding is not None
        token = self.encoding.char_to_token(pos - 1 - self.start + self.anchor_len)
        if token is None:
            return None
        return token + 1 - self.skip


def _clear_of_the_cut(encoding: tokenizers.Encoding, need: int, skip: int) -> bool:
    """Whether the first `need` ids end two pre-tokenizer pieces ahead of the slice's end,
    so that no merge across the cut can change them (unknown word ids count as clear)."""
    if need == 0:
        return True
    cut_word = encoding.token_to_word(need - 1 + skip)
    last_word = encoding.token_to_word(len(encoding.ids) - 1)
    return cut_word is None or last_word is None or cut_word < last_word - 2


class HfTokenizer:
    """The `Tokenizer` protocol over a model's HF tokenizer files (module docstring)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        name: str,
        special_tokens: Mapping[str, str] | None = None,
        templates: Mapping[str, ChatTemplate] | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        min_segment_tokens: int = MIN_SEGMENT_TOKENS,
        fast_path: bool = True,
    ) -> None:
        self.name = name
        self._tok = tokenizer
        self._encode = tokenizer.encode
        self._special = dict(special_tokens or {})
        self._templates = dict(templates or {})
        self._default_kwargs = dict(default_chat_template_kwargs or {})
        self.cache = PrefixTokenCache(cache_bytes)
        self._min_segment = max(1, min_segment_tokens)
        self._chars_per_token = 4.0
        self._prefix_ids, self._suffix_ids = self._affixes()
        self._anchors, self._boundary_re = self._boundary_tokens()
        self._fast = FastByteLevelBpe.build(tokenizer, self._anchors) if fast_path else None

    # -- setup -------------------------------------------------------------------------
    def _affixes(self) -> tuple[array, array]:
        """The ids the post-processor adds before and after a single sequence."""
        probe = "a b"
        plain = self._encode(probe, add_special_tokens=False).ids
        full = self._encode(probe, add_special_tokens=True).ids
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return array("I", full[:i]), array("I", full[i + len(plain) :])
        raise ValueError(f"{self.name}: the post-processor rewrites the text's ids")

    def _boundary_tokens(self) -> tuple[dict[str, int], re.Pattern[str] | None]:
        """Added tokens that split the input wherever they occur (no strip or word
        rules), as boundaries where the encoding can be cut and resumed."""
        normalizer_free = self._tok.normalizer is None
        anchors: dict[str, int] = {}
        for token_id, token in self._tok.get_added_tokens_decoder().items():
            if token.lstrip or token.rstrip or token.single_word or not token.content:
                continue
            if token.normalized and not normalizer_free:
                continue
            anchors[token.content] = token_id
        if not anchors:
            return anchors, None
        # Longest first: the tokenizer matches leftmost-longest.
        alternation = "|".join(re.escape(t) for t in sorted(anchors, key=len, reverse=True))
        return anchors, re.compile(alternation)

    # -- chat rendering ---------------------------------------------------------------
    def template_for(self, options: ChatOptions) -> ChatTemplate:
        if options.tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        template = self._templates.get("default")
        if template is None:
            raise TokenizationError(
                f"the tokenizer of {self.name} has no chat template, so chat requests"
                " cannot be rendered"
            )
        return template

    def render_chat(self, messages: Sequence[ChatMessage], options: ChatOptions | None) -> str:
        """The conversation as vLLM renders it for this model (text, ahead of encoding)."""
        opts = options or DEFAULT_CHAT_OPTIONS
        template = self.template_for(opts)
        turns = conversation(messages, opts, template)
        kwargs = template_kwargs(opts, self._default_kwargs)
        tools_arg = kwargs.pop("tools", None)
        return template.render(
            turns,
            special_tokens=self._special,
            tools=tools_arg if isinstance(tools_arg, list) else None,
            documents=kwargs.pop("documents", None),
            add_generation_prompt=bool(kwargs.pop("add_generation_prompt", False)),
            continue_final_message=bool(kwargs.pop("continue_final_message", False)),
            kwargs=kwargs,
        )

    # -- the Tokenizer protocol -------------------------------------------------------
    def encode(self, text: str) -> array:
        return self.encode_prefix(text, None).ids

    def encode_chat(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> array:
        return self.encode_chat_prefix(messages, None, options).ids

    def encode_prefix(self, text: str, max_tokens: int | None = None) -> Encoded:
        """A completion prompt: `add_special_tokens=True`, as vLLM encodes it."""
        return self._with_affixes(text, max_tokens)

    def encode_chat_prefix(
        self,
        messages: Sequence[ChatMessage],
        max_tokens: int | None = None,
        options: ChatOptions | None = None,
    ) -> Encoded:
        rendered = self.render_chat(messages, options)
        if options is not None and options.add_special_tokens:
            return self._with_affixes(rendered, max_tokens)
        return self.encode_text_head(rendered, max_tokens)

    def _with_affixes(self, text: str, max_tokens: int | None) -> Encoded:
        """`add_special_tokens=True`: the post-processor's ids around the text's."""
        prefix, suffix = self._prefix_ids, self._suffix_ids
        room = None if max_tokens is None else max(0, max_tokens - len(prefix))
        head = self.encode_text_head(text, room)
        ids = prefix + head.ids if prefix else head.ids
        if head.exact and suffix:
            ids = ids + suffix
        if max_tokens is not None and len(ids) > max_tokens:
            ids = ids[:max_tokens]
        return Encoded(ids, len(prefix) + head.total_tokens + len(suffix), head.exact)

    # -- encoding with the prefix cache -----------------------------------------------
    def encode_text_head(self, text: str, max_tokens: int | None) -> Encoded:
        """`add_special_tokens=False` ids of `text`: at most `max_tokens` of them (None: all),
        reusing and filling the prefix cache."""
        if max_tokens is not None and max_tokens <= 0:
            return Encoded(array("I"), self._estimate(len(text)), not text)
        cap = len(text) if max_tokens is None else min(len(text), max_tokens * 128)
        boundaries = self._boundaries(text, cap)
        base, base_index = self._cached_base(boundaries)
        piece: _Piece | None = None
        if base is not None:
            end, _, anchor = boundaries[base_index]
            if max_tokens is not None and len(base) >= max_tokens:
                rest = len(text) - end
                return Encoded(base[:max_tokens], len(base) + self._estimate(rest), rest == 0)
            need = None if max_tokens is None else max_tokens - len(base)
            piece = (
                self._fast_from(text, end, need)
                if self._fast is not None
                else self._encode_from(text, end, anchor, need)
            )
        if piece is None or base is None:
            # No cached prefix, or its anchor did not come out as itself: encode it all.
            base, base_index = array("I"), -1
            piece = (
                self._fast_from(text, 0, max_tokens)
                if self._fast is not None
                else self._encode_from(text, 0, "", max_tokens)
            )
            if piece is None:  # unreachable: no anchor, nothing to check
                raise TokenizationError("the prompt cannot be tokenized")
        kept = piece.ids if max_tokens is None else piece.ids[: max_tokens - len(base)]
        ids = base + (kept if isinstance(kept, array) else array("I", kept))
        if piece.complete:
            total = len(base) + len(piece.ids)
        else:
            per_char = len(piece.ids) / max(1, piece.end - piece.start)
            total = len(base) + len(piece.ids) + math.ceil((len(text) - piece.end) * per_char)
        self._store(boundaries, base_index, len(base), piece, len(kept), ids)
        return Encoded(ids, total, piece.complete)

    def _cached_base(self, boundaries: list[tuple[int, int, str]]) -> tuple[array | None, int]:
        """The cached ids of the longest prefix ending at one of `boundaries`, and its index
        (None, -1: none cached)."""
        cache = self.cache
        for i in range(len(boundaries) - 1, -1, -1):
            key = boundaries[i][1]
            if key in cache:
                base = cache.get(key)
                if base is not None:
                    return base, i
        return None, -1

    def _boundaries(self, text: str, cap: int) -> list[tuple[int, int, str]]:
        """(end, chained key, token) of each special token in text[:cap]."""
        pattern = self._boundary_re
        if pattern is None:
            return []
        out: list[tuple[int, int, str]] = []
        key = 0
        pos = 0
        for match in pattern.finditer(text, 0, cap):
            end = match.end()
            key = _xxh3(text[pos:end].encode("utf-8", "surrogatepass"), key)
            out.append((end, key, match.group()))
            pos = end
        return out

    def _fast_from(self, text: str, start: int, need: int | None) -> _Piece:
        """text[start:] (or a head holding `need` exact ids) by the fast path, segment by
        segment between special tokens; from the first segment it cannot take, by HF
        (byte-level: a segment encodes alone as it does in context, no anchor needed)."""
        fast = self._fast
        assert fast is not None
        ids = array("I")
        counts: dict[int, int] = {}
        pos = start
        matches = self._boundary_re.finditer(text, start) if self._boundary_re else None
        anchors = self._anchors
        whole = fast.takes_whole(text)  # every segment safe: encoded in place
        while True:
            match = next(matches, None) if matches is not None else None
            segment_end = match.start() if match is not None else len(text)
            if segment_end > pos:
                try:
                    if whole:
                        stop = fast.encode_range_into(ids, text, pos, segment_end, need)
                    else:
                        segment = text[pos:segment_end]
                        if not fast.safe(segment):
                            return self._hand_over(text, start, pos, need, ids, counts)
                        stop = fast.encode_into(ids, segment, need)
                except HandOver as over:  # one huge piece: the HF path's bounded cut
                    return self._hand_over(text, start, pos + over.consumed, need, ids, counts)
                if stop is not None:
                    return _Piece(ids, start, pos + stop, False, counts=counts)
            if match is None:
                if ids and len(text) > start:
                    self._learn_ratio((len(text) - start) / len(ids))
                return _Piece(ids, start, len(text), True, counts=counts)
            ids.append(anchors[match.group()])
            pos = match.end()
            counts[pos] = len(ids)
            if need is not None and len(ids) >= need:
                return _Piece(ids, start, pos, pos == len(text), counts=counts)

    def _hand_over(
        self, text: str, start: int, pos: int, need: int | None, ids: array, counts: dict
    ) -> _Piece:
        """The fast path's piece so far (`ids`, from `start`), finished by HF from `pos`."""
        rest = None if need is None else max(0, need - len(ids))
        tail = self._encode_from(text, pos, "", rest)
        assert tail is not None  # no anchor: nothing to refuse
        offset = len(ids)
        ids.extend(tail.ids)
        return _Piece(ids, start, tail.end, tail.complete, counts=counts, tail=tail, tail_offset=offset)  # fmt: skip

    def _encode_from(self, text: str, start: int, anchor: str, need: int | None) -> _Piece | None:
        """Encode text[start:] (after `anchor`), or a slice of it holding `need` exact ids."""
        skip = 1 if anchor else 0
        if need is None:
            size = len(text) - start
        else:
            size = max(64, math.ceil((need + MARGIN_TOKENS) * self._chars_per_token * 1.2))
        first = size
        while True:
            end = min(len(text), start + size)
            chunk = text[start:end]
            try:
                encoding = self._encode(
                    anchor + chunk if anchor else chunk, add_special_tokens=False
                )
            except Exception as exc:  # the Rust side's errors: bad input
                raise TokenizationError(f"the prompt cannot be tokenized: {exc}") from None
            ids = encoding.ids
            if skip and (not ids or ids[0] != self._anchors[anchor]):
                return None
            count = len(ids) - skip
            if end == len(text):
                if count and end > start:
                    self._learn_ratio((end - start) / count)
                return _Piece(ids[skip:], start, end, True, encoding, skip, len(anchor))
            assert need is not None
            if count >= need + MARGIN_TOKENS:
                # One growth at most for a clear cut (a single huge "word" would otherwise
                # grow the slice to the whole text).
                if size >= 2 * first or _clear_of_the_cut(encoding, need, skip):
                    return _Piece(ids[skip:], start, end, False, encoding, skip, len(anchor))
                size *= 2  # the cut word's pieces: once
            else:
                # Too few ids: grow to what the ids per character so far say, and a bit.
                per_id = (end - start) / max(1, count)
                self._chars_per_token = 0.5 * self._chars_per_token + 0.5 * per_id
                size = max(size * 5 // 4, math.ceil((need + MARGIN_TOKENS) * per_id * 1.2))

    def _store(
        self,
        boundaries: list[tuple[int, int, str]],
        base_index: int,
        base_len: int,
        piece: _Piece,
        kept: int,
        ids: array,
    ) -> None:
        """Store the new boundaries inside the kept ids, `min_segment` ids apart and the
        last one always, each chained to the previous stored one."""
        cache = self.cache
        if cache.max_bytes == 0:
            return
        parent = boundaries[base_index][1] if base_index >= 0 else None
        parent_len = base_len
        eligible: list[tuple[int, int]] = []  # (key, ids before the boundary)
        for end, key, _ in boundaries[base_index + 1 :]:
            if end > piece.end:
                break
            before = piece.tokens_before(end)
            if before is None or before > kept:
                break
            eligible.append((key, base_len + before))
        for i, (key, count) in enumerate(eligible):
            last = i == len(eligible) - 1
            if count - parent_len >= self._min_segment or (last and count > parent_len):
                cache.put(key, parent, ids[parent_len:count])
                if key in cache:
                    parent, parent_len = key, count

    def _learn_ratio(self, chars_per_token: float) -> None:
        """A whole text's characters per token, averaged into the estimate (slices size by it)."""
        self._chars_per_token = 0.9 * self._chars_per_token + 0.1 * chars_per_token

    def _estimate(self, chars: int) -> int:
        return math.ceil(chars / self._chars_per_token)


def __getattr__(name: str) -> Any:
    # `epp.tokenization.hf.load_tokenizer_dir` stays importable; its home is hf_files,
    # which imports this module (so it cannot be imported here at load).
    if name == "load_tokenizer_dir":
        from epp.tokenization.hf_files import load_tokenizer_dir

        return load_tokenizer_dir
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
