"""Which code the stack's processes run: a frozen commit, or the work tree as it is.

By default the pods and the EPP run the committed code of HEAD (or of a commit named with
`--code`), extracted once by `tools/bench/freeze_code.py` under `.bench/code/<commit>/` and
put first on PYTHONPATH for the children (`python -m epp ...` then imports it instead of
the editable install). The result names that commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FREEZE_TOOL = Path("tools") / "bench" / "freeze_code.py"


@dataclass(frozen=True, slots=True)
class CodeInUse:
    choice: str  # "worktree", "head" or the revision asked for
    commit: str
    path: str  # the directory holding the `epp` package the children import


def _head(repo: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git rev-parse HEAD in {repo}: {done.stderr.strip()}")
    return done.stdout.strip()


def freeze(repo: Path, root: Path, revision: str) -> tuple[str, Path]:
    """Run the repository's freeze tool; returns (commit, directory of its `src/`)."""
    tool = repo / FREEZE_TOOL
    if not tool.is_file():
        raise RuntimeError(f"{tool} not found: freezing needs a clone (or use --code worktree)")
    done = subprocess.run(
        [sys.executable, str(tool), revision, "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{FREEZE_TOOL} {revision}: {done.stderr.strip()}")
    answer = json.loads(done.stdout)
    return answer["commit"], Path(answer["path"])


def choose_code(choice: str, repo: Path, root: Path) -> CodeInUse:
    """The code for "worktree" (the repository's `src/` as it is), "head", or any revision git
    knows (a commit, a tag), frozen under `root`; raises RuntimeError if git or the freeze
    tool fails."""
    if choice == "worktree":
        return CodeInUse("worktree", _head(repo), str(repo / "src"))
    commit, path = freeze(repo, root, "HEAD" if choice == "head" else choice)
    return CodeInUse(choice, commit, str(path))


@contextlib.contextmanager
def children_import(code: CodeInUse) -> Iterator[None]:
    """Within the block, child processes import `epp` (and the simulator) from `code`."""
    if code.choice == "worktree":
        yield
        return
    with children_import_from(code.path):
        yield


@contextlib.contextmanager
def children_import_from(path: str) -> Iterator[None]:
    """Within the block, child processes import from `path` first: they inherit
    os.environ (LocalStack copies it at each spawn)."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path + (os.pathsep + previous if previous else "")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
