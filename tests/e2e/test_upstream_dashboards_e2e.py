"""GIE's dashboard and alert rules, unchanged, answered by a real Prometheus scraping our EPP.

The upstream files are the fixtures `gie-v1.5.0/dashboards/inference_gateway.json` and
`gie-v1.5.0/alerts/alert.yaml` (tests/fixtures/upstream). A real Envoy, the real
`epp serve` and two simulated vLLM pods serve live traffic: chat and completion requests
of two fairness flows, a share the pods answer with 500 (`x-sim-fail`), requests for an
unknown model (404 from the EPP), all at a concurrency above the pods' capacity
(`running_slots: 1`, `max_queue: 1`) so that requests wait in the EPP's admission queue.
A real Prometheus (Debian's binary) scrapes the EPP and the pods every second, as a
cluster scrapes the EPP and its model servers.

While the traffic runs, every PromQL expression of both files, extracted from the files
themselves, is sent to Prometheus's query API with Grafana's template variables
substituted as Grafana would ($__rate_interval from the 1 s scrape interval, $__range from
the dashboard's time range), and each must return at least one series. An alert rule's
expression ends in a threshold comparison that filters out series below it; it is sent
with that comparison made `bool` (`> bool 50`), which keeps every series, so that the
question asked is "does this rule see its series" whatever today's values.

Expressions that cannot return data here are listed in NO_DATA with their reason, and
the reason is asserted, not assumed:
- `bbr_*`: GIE's Body-Based Router is a separate ext_proc server, not part of an EPP (the
  reference EPP's metric catalog names no `bbr_` series); none runs here.
- `inference_objective_output_tokens`: the output token count comes from the response
  body, which the EPP never receives (docs/metrics.md, "Not exported").

Without Debian's `prometheus` package the module skips and says so (.ci/run installs it),
as tests/e2e/test_prometheus_e2e.py does.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from e2e.prometheus_server import PROMETHEUS, running_prometheus
from observability.pages import DOCS, page_series_names, promql_metric_names

from epp_harness.stack import LocalStack

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus not found: install Debian's `prometheus` package "
        "(apt-get install -y prometheus; .ci/run does it when it can)",
    ),
]
UPSTREAM = Path(__file__).resolve().parents[1] / "fixtures" / "upstream"
DASHBOARD = UPSTREAM / "gie-v1.5.0" / "dashboards" / "inference_gateway.json"
ALERTS = UPSTREAM / "gie-v1.5.0" / "alerts" / "alert.yaml"
REFERENCE_METRICS = UPSTREAM / "llm-d-router-v0.10.0" / "docs" / "metrics.md"
MODEL = "sim-llama-8b"
SCRAPE_S = 1
# Pods slow enough, and few enough slots, that 8 concurrent clients keep requests waiting.
SIM_ARGS = ["--prefill-per-token-ms", "0.05", "--decode-per-token-ms", "15"]
EPP_CONFIG = "scheduling: {max_queue: 1, running_slots: 1}\n"
CLIENTS = 8
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

BBR = "GIE's Body-Based Router (a separate ext_proc server) exports bbr_*; no EPP does"
NOT_RECEIVED = "needs the response body, which the EPP never receives (docs/metrics.md)"
# metric name -> why an expression selecting it returns no series here.
NO_DATA = {
    "bbr_success_total": BBR,
    "bbr_model_not_in_body_total": BBR,
    "bbr_model_not_parsed_total": BBR,
    "bbr_plugin_duration_seconds_bucket": BBR,
    "inference_objective_output_tokens_bucket": NOT_RECEIVED,
}


# -- the upstream files' expressions, as Grafana and Prometheus would run them ----------------
def _seconds(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def grafana_variables(board: dict) -> dict[str, str]:
    """$__range: the dashboard's time range; $__interval: range / ~1000 points, at least the
    data source's scrape interval (Grafana's min interval); $__rate_interval:
    max($__interval + scrape interval, 4 x scrape interval), Grafana's definition."""
    span = _seconds(board["time"]["to"]) - _seconds(board["time"]["from"])
    interval = max(SCRAPE_S, round(span / 1000))
    rate = max(interval + SCRAPE_S, 4 * SCRAPE_S)
    return {
        "$__rate_interval": f"{rate}s",
        "$__interval": f"{interval}s",
        "$__range": f"{int(span)}s",
    }


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    variables = grafana_variables(board)
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in variables.items():
                    expr = expr.replace(name, value)
                assert "$" not in expr, f"unsubstituted variable in {expr}"
                out.append((f"dashboard: {panel['title']} ({target.get('refId')})", expr))
            walk(panel.get("panels", []))

    walk(board["panels"])
    return out


