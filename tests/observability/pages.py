"""Shared by the observability tests: series names on a /metrics page, metric names in a
PromQL expression, the dashboard's and the alert rules' expressions, and a /metrics page
from a real (not started) EppService after real routing decisions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from epp.request import IncomingRequest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "epp-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "epp-alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "epp-alerts.test.yaml"
DOCS = ROOT / "docs" / "metrics.md"

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("_count", "_sum", "_created"),
    "gauge": (),
    "info": ("_info",),
}


def page_families(page: str) -> dict[str, str]:
    """family name -> type, from the page's `# TYPE` lines."""
    families = {}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            families[name] = kind.strip()
    # prometheus_client writes each counter's and histogram's `_created` as a gauge family.
    return {
        name: kind
        for name, kind in families.items()
        if not (name.endswith("_created") and _has_base(name, families))
    }


def _has_base(created: str, families: dict[str, str]) -> bool:
    base = created.removesuffix("_created")
    return base in families or base + "_total" in families


def page_series_names(page: str) -> set[str]:
    """Every series name a query can use: the samples on the page, plus each family's
    own names (a labelled family without samples yet still has its TYPE line)."""
    names = set()
    for line in page.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    for family, kind in page_families(page).items():
        base = family.removesuffix("_total") if kind == "counter" else family
        names.add(family if kind != "counter" else base + "_total")
        for suffix in _SUFFIXES.get(kind, ()):
            names.add(base + suffix)
    return names


# -- PromQL -------------------------------------------------------------------------------
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_KEYWORDS |= {"and", "or", "unless", "inf", "nan", "atan2"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects. Strings, label matchers `{...}`, ranges
    `[...]` and the label lists of by/without/on/ignoring/group_* are removed first;
    what is left and is not a function call, a keyword or a number is a metric name."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$:])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expr) of every query in the dashboard, rows' panels included."""
    board = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                out.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(board["panels"])
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict) and "label_values(" in query.get("query", ""):
            metric = re.search(r"label_values\((\w+)", query["query"])
            assert metric is not None
            out.append((f"variable {variable['name']}", metric.group(1)))
    return out


def alert_rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


# -- a real page ---------------------------------------------------------------------------
def service_page() -> str:
    """The /metrics page of an EppService (built as `epp serve` builds it, not started)
    after routed, refused and answered requests, scrape failures and a discovery state."""
    import time as _time

    from epp.app import EppService
    from epp.config import EppConfig
    from epp.datalayer.discovery.state import DiscoveryState, ResourceStats
    from epp.datalayer.metrics_parser import PodMetrics
    from epp.request import RequestRejected

    config = EppConfig.model_validate(
        {
            "endpoints": [
                {"name": "pod-a", "address": "10.0.0.1:8000", "model": "m"},
                {"name": "pod-b", "address": "10.0.0.2:8000", "model": "m"},
            ],
            "adapters": {"sql-lora": "m"},
            "server": {"grpc_port": 0, "grpc_health_port": 0, "metrics_port": 0},
        }
    )
    service = EppService(config)
    store, router, metrics = service.store, service.router, service.metrics
    store.sync(config.endpoints)
    for endpoint in store.all():
        store.scraped(endpoint, PodMetrics(model="m", prefix_hits=0.0))
    body = json.dumps(
        {"model": "sql-lora", "messages": [{"role": "user", "content": "hello there " * 80}]}
    ).encode()
    for i in range(4):
        routed = router.route_now(
            IncomingRequest(path="/v1/chat/completions", body=body, request_id=f"r{i}")
        )
        router.complete(routed, 200)
    for endpoint in store.all():
        store.scraped(endpoint, PodMetrics(model="m", prefix_hits=10_000.0))
        store.scraped(endpoint, PodMetrics(model="m", prefix_hits=10_000.0))
    store.scrape_failed(store.all()[0], "TimeoutError: ")
    store.scraped(store.all()[0], PodMetrics(model="m", prefix_hits=10_000.0))
    try:
        router.route_now(
            IncomingRequest(
                path="/v1/chat/completions", body=body.replace(b"sql-lora", b"x"), request_id="r404"
            )
        )
    except RequestRejected as exc:
        metrics.answers.answered("r404", exc.status, exc.reason, exc.message)
    metrics.answers.answered("r400", 400, "invalid-json", "the body is not valid JSON")
    resource = ResourceStats("pods", present=True, synced=True, last_sync_ok=True, lists=1)

    class Discovery:
        async def start(self) -> None: ...

        async def stop(self) -> None: ...

        def state(self) -> DiscoveryState:
            return DiscoveryState(
                mode="kubernetes",
                last_sync_ok=True,
                last_sync_unix=_time.time(),
                endpoints=2,
                relists=1,
                watch_restarts=2,
                errors=0,
                resources=(resource,),
                pool_found=True,
            )

    service.discovery = Discovery()
    # Registered by `epp serve` only with replicas.peers: registered here so that the
    # documentation and expression checks cover them too.
    from epp.observability.replica_metrics import ReplicaMetrics

    ReplicaMetrics(metrics.registry)
    # Likewise only with a `tokenizers:` entry of `source: engine`.
    from epp.tokenization.engine import EngineTokenizer

    EngineTokenizer({}, list, metrics.registry)
    return metrics.exposition().decode()
