"""The tokenizer the routing tools time: `--tokenizer DIR`, else the tiny model's that
`make vllm-setup` builds (`.bench/tiny-llama`), else the committed fixture of its files.
(The tools run by path, so this directory is first on their `sys.path`.)"""

from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer's directory")


def directory(given: Path | None) -> Path:
    if given is not None:
        return given
    downloaded = REPO / ".bench" / "tiny-llama"
    if (downloaded / "tokenizer.json").is_file():
        return downloaded
    return REPO / "tests" / "fixtures" / "tokenizer" / "tiny-llama"