_THRESHOLD = re.compile(r"\s(>|<|>=|<=|==|!=)\s*([0-9.]+)\s*$")


def alert_queries() -> list[tuple[str, str]]:
    out = []
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            expr = rule["expr"].strip()
            assert _THRESHOLD.search(expr), f"{rule['alert']}: no final threshold in {expr}"
            out.append((f"alert: {rule['alert']}", _THRESHOLD.sub(r" \1 bool \2", expr)))
    return out


def test_the_upstream_files_have_the_expressions_this_test_expects():
    """A guard on the extraction itself: the fixture's 4 rows of queries and 4 rules."""
    dashboard, alerts = dashboard_queries(), alert_queries()
    assert len(dashboard) >= 40 and len(alerts) == 4
    named = {n for _, expr in dashboard + alerts for n in promql_metric_names(expr)}
    assert {"inference_pool_average_queue_size", "inference_objective_request_total"} <= named
    assert set(NO_DATA) <= named  # a stale NO_DATA entry would excuse nothing


# -- the running stack, its traffic and Prometheus ------------------------------------------
def http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None):
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    request.add_header("content-type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with _DIRECT.open(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class Traffic:
    """CLIENTS threads sending requests until stopped; statuses counted."""

    def __init__(self, stack: LocalStack) -> None:
        self._url = stack.envoy_url
        self._stop = threading.Event()
        self.statuses: dict[int, int] = {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            headers = {"x-llm-d-inference-fairness-id": f"tenant-{client % 2}"}
            model = MODEL
            if n % 7 == 0:
                headers["x-sim-fail"] = "500"  # the pod answers 500: ModelServerError
            if n % 11 == 0:
                model = "no-such-model"  # the EPP answers 404: NotFound
            if n % 2:
                path = "/v1/completions"
                body = {"model": model, "prompt": f"client {client} asks {n} " * 30}
            else:
                path = "/v1/chat/completions"
                messages = [{"role": "user", "content": f"client {client} turn {n} " * 30}]
                body = {"model": model, "messages": messages}
            body["max_tokens"] = 4
            status, _ = http(f"{self._url}{path}", json.dumps(body).encode(), headers)
            with self._lock:
                self.statuses[status] = self.statuses.get(status, 0) + 1


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[LocalStack]:
    work = tmp_path_factory.mktemp("upstream-dashboards")
    with LocalStack(
        pods=2,
        sim_args=SIM_ARGS,
        epp_config_yaml=EPP_CONFIG,
        work_dir=work / "stack",
        log_level="warning",
    ) as running:
        yield running


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory) -> Iterator[str]:
    """A real Prometheus scraping the EPP (job epp) and the pods (job vllm) every second."""
    assert PROMETHEUS is not None and stack.epp_metrics_url is not None
    work = tmp_path_factory.mktemp("prometheus-upstream")
    epp = urllib.parse.urlsplit(stack.epp_metrics_url).netloc
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "scrape_configs": [
            {"job_name": "epp", "static_configs": [{"targets": [epp]}]},
            {"job_name": "vllm", "static_configs": [{"targets": [p.address for p in stack.pods]}]},
        ],
    }
    with running_prometheus(config, work) as base:
        yield base


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def query(base: str, expr: str) -> list[dict]:
    status, body = http(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    data = json.loads(body)
    assert status == 200 and data["status"] == "success", (expr, data)
    return data["data"]["result"]


def test_every_upstream_dashboard_and_alert_query_returns_series(stack, prometheus):
    expressions = dashboard_queries() + alert_queries()
    with Traffic(stack) as traffic:
        _wait(
            lambda: len(query(prometheus, "up == 1")) == 1 + len(stack.pods),
            30,
            "the EPP and the pods scraped",
        )
        # Requests waited in the EPP and were dispatched from its queue, within the
        # dashboards' rate window: what the flow-control panels need.
        waited = (
            "rate(inference_extension_flow_control_request_queue_duration_seconds_count"
            '{outcome="Dispatched"}[4s]) > 0 and on() '
            "rate(inference_extension_flow_control_dispatch_cycle_duration_seconds_count[4s]) > 0"
        )
        _wait(lambda: bool(query(prometheus, waited)), 60, "requests waiting in admission")
        time.sleep(4 * SCRAPE_S)  # a full $__rate_interval of traffic
        results = {where: (expr, query(prometheus, expr)) for where, expr in expressions}
        page = http(stack.epp_metrics_url or "")[1].decode()
    statuses = traffic.statuses
    assert statuses.get(200, 0) > 20 and statuses.get(500, 0) and statuses.get(404, 0), statuses

    empty = {where: expr for where, (expr, series) in results.items() if not series}
    unexplained = {
        where: expr
        for where, expr in empty.items()
        if not (promql_metric_names(expr) & set(NO_DATA))
    }
    assert not unexplained, "queries with no series:\n" + "\n".join(
        f"{w}: {e}" for w, e in unexplained.items()
    )
    excused = {w for w, (e, _) in results.items() if promql_metric_names(e) & set(NO_DATA)}
    assert set(empty) == excused  # an excused expression with data: a stale excuse
    assert len(excused) == 12  # the 9 BBR queries and the 3 output-token quantiles
    # Every expression excused returns nothing, and only for the reason given.
    exported = page_series_names(page)
    scraped = {r["metric"]["__name__"] for r in query(prometheus, '{__name__=~".+"}')}
    for where, expr in empty.items():
        for name in promql_metric_names(expr):
            assert name in NO_DATA, (where, name)
            assert name not in exported and name not in scraped, (where, name)
            base = name.removesuffix("_bucket")
            if NO_DATA[name] is BBR:
                assert name.startswith("bbr_")
                assert "bbr_" not in REFERENCE_METRICS.read_text()
            else:
                assert f"`{base}`" in DOCS.read_text().split("**Not exported**")[1][:1500]


def _page_value(stack: LocalStack, name: str) -> float:
    for line in http(stack.epp_metrics_url or "")[1].decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on the EPP's page")


def test_the_upstream_alerts_see_the_values_the_epp_exports(stack, prometheus):
    """The alerts' series carry the values the EPP's page shows (not just any series):
    a pool gauge and the per-model error ratio, read back from Prometheus."""
    for name in ("inference_pool_average_queue_size", "inference_pool_ready_pods"):

        def same(name: str = name) -> bool:
            got = [float(r["value"][1]) for r in query(prometheus, name)]
            return got == [_page_value(stack, name)]

        _wait(same, 20, f"{name} in Prometheus as on the EPP's page")
    assert _page_value(stack, "inference_pool_ready_pods") == len(stack.pods)
    ratio = query(
        prometheus,
        "sum by (model_name) (increase(inference_objective_request_error_total[5m]))"
        " / sum by (model_name) (increase(inference_objective_request_total[5m]))",
    )
    by_model = {r["metric"].get("model_name"): float(r["value"][1]) for r in ratio}
    # One request in 7 was answered 500 by its pod (ModelServerError), of those routed.
    assert 0.05 < by_model[MODEL] < 0.4, by_model
