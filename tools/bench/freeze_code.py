"""Freeze a commit's code for a live benchmark campaign: `git archive` of its `src/`.

A commit's compiled kernels (`epp/*/_kernels.c`) are built in place with the running
interpreter's compiler settings and the flags setup.py gives them, so that a before column
runs the commit as `pip install` would have built it, not its pure-Python twins. Without a C
compiler they are left unbuilt, and the line printed says so.

A campaign takes half an hour, and the work tree may change meanwhile (the simulator, the
EPP): repeats made with different code are not repeats. So the pods and the EPP run the
committed code of one commit, extracted once under `.bench/code/<commit>/` (the router,
simulator and harness packages). `epp bench live --code head` (its default) runs this
script and puts the directory first on the children's PYTHONPATH
(`epp_bench.live.frozen_code`).

    .venv/bin/python tools/bench/freeze_code.py [REVISION] [--root DIR]

prints `{"commit": "<40 hex>", "path": "<dir>"}`; REVISION defaults to HEAD.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from epp_bench.live.bench_dir import BenchDir, default_bench_dir

REPO = Path(__file__).resolve().parents[2]


def _git(repo: Path, *args: str) -> bytes:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.decode(errors='replace')}")
    return done.stdout


def snapshot_commit(repo: Path, root: Path, revision: str = "HEAD") -> tuple[str, Path]:
    """Extract a commit's `src/` into `root/<commit>/` (once); returns (commit, dir)."""
    commit = _git(repo, "rev-parse", "--verify", f"{revision}^{{commit}}").decode().strip()
    target = root / commit
    if not (target / "epp" / "__init__.py").is_file():
        archive = _git(repo, "archive", "--format=tar", commit, "src")
        staging = root / f".{commit}.partial"
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(staging, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        (staging / "src").rename(target)
        staging.rmdir()
    build_kernels(target)
    return commit, target


KERNEL_FLAGS = ["-O3", "-ffp-contract=off"]  # setup.py's


def build_kernels(code: Path) -> list[str]:
    """Build the extracted code's compiled kernels in place (once); the modules that are
    built. A build that fails (no compiler) leaves that module to its twin."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    built = []
    for source in sorted(code.glob("epp/*/_kernels.c")):
        module = f"epp.{source.parent.name}._kernels"
        if source.with_name(f"_kernels{suffix}").is_file():
            built.append(module)
            continue
        extension = Extension(module, [str(source)], extra_compile_args=KERNEL_FLAGS)
        distribution = Distribution({"ext_modules": [extension], "package_dir": {"": str(code)}})
        command = build_ext(distribution)
        with tempfile.TemporaryDirectory() as temp:
            command.build_temp = temp
            command.inplace = True
            command.ensure_finalized()
            try:
                command.run()
            except Exception as exc:  # the compiler's own errors, of any kind
                print(f"{module}: not built ({exc}); the twin runs", file=sys.stderr)
                continue
        built.append(module)
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/bench/freeze_code.py",
        description="Extract a commit's src/ under .bench/code/<commit>/ for `epp bench live`.",
    )
    parser.add_argument("revision", nargs="?", default="HEAD", help="a commit, tag or branch")
    parser.add_argument("--root", type=Path, default=None, help="default: <repo>/.bench/code")
    args = parser.parse_args(argv)
    root = args.root or BenchDir(default_bench_dir()).code_root
    try:
        commit, path = snapshot_commit(REPO, root, args.revision)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps({"commit": commit, "path": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
