"""Which code the stack's processes run: a frozen snapshot of a commit, or the work tree.

A campaign takes half an hour, and the work tree may change meanwhile (the simulator, the
EPP): repeats made with different code are not repeats. By default the pods and the EPP
therefore run the committed code of HEAD (or of a commit named with `--code`), extracted
once with `git archive` under
`.bench/code/<commit>/` and put first on PYTHONPATH for the children (`python -m epp ...`
then imports it instead of the editable install). The result names that commit.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CodeInUse:
    choice: str  # "worktree", "head" or the revision asked for
    commit: str
    path: str  # the directory holding the `epp` package the children import


def _git(repo: Path, *args: str) -> bytes:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.decode(errors='replace')}")
    return done.stdout


def snapshot_commit(repo: Path, root: Path, revision: str = "HEAD") -> tuple[str, Path]:
    """Extract a commit's `src/` (the router, simulator and harness packages) into
    `root/<commit>/` (once); returns (commit, dir)."""
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
    return commit, target


@contextlib.contextmanager
def code_for_children(choice: str, repo: Path, root: Path) -> Iterator[CodeInUse]:
    """Within the block, child processes import `epp` from the chosen code: "worktree",
    "head", or any revision git knows (a commit, a tag)."""
    if choice == "worktree":
        commit = _git(repo, "rev-parse", "HEAD").decode().strip()
        yield CodeInUse("worktree", commit, str(repo / "src"))
        return
    commit, path = snapshot_commit(repo, root, "HEAD" if choice == "head" else choice)
    previous = os.environ.get("PYTHONPATH")
    # The children inherit os.environ (LocalStack copies it at each spawn).
    os.environ["PYTHONPATH"] = str(path) + (os.pathsep + previous if previous else "")
    try:
        yield CodeInUse(choice, commit, str(path))
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
