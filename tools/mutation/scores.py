"""Mutation score per module from a finished `mutmut run` (`make mutate` prints it).

Reads mutmut's per-file results under `mutants/` and the triage in
`tools/mutation/equivalent/*.toml` (mutants that cannot change behaviour, each with its
reason). Score = killed / (mutants - equivalent), where killed counts mutants a test
failed on, that timed out, or that the type checker caught; survivors and mutants no test
reaches count against the score. Exit status 1 when a module is under the goal or the
triage names a mutant that no longer exists (the code changed under it: re-triage).

    .venv/bin/python tools/mutation/scores.py [--goal 0.85] [--survivors]
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "mutants"
TRIAGE = Path(__file__).with_name("equivalent")  # one TOML file per area

# The areas of the goal (>= 85% killed in each); a file belongs to the first match.
AREAS = (
    ("admission", "src/epp/scheduling/admission.py"),
    ("scheduling", "src/epp/scheduling/"),
    ("KV-event decoding", "src/epp/prefix/kv_events/"),
    ("prefix", "src/epp/prefix/"),
    ("request parsing", "src/epp/request"),
    ("ext_proc machine", "src/epp/extproc/machine.py"),
    ("metrics parser", "src/epp/datalayer/metrics_parser.py"),
)

KILLED = {1, 3, 36, 37, -24, 24, 152, 255, -11, -9}
SURVIVED = {0}
NO_TESTS = {5, 33}


def load_results() -> dict[str, dict[str, int | None]]:
    """module path (src/epp/...) -> mutant name -> mutmut exit code."""
    results: dict[str, dict[str, int | None]] = {}
    for meta in sorted(MUTANTS.glob("src/**/*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if codes:
            module = str(meta.relative_to(MUTANTS))[: -len(".meta")]
            results[module] = codes
    return results


def load_equivalent() -> dict[str, str]:
    """mutant name -> why it cannot change behaviour, from every file under TRIAGE."""
    reasons: dict[str, str] = {}
    for path in sorted(TRIAGE.glob("*.toml")):
        with path.open("rb") as handle:
            table = tomllib.load(handle)
        for name, entry in table.get("equivalent", {}).items():
            if not str(entry.get("reason", "")).strip():
                raise SystemExit(f"{path}: {name} has no reason")
            reasons[name] = entry["reason"]
    return reasons


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--goal", type=float, default=0.85)
    parser.add_argument("--survivors", action="store_true", help="list untriaged survivors")
    args = parser.parse_args()
    results = load_results()
    if not results:
        print("no results under mutants/: run `make mutate` first", file=sys.stderr)
        return 1
    equivalent = load_equivalent()
    known = {name for codes in results.values() for name in codes}
    stale = sorted(set(equivalent) - known)
    by_area: dict[str, dict[str, int | None]] = defaultdict(dict)
    for module, codes in results.items():
        area = next((name for name, prefix in AREAS if module.startswith(prefix)), module)
        by_area[area].update(codes)
    print("By area (the goal applies here):\n")
    below = _table(by_area, equivalent, args.goal, [])
    print("\nBy file:\n")
    survivors: list[str] = []
    _table(results, equivalent, args.goal, survivors)
    if args.survivors:
        print("\n".join(["", "not killed and not triaged:", *survivors]))
    for name in stale:
        print(f"triage names a mutant that no longer exists: {name}", file=sys.stderr)
    if below:
        print(f"under the goal of {args.goal:.0%}: {', '.join(below)}", file=sys.stderr)
    return 1 if below or stale else 0


def _table(
    groups: dict[str, dict[str, int | None]],
    equivalent: dict[str, str],
    goal: float,
    survivors: list[str],
) -> list[str]:
    """Print one markdown table; return the groups under the goal."""
    rows = []
    counts: dict[str, int] = defaultdict(int)
    below = []
    for module, codes in groups.items():
        n = len(codes)
        killed = sum(code in KILLED for code in codes.values())
        eq = sum(name in equivalent and codes[name] not in KILLED for name in codes)
        lost = [
            name for name, code in codes.items() if code not in KILLED and name not in equivalent
        ]
        unchecked = sum(code is None for code in codes.values())
        score = killed / (n - eq) if n > eq else 1.0
        rows.append((module, n, killed, eq, len(lost), unchecked, score))
        survivors += [f"{name} ({_status(codes[name])})" for name in lost]
        for key, value in (("n", n), ("killed", killed), ("eq", eq), ("lost", len(lost))):
            counts[key] += value
        if score < goal:
            below.append(module)
    print("| module | mutants | killed | equivalent | not killed | score |")
    print("|---|---:|---:|---:|---:|---:|")
    for module, n, killed, eq, lost, unchecked, score in rows:
        note = f" ({unchecked} not run)" if unchecked else ""
        label = f"`{module}`" if module.startswith("src/") else module
        print(f"| {label} | {n} | {killed} | {eq} | {lost}{note} | {score:.1%} |")
    total = counts["killed"] / (counts["n"] - counts["eq"])
    print(
        f"| all | {counts['n']} | {counts['killed']} | {counts['eq']} | {counts['lost']} "
        f"| {total:.1%} |"
    )
    return below


def _status(code: int | None) -> str:
    if code in SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return "not run" if code is None else f"exit {code}"


if __name__ == "__main__":
    sys.exit(main())
