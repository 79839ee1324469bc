"""Save the advisories of our dependencies (requirements/advisories.json) from a clone of
PyPA's advisory database (github.com/pypa/advisory-database, OSV records in YAML under
vulns/<package>/), for the audit to use when PyPI's vulnerability data cannot be reached.

    .venv/bin/python -m tools.dependency_audit.snapshot --git-dir PATH/advisory-database/.git

The database is published under CC-BY 4.0; the saved file names its source and commit.
Kept: every advisory of every package named in requirements/*.lock or installed in this
environment, whatever its versions (so a later downgrade is still caught). Refresh it when
the locks change or the snapshot grows old: the audit prints its date.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import yaml
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted((ROOT / "requirements").glob("*.lock"))
OUT = ROOT / "requirements" / "advisories.json"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", re.MULTILINE)


def our_packages() -> set[str]:
    names = {canonicalize_name(m) for lock in LOCKS for m in PIN.findall(lock.read_text())}
    names |= {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    return names


def rfc3339(value: object) -> str:
    """YAML's timestamps as OSV's JSON writes them (pip-audit parses exactly this form)."""
    if isinstance(value, datetime):
        utc = value.astimezone(UTC) if value.tzinfo else value
        fraction = f".{utc.microsecond:06d}" if utc.microsecond else ""
        return utc.strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"
    return str(value)


def git(git_dir: Path, *args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", *args], capture_output=True, text=True, check=True
    ).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--git-dir", type=Path, required=True)
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    wanted = our_packages()
    commit, taken = git(args.git_dir, "log", "-1", "--format=%H %cI", args.rev).split()
    packages: dict[str, list[dict]] = {}
    for path in git(args.git_dir, "ls-tree", "-r", "--name-only", args.rev, "vulns/").split():
        parts = path.split("/")
        if len(parts) != 3 or canonicalize_name(parts[1]) not in wanted:
            continue
        record = yaml.safe_load(git(args.git_dir, "show", f"{args.rev}:{path}"))
        record = json.loads(json.dumps(record, default=rfc3339))
        packages.setdefault(canonicalize_name(parts[1]), []).append(record)
    data = {
        "source": f"pypa/advisory-database@{commit}",
        "taken": taken,
        "packages": dict(sorted(packages.items())),
    }
    args.out.write_text(json.dumps(data, indent=None, sort_keys=True) + "\n")
    count = sum(len(v) for v in packages.values())
    print(f"{args.out}: {count} advisories of {len(packages)} packages ({data['source']}, {taken})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
