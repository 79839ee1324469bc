"""Install the extra tools of the live benchmark (`epp bench live`) under `.bench/`,
idempotently.

The tools of the field do not fit in the project's own virtualenv: `inference-perf` needs
Python >= 3.12 and pulls ~800 MB (transformers, torch-free but heavy), and the two peer
routers ship large Rust binaries with their own web stacks. Each one gets its own venv:

    .bench/venvs/inference-perf/   Python 3.12, `inference-perf`
    .bench/venvs/sglang-router/    `sglang-router` (SGLang Model Gateway, Rust)
    .bench/venvs/vllm-router/      `vllm-router` (Rust fork of the same gateway)
    .bench/tokenizer-bpe/          a byte-level BPE trained locally, so that inference-perf
                                   runs offline (HF_HUB_OFFLINE=1)

A venv is reinstalled only when its requirement list changed (a stamp file records it), so
running this again costs a second. A tool that cannot be installed is reported with the
error and left out; the live benchmark then skips the routers or client that need it.

    .venv/bin/python tools/bench/install_peers.py [--bench-dir DIR] [--only NAME,...] [--json]

The layout under `.bench/` is `epp_bench.live.bench_dir.BenchDir`, which the live benchmark
reads at run time; this script is the only writer.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from epp_bench.live.bench_dir import STAMP, BenchDir, default_bench_dir

_ERROR_TAIL_LINES = 15
_INSTALL_TIMEOUT_S = 1800.0
_TOKENIZER_VOCAB = 4096


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One venv: its Python, what pip installs into it, and the command that proves it runs."""

    name: str
    python_minor: tuple[int, int] | None  # None: the interpreter running this module
    requirements: tuple[str, ...]
    check_argv: tuple[str, ...]  # first item is a name in the venv's bin/


TOOLS: dict[str, ToolSpec] = {
    "inference-perf": ToolSpec(
        name="inference-perf",
        python_minor=(3, 12),
        requirements=("inference-perf==0.7.0",),
        check_argv=("inference-perf", "--help"),
    ),
    "sglang-router": ToolSpec(
        name="sglang-router",
        python_minor=None,
        requirements=("sglang-router==0.3.2",),
        check_argv=("python", "-m", "sglang_router.launch_router", "--help"),
    ),
    "vllm-router": ToolSpec(
        name="vllm-router",
        python_minor=None,
        requirements=("vllm-router==0.1.17",),
        check_argv=("vllm-router", "--help"),
    ),
}


@dataclass(slots=True)
class InstallReport:
    name: str
    ok: bool
    path: str
    seconds: float
    size_mb: float
    cached: bool  # already installed with the same requirements: nothing was done
    error: str | None = None


def dir_size_mb(path: Path) -> float:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for filename in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, filename)).st_size
            except OSError:
                continue
    return total / 1e6


