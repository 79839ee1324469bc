"""Regenerate the container image's locks (`make image-lock`):

- requirements/image.lock: the router's runtime dependencies, pyproject.toml
  [project].dependencies (no extra), resolved to exact versions with every file's sha256;
- requirements/image-build.lock: [build-system].requires, which the builder stage needs to
  build the project's wheel without reaching for unpinned packages.

Both are resolved by `uv pip compile` for the Dockerfile's own Python (the version in its
FROM lines) on Linux, and hold the hashes of every file of each pinned release (all
architectures), so `pip install --require-hashes` works on amd64 and arm64 alike.

    .venv/bin/python tools/image_lock.py [--uv PATH] [--upgrade]

Run it after changing a dependency in pyproject.toml or the base image's Python version;
tests/deploy/test_dockerfile.py fails while the lock and pyproject.toml disagree. Pins
already in a lock are kept while they still fit; --upgrade takes the newest releases.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
DOCKERFILE = ROOT / "Dockerfile"
RUNTIME_LOCK = ROOT / "requirements" / "image.lock"
BUILD_LOCK = ROOT / "requirements" / "image-build.lock"
COMPILE_COMMAND = "make image-lock"
FROM_PYTHON = re.compile(r"^FROM\s+(?:\S+/)?python:(\d+\.\d+\.\d+)-\S+", re.MULTILINE)


def image_python_version(dockerfile: Path = DOCKERFILE) -> str:
    """The exact Python release of the image: every FROM names the same one."""
    versions = set(FROM_PYTHON.findall(dockerfile.read_text()))
    if len(versions) != 1:
        raise SystemExit(
            f"{dockerfile}: expected one python:X.Y.Z base, found {versions or 'none'}"
        )
    return versions.pop()


def compile_lock(
    uv: str,
    requirements: list[str],
    out: Path,
    python_version: str,
    source_name: str,
    upgrade: bool,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # A relative name that says where the requirements come from: the lock's "# via"
        # lines show it (never a temporary path).
        source = Path(tmp) / source_name
        source.write_text("".join(f"{r}\n" for r in requirements))
        command = [
            uv, "pip", "compile", source.name,
            "--no-config",  # no uv.toml of this machine changes the result
            "--generate-hashes",
            "--python-version", python_version,
            "--python-platform", "linux",
            "--custom-compile-command", COMPILE_COMMAND,
            "--quiet",
            "--output-file", str(out),
            *(["--upgrade"] if upgrade else []),
        ]  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(command, cwd=tmp, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uv", default=shutil.which("uv"), help="the uv executable")
    parser.add_argument("--upgrade", action="store_true", help="newest releases, not the pins")
    args = parser.parse_args()
    if not args.uv:
        sys.exit("uv not found: pip install uv (make image-lock installs a pinned one)")
    uv = str(Path(args.uv).resolve())  # uv runs in a temporary directory
    project = tomllib.loads(PYPROJECT.read_text())
    python_version = image_python_version()
    compile_lock(
        uv,
        project["project"]["dependencies"],
        RUNTIME_LOCK,
        python_version,
        "pyproject.toml-project.dependencies",
        args.upgrade,
    )
    compile_lock(
        uv,
        project["build-system"]["requires"],
        BUILD_LOCK,
        python_version,
        "pyproject.toml-build-system.requires",
        args.upgrade,
    )
    print(f"wrote {RUNTIME_LOCK.relative_to(ROOT)} and {BUILD_LOCK.relative_to(ROOT)} "
          f"for Python {python_version} on Linux")  # fmt: skip


if __name__ == "__main__":
    main()
