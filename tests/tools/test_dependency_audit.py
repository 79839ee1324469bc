"""tools/dependency_audit (`make audit`): the real pip-audit over a lock, against the saved
advisories served as an OSV endpoint on loopback (PyPI's vulnerability data is not
reachable from this machine nor from CI's; with it reachable, the live answer is the same).

A pin with a known vulnerability fails the audit; a clean pin passes; the OSV range rules
match the schema.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.dependency_audit import __main__ as audit_main  # noqa: E402
from tools.dependency_audit.osv_feed import Advisories, affects, in_range, serve  # noqa: E402

pytest.importorskip("pip_audit", reason="pip-audit is in the [dev] extra: `make setup`")


def test_osv_ranges_follow_the_schema():
    events = [{"introduced": "0"}, {"fixed": "3.7.4"}]
    assert in_range(Version("3.7.3"), events)
    assert not in_range(Version("3.7.4"), events)
    reopened = [{"introduced": "1.0"}, {"fixed": "1.2"}, {"introduced": "2.0"}]
    assert not in_range(Version("0.9"), reopened)
    assert in_range(Version("1.1"), reopened)
    assert not in_range(Version("1.5"), reopened)
    assert in_range(Version("9.0"), reopened)  # open-ended
    last = [{"introduced": "0"}, {"last_affected": "2.1"}]
    assert in_range(Version("2.1"), last)
    assert not in_range(Version("2.1.1"), last)
    listed = {"affected": [{"package": {"name": "Foo", "ecosystem": "PyPI"}, "versions": ["1.3"]}]}
    assert affects(listed, "foo", Version("1.3"))
    assert not affects(listed, "foo", Version("1.4"))


def test_the_saved_advisories_know_an_old_aiohttp_and_not_the_locked_one():
    saved = Advisories.load(audit_main.ADVISORIES)
    assert {a["id"] for a in saved.query("aiohttp", "3.7.3")} >= {"PYSEC-2021-76"}
    locked = next(
        line.split("==")[1].split()[0]
        for line in (ROOT / "requirements" / "image.lock").read_text().splitlines()
        if line.startswith("aiohttp==")
    )
    assert saved.query("aiohttp", locked) == []


def _run_audit(
    tmp_path: Path, monkeypatch, pin: str, capsys, shipped: bool = True
) -> tuple[int, str]:
    lock = tmp_path / "image.lock"
    lock.write_text(pin + "\n")
    # --no-deps: the pin alone, nothing resolved or downloaded.
    monkeypatch.setattr(
        audit_main, "TARGETS", {"test lock": ["-r", str(lock), "--no-deps", "--disable-pip"]}
    )
    monkeypatch.setattr(audit_main, "SHIPPED", frozenset({"test lock"} if shipped else ()))
    code = audit_main.main(["--live-service", "osv"])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_pin_with_a_known_vulnerability_fails_the_audit(tmp_path, monkeypatch, capsys):
    code, output = _run_audit(tmp_path, monkeypatch, "aiohttp==3.7.3", capsys)
    assert code == 1, output
    assert "VULNERABLE aiohttp 3.7.3" in output and "PYSEC-2021-76" in output


def test_a_vulnerable_tool_that_is_not_shipped_only_warns(tmp_path, monkeypatch, capsys):
    code, output = _run_audit(tmp_path, monkeypatch, "aiohttp==3.7.3", capsys, shipped=False)
    assert code == 0, output
    assert "VULNERABLE aiohttp 3.7.3" in output and "warning only" in output


def test_a_clean_pin_passes_and_an_unreachable_service_warns(tmp_path, monkeypatch, capsys):
    code, output = _run_audit(tmp_path, monkeypatch, "aiohttp==3.14.5", capsys)
    assert code == 0, output
    assert "no known vulnerabilities" in output
    if "could not be reached" in output:  # offline, as here and on CI: said loudly
        assert "saved advisories only" in output


def test_the_feed_answers_pip_audit_queries_over_http():
    import urllib.request

    saved = Advisories.load(audit_main.ADVISORIES)
    with serve(saved) as url:
        query = {"package": {"name": "aiohttp", "ecosystem": "PyPI"}, "version": "3.7.3"}
        request = urllib.request.Request(url, data=json.dumps(query).encode(), method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=5) as response:
            ids = {v["id"] for v in json.load(response)["vulns"]}
    assert "PYSEC-2021-76" in ids
