"""The EPP's /metrics page, as a real Prometheus sees it.

A real Envoy, the real EPP process and simulated vLLM pods serve traffic: conversations,
bad requests, an unknown model, and the pods' caches reset behind the EPP's back. Then:

- `promtool check metrics` reads the EPP's page: it parses, and its lint finds only the
  spec's own name `epp_scoring_latency_us` ("abbreviated units");
- every expression of the Grafana dashboard and the alert rules names only series on it;
- a real Prometheus server (Debian's binary) with a generated config scrapes the EPP on
  loopback every second into its own temp storage, loads the alert rules, and its HTTP
  API returns the EPP's series with the values the EPP's page shows.

Without Debian's `prometheus` package (promtool and prometheus) the module skips and says
so; `.ci/run` installs it where it can.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.prometheus_server import PROMETHEUS, running_prometheus
from observability.pages import (
    ALERTS,
    alert_rules,
    dashboard_expressions,
    page_series_names,
    promql_metric_names,
)
from prometheus_client.parser import text_string_to_metric_families

import epp
from epp_harness.stack import LocalStack

PROMTOOL = shutil.which("promtool")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        PROMTOOL is None or PROMETHEUS is None,
        reason="promtool/prometheus not found: install Debian's `prometheus` package "
        "(apt-get install -y prometheus; .ci/run does it when it can)",
    ),
]
MODEL = "sim-llama-8b"
FAST_PODS = ["--prefill-per-token-ms", "0.01", "--decode-per-token-ms", "0.2"]
MARKER = "zebra-secret-prompt"
TOPICS = ["tides", "glaciers", "comets"]
CHECKED = 3 * len(TOPICS)  # turns 1, 2 (before the reset) and 3 (after) of each topic
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(url: str, body: bytes | None = None, timeout: float = 30.0):
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    request.add_header("content-type", "application/json")
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def turn(stack: LocalStack, topic: str, n: int) -> int:
    messages = [{"role": "system", "content": f"{MARKER}: you know {topic}. " * 50}]
    for i in range(n):
        messages += [
            {"role": "user", "content": f"{MARKER} question {i} on {topic}"},
            {"role": "assistant", "content": f"answer {i} " * 20},
        ]
    messages.append({"role": "user", "content": f"{MARKER} question {n}"})
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 3}).encode()
    return http(f"{stack.envoy_url}/v1/chat/completions", body)[0]


def page_of(stack: LocalStack) -> str:
    assert stack.epp_metrics_url is not None
    return http(stack.epp_metrics_url, timeout=5)[2].decode()


def sample(page: str, name: str, **labels: str) -> float:
    """The sum of the page's samples of `name` whose labels include `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[LocalStack, dict[str, str]]]:
    """A stack after its traffic; also the request ids of the two bad requests."""
    work = tmp_path_factory.mktemp("prometheus-e2e")
    with LocalStack(pods=2, sim_args=FAST_PODS, work_dir=work / "stack") as stack:
        for n in range(3):
            for topic in TOPICS:
                assert turn(stack, topic, n) == 200
        ids = {}
        bad = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": MARKER}]})
        status, headers, _ = http(f"{stack.envoy_url}/v1/chat/completions", bad[:40].encode())
        assert status == 400
        ids["400"] = headers["x-epp-request-id"]
        status, headers, _ = http(
            f"{stack.envoy_url}/v1/chat/completions", bad.replace(MODEL, "no-such").encode()
        )
        assert status == 404
        ids["404"] = headers["x-epp-request-id"]
        # The pods forget their caches; the EPP's index still says they hold the prompts.
        for pod in stack.pods:
            assert http(f"{pod.base_url}/reset_prefix_cache", b"{}")[0] == 200
        for topic in TOPICS:
            assert turn(stack, topic, 3) == 200
        # Every decision with a predicted hit is checked once its request is over (on the
        # second page after): wait for all of them, then the test below asserts which.
        wait_for(
            lambda: sample(page_of(stack), "epp_stale_cache_checked_total") >= CHECKED,
            what="the decisions with a predicted hit to be checked",
        )
        yield stack, ids


def test_stale_cache_routing_counts_the_decisions_the_reset_made_stale(served):
    """The pods count their prompts in more tokens than the EPP's byte estimate (~1.3x
    here), so a hit brings more hits than the EPP predicted: those must not cover the
    decisions the reset made stale (observability/stale.py converts them)."""
    stack, _ = served
    page = page_of(stack)
    # 3 conversations x 3 turns with a predicted hit (all but the first turn), none stale;
    # then one turn each after the reset, all stale.
    assert sample(page, "epp_stale_cache_checked_total") == CHECKED
    assert sample(page, "epp_stale_cache_routing_total") == len(TOPICS)


def test_answers_are_counted_and_logged_with_the_request_id_never_the_prompt(served):
    stack, ids = served
    page = page_of(stack)
    assert sample(page, "epp_answers_total", status="400", reason="invalid-json") == 1
    assert sample(page, "epp_answers_total", status="404", reason="model-not-found") == 1
    log = Path(stack.log_paths["epp"]).read_text()
    answered = {
        entry["request_id"]: entry
        for entry in map(json.loads, filter(None, log.splitlines()))
        if entry.get("event") == "request_answered"
    }
    assert answered[ids["400"]]["status"] == 400 and answered[ids["400"]]["level"] == "info"
    assert answered[ids["404"]]["reason"] == "model-not-found"
    assert '"request_routed"' in log and MARKER not in log


