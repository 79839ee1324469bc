"""`load_tokenizer_dir`: an `HfTokenizer` from a model's tokenizer files (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`, `chat_template.jinja`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import tokenizers

from epp.tokenization.chat_template import ChatTemplate
from epp.tokenization.hf import DEFAULT_CACHE_BYTES, HfTokenizer

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def load_tokenizer_dir(
    path: Path | str,
    *,
    name: str | None = None,
    chat_template_file: Path | str | None = None,
    content_format: Literal["auto", "string", "openai"] = "auto",
    default_chat_template_kwargs: Mapping[str, Any] | None = None,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    now: Callable[[], datetime] = datetime.now,
    fast_path: bool = True,
) -> HfTokenizer:
    """An HfTokenizer from a directory holding `tokenizer.json` (required),
    `tokenizer_config.json`, `special_tokens_map.json` and `chat_template.jinja`
    (optional). Raises ValueError naming the file for anything unreadable."""
    directory = Path(path)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{directory}: no tokenizer.json")
    try:
        tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side's parse errors
        raise ValueError(f"{tokenizer_file}: {exc}") from None
    config_file = directory / "tokenizer_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    map_file = directory / "special_tokens_map.json"
    token_map = _read_json(map_file) if map_file.is_file() else {}
    special: dict[str, str] = {}
    for key in SPECIAL_TOKEN_NAMES:
        value = _token_text(config.get(key)) or _token_text(token_map.get(key))
        if value is not None:
            special[key] = value
    sources = _template_sources(directory, config, chat_template_file)
    templates = {
        key: ChatTemplate(source, content_format=content_format, now=now)
        for key, source in sources.items()
    }
    return HfTokenizer(
        tok,
        name=name or f"hf:{directory.name}",
        special_tokens=special,
        templates=templates,
        default_chat_template_kwargs=default_chat_template_kwargs,
        cache_bytes=cache_bytes,
        fast_path=fast_path,
    )


def _template_sources(
    directory: Path, config: dict[str, Any], chat_template_file: Path | str | None
) -> dict[str, str]:
    """Template name -> source: `chat_template` of tokenizer_config.json (a string, or a
    list of named templates), replaced by chat_template.jinja as transformers does, and by
    the configured file above both."""
    sources: dict[str, str] = {}
    raw: Any = config.get("chat_template")
    if isinstance(raw, str):
        sources["default"] = raw
    elif isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                sources[item["name"]] = str(item.get("template", ""))
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        sources["default"] = jinja_file.read_text(encoding="utf-8")
    if chat_template_file is not None:
        sources = {"default": Path(chat_template_file).read_text(encoding="utf-8")}
    return sources
