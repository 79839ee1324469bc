"""Where the live benchmark's extra tools, frozen code, logs and raw results live.

Everything goes under one `.bench/` directory (never committed):

    .bench/venvs/inference-perf/   Python 3.12, `inference-perf`
    .bench/venvs/sglang-router/    `sglang-router` (SGLang Model Gateway, Rust)
    .bench/venvs/vllm-router/      `vllm-router` (Rust fork of the same gateway)
    .bench/tokenizer-bpe/          a byte-level BPE trained locally (inference-perf offline)
    .bench/code/<commit>/          a commit's `src/`, which the pods and the EPP import
    .bench/logs/, .bench/results/  process logs and every request of every run

This module only reads that layout. `tools/bench/install_peers.py` installs the tools
(writing `STAMP` into each venv it finished) and `tools/bench/freeze_code.py` extracts
commits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Written into a venv once its tool is installed and runs; holds the requirement list.
STAMP = ".epp-bench-stamp"


@dataclass(frozen=True, slots=True)
class BenchDir:
    """Paths under one `.bench/` directory, and whether a tool there is ready."""

    root: Path

    def venv(self, tool: str) -> Path:
        return self.root / "venvs" / tool

    def bin(self, tool: str, executable: str) -> Path:
        return self.venv(tool) / "bin" / executable

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer-bpe"

    @property
    def code_root(self) -> Path:
        return self.root / "code"

    def installed(self, tool: str) -> bool:
        return (self.venv(tool) / STAMP).is_file()

    def tokenizer_ready(self) -> bool:
        return (self.tokenizer_dir / "tokenizer.json").is_file() and (
            self.tokenizer_dir / "tokenizer_config.json"
        ).is_file()


def repo_root() -> Path | None:
    """The clone this package runs from (an editable install), or None."""
    repo = Path(__file__).resolve().parents[3]
    return repo if (repo / "pyproject.toml").is_file() else None


def default_bench_dir() -> Path:
    """`$EPP_BENCH_DIR`, else `.bench/` at the repository root (editable install), else cwd."""
    override = os.environ.get("EPP_BENCH_DIR")
    if override:
        return Path(override)
    repo = repo_root()
    return (repo if repo is not None else Path.cwd()) / ".bench"
