"""deploy/grafana/epp-dashboard.json: the spec's eight panels, each a well-formed Grafana
panel, and every PromQL expression (and the alert rules') names only metrics a real
/metrics page of the EPP has."""

from __future__ import annotations

import json

import pytest
from observability.pages import (
    DASHBOARD,
    alert_rules,
    dashboard_expressions,
    page_series_names,
    promql_metric_names,
    service_page,
)

SPEC_PANELS = {
    "Cache Hit Rate Distribution": ("heatmap", {"epp_cache_match_ratio_bucket"}),
    "Queue Depth per Pod": ("timeseries", {"epp_queue_depth"}),
    "Routing Decision Rate": ("timeseries", {"epp_routing_decisions_total"}),
    "Composite Score Distribution": ("heatmap", {"epp_composite_score_bucket"}),
    "Stale Cache Rate": (
        "timeseries",
        {"epp_stale_cache_routing_total", "epp_routing_decisions_total"},
    ),
    "Scoring Latency": ("timeseries", {"epp_scoring_latency_us_bucket"}),
    "Pod Health Overview": ("table", {"epp_pod_health_score"}),
    "Adapter Load Events": ("timeseries", {"epp_adapter_loads_triggered_total"}),
}


@pytest.fixture(scope="module")
def names() -> set[str]:
    return page_series_names(service_page())


def _panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_the_spec_panels_are_there_with_their_metrics():
    board = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in _panels(board)}
    for title, (kind, metrics) in SPEC_PANELS.items():
        panel = panels[title]
        assert panel["type"] == kind, title
        used = set().union(*(promql_metric_names(t["expr"]) for t in panel["targets"]))
        assert metrics <= used, (title, used)
    # The first row is exactly the spec's eight, in the spec's order.
    first_row = [p["title"] for p in board["panels"][1:9]]
    assert first_row == list(SPEC_PANELS)


def test_panels_are_well_formed():
    board = json.loads(DASHBOARD.read_text())
    panels = _panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert board["uid"] and board["schemaVersion"] >= 36
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "job"}
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] < 24 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["type"] in {"timeseries", "heatmap", "table", "stat", "bargauge"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and panel["targets"]
        for target in panel["targets"]:
            assert 'job=~"$job"' in target["expr"], (panel["title"], target["expr"])
            if panel["type"] == "heatmap":
                assert target["format"] == "heatmap"


def test_every_dashboard_expression_names_only_exported_metrics(names):
    unknown = {
        (title, name)
        for title, expr in dashboard_expressions()
        for name in promql_metric_names(expr)
        if name not in names
    }
    assert not unknown


def test_every_alert_expression_names_only_exported_metrics(names):
    unknown = {
        (rule["alert"], name)
        for rule in alert_rules()
        for name in promql_metric_names(rule["expr"])
        if name not in names
    }
    assert not unknown
    assert {r["alert"] for r in alert_rules()} == {
        "EppCacheMatchLow",
        "EppPodQueueHigh",
        "EppStaleCacheRoutingHigh",
        "EppScoringLatencyHigh",
        "EppPodUnhealthy",
        "EppNoHealthyPods",
        "EppAbsent",
        "EppErrorRateHigh",
        "EppDiscoveryNotSynced",
        "EppBackgroundErrors",
        "EppHealthPanic",
    }


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("epp_queue_depth", {"epp_queue_depth"}),
        (
            'sum by (le) (rate(epp_x_bucket{job=~"$job", le="0.5"}[$__rate_interval]))',
            {"epp_x_bucket"},
        ),
        (
            "a > on (namespace, job) group_left () (0.8 * b)",
            {"a", "b"},
        ),
        (
            "histogram_quantile(0.99, sum without (instance) (rate(h_bucket[5m]))) > 5e3",
            {"h_bucket"},
        ),
        ("x == bool 0 or vector(1) unless y offset 5m", {"x", "y"}),
    ],
)
def test_promql_metric_names(expr, expected):
    assert promql_metric_names(expr) == expected