def test_promtool_check_metrics_accepts_the_page(served):
    stack, _ = served
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "metrics"],
        input=page_of(stack),
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (done.stdout + done.stderr).strip()
    assert "error while linting" not in output, output
    abbreviated = " metric names should not contain abbreviated units"
    # The reference EPP's names (llm_d_epp_*, kept as it spells them for its dashboards)
    # contain `_d_`, which the lint reads as "days": that problem, on those names only.
    upstream = {line for line in output.splitlines() if line.startswith("llm_d_epp_")}
    assert upstream and all(line.endswith(abbreviated) for line in upstream), output
    problems = sorted(set(output.splitlines()) - upstream)
    # The spec names the metric `epp_scoring_latency_us`; Prometheus' lint prefers base
    # units. That is the only other problem, and the page otherwise parses and lints clean.
    assert problems == sorted(
        f"{name}{abbreviated}"
        for name in ("epp_scoring_latency_us", "epp_scoring_latency_us_created")
    ), output
    assert done.returncode == 3  # promtool: lint problems found (1 would be a parse error)


def test_dashboard_and_alerts_use_only_series_the_running_epp_exports(served):
    stack, _ = served
    names = page_series_names(page_of(stack))
    exprs = [*dashboard_expressions(), *((r["alert"], r["expr"]) for r in alert_rules())]
    unknown = {(where, n) for where, expr in exprs for n in promql_metric_names(expr)} - {
        (where, n) for where, expr in exprs for n in promql_metric_names(expr) if n in names
    }
    assert not unknown


@pytest.fixture(scope="module")
def prometheus(served, tmp_path_factory) -> Iterator[str]:
    """A real Prometheus scraping the EPP every second; yields its base URL."""
    stack, _ = served
    assert PROMETHEUS is not None and stack.epp_metrics_url is not None
    work = tmp_path_factory.mktemp("prometheus")
    target = urllib.parse.urlsplit(stack.epp_metrics_url).netloc
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "epp", "static_configs": [{"targets": [target]}]}],
    }
    with running_prometheus(config, work) as base:
        yield base


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, _, body = http(url, timeout=5)
    assert status == 200, body
    data = json.loads(body)
    assert data["status"] == "success", data
    return data["data"]["result"]


def scalar(base: str, expr: str) -> float | None:
    result = query(base, expr)
    return float(result[0]["value"][1]) if result else None


def test_a_real_prometheus_scrapes_the_epp_and_sees_its_values(served, prometheus):
    stack, _ = served
    wait_for(lambda: scalar(prometheus, 'up{job="epp"}') == 1.0, what="the EPP target up")
    page = page_of(stack)  # the traffic is over: these values no longer move
    expected = {
        'sum(epp_routing_decisions_total{result="routed"})': sample(
            page, "epp_routing_decisions_total", result="routed"
        ),
        'epp_answers_total{status="400",reason="invalid-json"}': 1.0,
        'epp_answers_total{status="404",reason="model-not-found"}': 1.0,
        "epp_stale_cache_routing_total": sample(page, "epp_stale_cache_routing_total"),
        "epp_scoring_latency_us_count": sample(page, "epp_scoring_latency_us_count"),
        "epp_max_queue": 20.0,
        "epp_health_exclusion_threshold": 0.3,
        f'epp_build_info{{version="{epp.__version__}"}}': 1.0,
        "count(epp_pod_health_score)": 2.0,
        "epp_healthy_pods": 2.0,
        'epp_discovery_info{mode="file"}': 1.0,
    }
    assert expected['sum(epp_routing_decisions_total{result="routed"})'] >= 4 * len(TOPICS)
    got: dict[str, float | None] = {}

    def arrived() -> bool:
        got.update({expr: scalar(prometheus, expr) for expr in expected})
        return got == expected

    wait_for(arrived, timeout=30, what="the EPP's values in Prometheus")
    # Per-pod series keep the EPP's `pod` label (one series per simulated pod).
    pods = {r["metric"]["pod"] for r in query(prometheus, "epp_queue_depth")}
    assert pods == {p.name for p in stack.pods}


def test_prometheus_loads_the_alert_rules_and_evaluates_them_on_the_epps_series(served, prometheus):
    status, _, body = http(f"{prometheus}/api/v1/rules", timeout=5)
    assert status == 200
    rules = [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    wait_for(
        lambda: (
            all(r.get("health") == "ok" and r.get("lastEvaluation") for r in _rules(prometheus))
            and all(not r.get("lastError") for r in _rules(prometheus))
        ),
        what="every rule evaluated without error",
    )


def _rules(base: str) -> list[dict]:
    body = http(f"{base}/api/v1/rules", timeout=5)[2]
    return [r for g in json.loads(body)["data"]["groups"] for r in g["rules"]]
