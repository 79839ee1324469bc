"""Shared by the atheris harnesses (tools/fuzz/<target>.py): seeds, corpus and run.

Each harness calls `run(name, test_one_input, seeds)`: the seeds (valid inputs that get
libFuzzer past the first checks) are written to `.fuzz/<name>/corpus`, which libFuzzer
grows across runs; crashes are written to `.fuzz/<name>/crash-*`. Extra arguments go to
libFuzzer (`-max_total_time=60`, `-runs=100000`, ...). `make fuzz-atheris` runs them all.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
# tests/ holds the ext_proc message builders the machine's harness feeds.
sys.path.insert(0, str(ROOT / "tests"))


def run(name: str, test_one_input: Callable[[bytes], None], seeds: Iterable[bytes]) -> None:
    work = ROOT / ".fuzz" / name
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        (corpus / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
    args = [sys.argv[0], f"-artifact_prefix={work}/", *sys.argv[1:], str(corpus)]
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()
