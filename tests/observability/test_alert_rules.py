"""deploy/prometheus/epp-alerts.yaml passes `promtool check rules`, and its unit tests
(`promtool test rules epp-alerts.test.yaml`: series that fire each alert and series that
do not) pass. promtool comes with Debian's `prometheus` package (.ci/run installs it);
without it these tests skip and say so."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from observability.pages import ALERT_TESTS, ALERTS, alert_rules

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found: install Debian's `prometheus` package (apt-get install -y "
    "prometheus; .ci/run does it when it can)",
)


@needs_promtool
def test_promtool_check_rules():
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


@needs_promtool
def test_promtool_rule_unit_tests_pass():
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "test", "rules", ALERT_TESTS.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ALERT_TESTS.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_each_alert_has_a_firing_and_a_quiet_case():
    """Every alert is tested at a time it fires and at a time (or with series) it does not."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in tests:
        for case in test["alert_rule_test"]:
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
            for alert in case["exp_alerts"]:
                # The series of a second job (or pod) that must not fire are in every
                # firing test: exactly one alert is expected.
                assert len(case["exp_alerts"]) == 1, alert
    names = {rule["alert"] for rule in alert_rules()}
    assert fires == names and quiet == names


def test_rules_have_severity_summary_and_for():
    for rule in alert_rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["for"]
