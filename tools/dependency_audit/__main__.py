"""`make audit`: pip-audit over the image's locks and the dev environment.

    .venv/bin/python -m tools.dependency_audit [--require-live] [--advisories PATH]

Each target is audited against PyPI's vulnerability data first. Where that cannot be
reached (pip-audit fails to connect, or answers that no dependency could be audited, which
is what a package index without PyPI's JSON API gives), the same pip-audit audits it again
against the saved advisories (requirements/advisories.json, served on loopback as an OSV
endpoint) and a loud warning says the live data was not consulted and how old the saved
one is.

Exit status: 1 when a vulnerability is found (by either source); 2 when the live data could
not be reached and --require-live (or AUDIT_REQUIRE_LIVE=1) is given; 0 otherwise. A
network hiccup does not fail CI by default: the audit runs on every CI run, so a
vulnerability missed during an outage is found at the next one, while failing would block
unrelated work on someone else's outage; a found vulnerability is a fact about our pins and
always fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tools.dependency_audit.osv_feed import Advisories, serve

ROOT = Path(__file__).resolve().parents[2]
ADVISORIES = ROOT / "requirements" / "advisories.json"
TARGETS: dict[str, list[str]] = {
    # Hashed locks: pip-audit reads the pins without installing anything (--disable-pip).
    "requirements/image.lock": ["-r", "requirements/image.lock", "--disable-pip"],
    "requirements/image-build.lock": ["-r", "requirements/image-build.lock", "--disable-pip"],
    # The environment pip-audit runs in (.venv): dev, test and bench tools. The project itself
    # is installed editable and is not on PyPI under its name: skipped.
    "dev environment (.venv)": ["--skip-editable"],
}
NOT_AUDITED = "could not be audited"
# What the image ships: a finding here fails `make audit` (and CI). The dev environment's
# versions float (no lock: whatever PyPI has when the venv is built), so an advisory
# published against a test or bench tool is reported loudly but does not block CI.
SHIPPED = frozenset({"requirements/image.lock", "requirements/image-build.lock"})


@dataclass
class Outcome:
    target: str
    source: str
    vulns: list[str] = field(default_factory=list)  # "name version: ids (fix: ...)"
    audited: int = 0
    skipped: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def reached(self) -> bool:
        return self.error is None and self.audited > 0


def pip_audit(args: list[str], extra: list[str]) -> tuple[dict | None, str]:
    """Run pip-audit with JSON output; (report or None, stderr tail)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip_audit",
                *args,
                *extra,
                "--format",
                "json",
                "--output",
                str(out),
                "--progress-spinner",
                "off",
                "--timeout",
                "20",
                "--cache-dir",
                str(Path(tmp) / "cache"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        report = json.loads(out.read_text()) if out.exists() and out.stat().st_size else None
    return report, "\n".join((run.stderr or run.stdout).strip().splitlines()[-3:])


def audit(target: str, args: list[str], source: str, extra: list[str]) -> Outcome:
    report, stderr = pip_audit(args, extra)
    outcome = Outcome(target, source)
    if report is None:
        outcome.error = stderr or "pip-audit wrote no report"
        return outcome
    for dep in report.get("dependencies", []):
        reason = dep.get("skip_reason")
        if reason:
            outcome.skipped.append(f"{dep['name']}: {reason}")
            continue
        outcome.audited += 1
        for vuln in dep.get("vulns", []):
            ids = ", ".join([vuln["id"], *vuln.get("aliases", [])])
            fixes = ", ".join(vuln.get("fix_versions", [])) or "none yet"
            outcome.vulns.append(f"{dep['name']} {dep['version']}: {ids} (fixed in {fixes})")
    if outcome.audited == 0 and any(NOT_AUDITED in s for s in outcome.skipped):
        outcome.error = "no dependency could be audited: " + outcome.skipped[0]
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make audit", description=__doc__)
    parser.add_argument("--advisories", type=Path, default=ADVISORIES)
    parser.add_argument(
        "--require-live",
        action="store_true",
        default=os.environ.get("AUDIT_REQUIRE_LIVE") == "1",
        help="exit 2 when PyPI's vulnerability data cannot be reached",
    )
    parser.add_argument(
        "--live-service", default="pypi", help="pip-audit's service to try first (pypi, osv)"
    )
    args = parser.parse_args(argv)
    saved = Advisories.load(args.advisories)
    outcomes: list[Outcome] = []
    unreachable: list[Outcome] = []
    with serve(saved) as feed:
        for target, target_args in TARGETS.items():
            live = audit(target, target_args, args.live_service, ["-s", args.live_service])
            if live.reached:
                outcomes.append(live)
                continue
            unreachable.append(live)
            offline = f"saved advisories ({saved.source}, {saved.taken[:10]})"
            outcomes.append(audit(target, target_args, offline, ["-s", "osv", "--osv-url", feed]))
    found = False
    for o in outcomes:
        state = "ERROR" if o.error else f"{len(o.vulns)} vulnerable"
        print(f"audit: {o.target}: {o.audited} packages against {o.source}: {state}")
        for v in o.vulns:
            print(f"audit:   VULNERABLE {v}")
        for s in o.skipped:
            if NOT_AUDITED in s:
                print(f"audit:   not audited: {s}")
        if o.target in SHIPPED:
            found |= bool(o.vulns)
        elif o.vulns:
            print(f"audit:   (warning only: {o.target} is not shipped; upgrade the tool)")
        if o.error:
            print(f"audit:   {o.error}")
    if unreachable:
        bar = "!" * 78
        print(
            f"\n{bar}\nWARNING: PyPI's vulnerability data could not be reached for", file=sys.stderr
        )
        for o in unreachable:
            print(f"  {o.target}: {o.error}", file=sys.stderr)
        print(
            f"These were audited against the saved advisories only, taken {saved.taken[:10]}:\n"
            "anything published since is not checked. Refresh requirements/advisories.json\n"
            "(tools/dependency_audit/snapshot.py) or run `make audit` where PyPI's JSON API\n"
            f"answers.\n{bar}",
            file=sys.stderr,
        )
    if found:
        print(
            "audit: FAILED: known vulnerabilities in pinned dependencies (bump them:"
            " `make image-lock ARGS=--upgrade` for the image)",
            file=sys.stderr,
        )
        return 1
    if any(o.error for o in outcomes if o.target in SHIPPED):
        print("audit: FAILED: pip-audit could not audit a target at all", file=sys.stderr)
        return 1
    if unreachable and args.require_live:
        return 2
    print("audit: no known vulnerabilities")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