def _python_version(executable: str) -> tuple[int, int] | None:
    try:
        done = subprocess.run(
            [executable, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = done.stdout.split()
    if done.returncode != 0 or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def find_python(minor: tuple[int, int]) -> str | None:
    """An interpreter of exactly that version: on PATH, or in pyenv's versions directory.

    pyenv's shim for `python3.12` exists on PATH but fails unless 3.12 is the selected
    version, so every candidate is run once to check it really is that Python.
    """
    name = f"python{minor[0]}.{minor[1]}"
    candidates: list[str] = []
    if found := shutil.which(name):
        candidates.append(found)
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(
        glob.glob(os.path.join(pyenv_root, "versions", f"{minor[0]}.{minor[1]}*", "bin", name)),
        reverse=True,
    )
    for candidate in candidates:
        if _python_version(candidate) == minor:
            return candidate
    return None


def _tail(text: str) -> str:
    return "\n".join(text.strip().splitlines()[-_ERROR_TAIL_LINES:])


def _run(argv: list[str], timeout_s: float = _INSTALL_TIMEOUT_S) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` exited {done.returncode}:\n{_tail(done.stdout + done.stderr)}"
        )


def install_tool(bench: BenchDir, spec: ToolSpec) -> InstallReport:
    """Create the tool's venv and pip-install it, unless the stamp says it is there."""
    venv = bench.venv(spec.name)
    stamp = venv / STAMP
    wanted = json.dumps(list(spec.requirements))
    started = time.monotonic()
    if stamp.is_file() and stamp.read_text() == wanted:
        return InstallReport(spec.name, True, str(venv), 0.0, dir_size_mb(venv), cached=True)
    try:
        if spec.python_minor is None:
            python = sys.executable
        else:
            found = find_python(spec.python_minor)
            if found is None:
                raise RuntimeError(
                    f"no Python {spec.python_minor[0]}.{spec.python_minor[1]} interpreter "
                    "on PATH or under $PYENV_ROOT/versions"
                )
            python = found
        if venv.exists():
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([python, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        _run([*pip, *spec.requirements])
        check = [str(venv / "bin" / spec.check_argv[0]), *spec.check_argv[1:]]
        _run(check, timeout_s=120)
        stamp.write_text(wanted)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return InstallReport(
            spec.name,
            False,
            str(venv),
            time.monotonic() - started,
            dir_size_mb(venv) if venv.exists() else 0.0,
            cached=False,
            error=str(exc),
        )
    return InstallReport(
        spec.name, True, str(venv), time.monotonic() - started, dir_size_mb(venv), cached=False
    )


# Run inside the inference-perf venv, which has `tokenizers` and `transformers`. The corpus
# is pseudo-words like the workloads' prompts, so the BPE merges look like real text ones.
_TRAIN_TOKENIZER = r"""
import json, random, sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = Path(sys.argv[1]); vocab = int(sys.argv[2])
rng = random.Random(0)
onsets = "b c d f g h k l m n p r s t v w z".split()
nuclei = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
codas = ["", "", "n", "r", "s", "t", "l", "m"]
words = ["".join(rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas)
                 for _ in range(rng.randint(1, 3))) for _ in range(3000)]
lines = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))).capitalize() + "."
         for _ in range(20000)]
tokenizer = Tokenizer(models.BPE(unk_token=None))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tokenizer.train_from_iterator(lines, trainer)
out.mkdir(parents=True, exist_ok=True)
tokenizer.save(str(out / "tokenizer.json"))
template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1000000,
    "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": template,
}, indent=1))
from transformers import AutoTokenizer
loaded = AutoTokenizer.from_pretrained(str(out))
assert loaded.decode(loaded.encode("hello tokenizer")) == "hello tokenizer"
print(len(loaded))
"""


def install_tokenizer(bench: BenchDir) -> InstallReport:
    """Train the local tokenizer with the inference-perf venv's Python (it has `tokenizers`)."""
    started = time.monotonic()
    target = bench.tokenizer_dir
    if bench.tokenizer_ready():
        return InstallReport("tokenizer", True, str(target), 0.0, dir_size_mb(target), True)
    python = bench.bin("inference-perf", "python")
    try:
        if not bench.installed("inference-perf"):
            raise RuntimeError("needs the inference-perf venv (it brings `tokenizers`)")
        run_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        done = subprocess.run(
            [str(python), "-c", _TRAIN_TOKENIZER, str(target), str(_TOKENIZER_VOCAB)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env=run_env,
        )
        if done.returncode != 0:
            raise RuntimeError(f"training exited {done.returncode}:\n{_tail(done.stderr)}")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(target, ignore_errors=True)
        return InstallReport(
            "tokenizer", False, str(target), time.monotonic() - started, 0.0, False, str(exc)
        )
    return InstallReport(
        "tokenizer", True, str(target), time.monotonic() - started, dir_size_mb(target), False
    )


def ensure(bench: BenchDir, only: set[str] | None = None) -> list[InstallReport]:
    """Install every tool (or those in `only`; "tokenizer" is one of the names)."""
    reports = [
        install_tool(bench, spec) for name, spec in TOOLS.items() if only is None or name in only
    ]
    if only is None or "tokenizer" in only:
        reports.append(install_tokenizer(bench))
    return reports


def format_reports(reports: list[InstallReport]) -> str:
    lines = [f"{'tool':<16} {'status':<10} {'time':>8} {'size':>9}  path"]
    for r in reports:
        status = "cached" if r.cached else ("installed" if r.ok else "FAILED")
        lines.append(f"{r.name:<16} {status:<10} {r.seconds:>7.1f}s {r.size_mb:>7.1f}MB  {r.path}")
        if r.error:
            lines.extend(f"    {line}" for line in r.error.splitlines())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/bench/install_peers.py",
        description="Install inference-perf, sglang-router, vllm-router and a local "
        "tokenizer under .bench/ for `epp bench live` (idempotent).",
    )
    parser.add_argument("--bench-dir", type=Path, default=None, help="default: <repo>/.bench")
    parser.add_argument(
        "--only", default="", help=f"comma-separated subset of {[*TOOLS, 'tokenizer']}"
    )
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    args = parser.parse_args(argv)
    only = {n.strip() for n in args.only.split(",") if n.strip()} or None
    unknown = (only or set()) - {*TOOLS, "tokenizer"}
    if unknown:
        parser.error(f"unknown tools: {sorted(unknown)}")
    bench = BenchDir(args.bench_dir or default_bench_dir())
    reports = ensure(bench, only)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    else:
        print(format_reports(reports))
    # Missing tools are not fatal: the live benchmark runs without them and says so.
    return 0


if __name__ == "__main__":
    sys.exit(main())
