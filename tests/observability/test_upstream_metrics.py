"""The upstream-compatible series (observability/upstream.py) against the reference EPP's
own definitions: the llm-d router v0.10.0 Go sources committed under
tests/fixtures/upstream/llm-d-router-v0.10.0/pkg (metrics.go, llm_d_router_metrics.go,
collectors/inference_pool.go and the prefix and in-flight plugins' metrics.go).

Every family the EPP exports under an upstream name (`llm_d_epp_*`, `inference_objective_*`,
`inference_pool_*`, `inference_extension_*`) must be defined there, with the same type, the
same label names and the same histogram buckets. And client input (model names, fairness
ids) must not grow the page without bound.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from epp.app import EppService
from epp.config import EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.observability.upstream import UpstreamMetrics
from epp.request import IncomingRequest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "fixtures" / "upstream" / "llm-d-router-v0.10.0" / "pkg"
GO_FILES = [
    "epp/metrics/metrics.go",
    "epp/metrics/llm_d_router_metrics.go",
    "epp/metrics/collectors/inference_pool.go",
    "epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/metrics.go",
    "epp/framework/plugins/requestcontrol/dataproducer/inflightload/metrics.go",
]
UPSTREAM_PREFIXES = (
    "llm_d_epp_",
    "inference_objective_",
    "inference_pool_",
    "inference_extension_",
)


# -- the reference's definitions, read from its Go source ----------------------------------
def _balanced(text: str, start: int) -> int:
    """Index just past the bracket closing the one at `start`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[text[start]]]
    i = start + 1
    while stack:
        c = text[i]
        if c == '"':
            i = text.index('"', i + 1)
        elif c in pairs:
            stack.append(pairs[c])
        elif c == stack[-1]:
            stack.pop()
        i += 1
    return i


def _split_args(text: str) -> list[str]:
    args, depth, current = [], 0, ""
    for c in text:
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += c
    if current.strip():
        args.append(current.strip())
    return args


class GoMetrics:
    def __init__(self, source: str) -> None:
        self.source = re.sub(r"//[^\n]*", "", source)
        self.consts = dict(re.findall(r"\b(\w+)\s*=\s*\"([^\"]*)\"", self.source))
        for alias, target in re.findall(r"\b(\w+)\s*=\s*(\w+)\s*$", self.source, re.M):
            if target in self.consts:  # InferenceExtensionSubsystem = inferenceExtension
                self.consts.setdefault(alias, self.consts[target])
        self.vars: dict[str, str] = {}
        for match in re.finditer(r"\b(\w+)\s*=\s*(\[\]string\{|append\()", self.source):
            start = match.end() - 1
            self.vars[match.group(1)] = self.source[match.start(2) : _balanced(self.source, start)]

    def labels(self, expr: str) -> list[str]:
        expr = expr.strip()
        if expr.startswith("[]string{"):
            return re.findall(r'"([^"]*)"', expr)
        if expr.startswith("append("):
            first, *rest = _split_args(expr[len("append(") : -1])
            out = self.labels(first)
            for item in rest:
                out += self.labels(item[:-3]) if item.endswith("...") else [item.strip('"')]
            return out
        return self.labels(self.vars[expr.split(".")[-1]])

    def buckets(self, opts: str) -> list[float] | None:
        match = re.search(r"Buckets:\s*(\[\]float64\{|\w+)", opts)
        if match is None:
            return None
        if match.group(1).startswith("[]"):
            start = match.end() - 1
            values = opts[start : _balanced(opts, start)]
        else:
            found = re.search(rf"{match.group(1)}\s*=\s*\[\]float64\{{([^}}]*)\}}", self.source)
            assert found is not None, match.group(1)
            values = found.group(1)
        return [float(v) for v in re.findall(r"[0-9][0-9.]*", values)]

    def families(self) -> dict[str, tuple[str, list[str], list[float] | None]]:
        """name -> (type, label names, buckets) of every metric the sources define."""
        out = {}
        for match in re.finditer(r"prometheus\.New(Counter|Gauge|Histogram)Vec\(", self.source):
            start = match.end() - 1
            opts, labels = _split_args(self.source[start + 1 : _balanced(self.source, start) - 1])[
                :2
            ]
            subsystem = re.search(r"Subsystem:\s*([\w.]+)", opts)
            name = re.search(r'Name:\s*"([^"]+)"', opts)
            assert subsystem is not None and name is not None, opts
            full = f"{self.consts[subsystem.group(1).split('.')[-1]]}_{name.group(1)}"
            out[full] = (match.group(1).lower(), self.labels(labels), self.buckets(opts))
        for match in re.finditer(r"prometheus\.NewDesc\(", self.source):
            start = match.end() - 1
            args = _split_args(self.source[start + 1 : _balanced(self.source, start) - 1])
            out[args[0].strip('"')] = ("gauge", self.labels(args[2]), None)
        return out


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[str, list[str], list[float] | None]]:
    return GoMetrics("\n".join((REFERENCE / f).read_text() for f in GO_FILES)).families()


def test_the_reference_sources_parse(reference):
    """A guard on the parser: known definitions, read as the Go source states them."""
    assert reference["inference_objective_request_total"] == (
        "counter",
        ["model_name", "target_model_name", "priority"],
        None,
    )
    _, labels, buckets = reference["llm_d_epp_request_duration_seconds"]
    assert labels == ["model_name", "target_model_name", "fairness_id", "priority"]
    assert buckets is not None and buckets[0] == 0.005 and buckets[-1] == 3600
    assert reference["inference_pool_per_pod_queue_size"][1] == ["name", "model_server_pod"]
    assert reference["llm_d_epp_inflight_requests"][1] == [
        "endpoint_name", "namespace", "producer_name", "fairness_id", "priority",
    ]  # fmt: skip
    assert len(reference) > 60


# -- ours ------------------------------------------------------------------------------------
def _service() -> EppService:
    config = EppConfig.model_validate(
        {
            "endpoints": [
                {"name": "pod-a", "address": "10.0.0.1:8000", "model": "m"},
                {"name": "pod-b", "address": "10.0.0.2:8000", "model": "m"},
            ],
            "server": {"grpc_port": 0, "metrics_port": 0},
        }
    )
    service = EppService(config)
    service.store.sync(config.endpoints)
    for endpoint in service.store.all():
        service.store.scraped(endpoint, PodMetrics(model="m", waiting=2.0, running=1.0))
    return service


def _body(model: str, text: str = "hello there " * 40) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


def ours(service: EppService) -> dict[str, tuple[str, list[str], list[float] | None]]:
    """Every upstream-named family the EPP's registry has: its type, labels, buckets."""
    out: dict[str, tuple[str, list[str], list[float] | None]] = {}
    registry = service.metrics.registry
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            name, kind = collector._name, collector._type
            if not name.startswith(UPSTREAM_PREFIXES):
                continue
            full = name + "_total" if kind == "counter" else name
            bounds = getattr(collector, "_upper_bounds", None)
            buckets = [b for b in bounds if b != float("inf")] if bounds else None
            out[full] = (kind, list(collector._labelnames), buckets)
    page = service.metrics.exposition().decode()
    for family in text_string_to_metric_families(page):
        if family.name.endswith("_created"):
            continue  # the Python client's creation time of each counter and histogram
        if family.name.startswith(UPSTREAM_PREFIXES) and family.name not in out:
            full = family.name + "_total" if family.type == "counter" else family.name
            if full in out:
                continue
            assert family.samples, f"{family.name}: no sample to read its labels from"
            out[full] = (family.type, list(family.samples[0].labels), None)
    return out


def test_every_upstream_named_family_matches_the_reference_definition(reference):
    service = _service()
    router = service.router
    router.route_now(
        IncomingRequest(path="/v1/chat/completions", body=_body("m"), request_id="open")
    )
    names = ours(service)
    assert len(names) >= 50
    problems = []
    for name, (kind, labels, buckets) in sorted(names.items()):
        if name not in reference:
            problems.append(f"{name}: not defined by the reference EPP")
            continue
        ref_kind, ref_labels, ref_buckets = reference[name]
        if kind != ref_kind:
            problems.append(f"{name}: {kind}, the reference's is a {ref_kind}")
        if sorted(labels) != sorted(ref_labels):
            problems.append(f"{name}: labels {labels}, the reference's {ref_labels}")
        if ref_buckets is not None and buckets != ref_buckets:
            problems.append(f"{name}: buckets {buckets}, the reference's {ref_buckets}")
    assert not problems, "\n".join(problems)


# -- behaviour -------------------------------------------------------------------------------
def _samples(page: str, name: str) -> list:
    return [
        s
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == name
    ]


def test_client_chosen_model_names_and_fairness_ids_are_bounded():
    """10,000 distinct model names and fairness ids: the upstream series stay bounded
    (model names share our `model` bound; fairness ids have their own)."""
    service = _service()
    upstream: UpstreamMetrics = service.metrics.upstream
    for i in range(10_000):
        labels = upstream.request(
            f"model-{i}", None, 0, {"x-llm-d-inference-fairness-id": f"tenant-{i}"}, False, 0.0
        )
        upstream.answered(404, type("R", (Exception,), {"upstream_labels": labels})())
    page = service.metrics.exposition().decode()
    errors = _samples(page, "llm_d_epp_request_error_total")
    models = {s.labels["model_name"] for s in errors}
    fairness = {s.labels["fairness_id"] for s in errors}
    assert "other" in models and len(models) <= 102, len(models)
    assert "other" in fairness and len(fairness) <= 102, len(fairness)
    assert sum(s.value for s in errors) == 10_000
    assert len(page) < 500_000


def test_a_fairness_header_names_the_flow_and_none_is_the_default_flow():
    upstream = _service().metrics.upstream
    named = upstream.request("m", None, 2, {"x-gateway-inference-fairness-id": "team"}, False, 0)
    assert (named.fairness_id, named.priority, named.target_model_name) == ("team", "2", "m")
    assert upstream.request("m", "m-v2", 0, {}, True, 0).key == ("m", "m-v2", "default-flow", "0")


def test_requests_waiting_in_admission_are_counted_in_and_out():
    """A saturated pool: requests wait in the EPP (queue gauges up, then back to 0 once a
    pod frees), each dispatch cycle is timed, every outcome is recorded."""
    config = EppConfig.model_validate(
        {
            "endpoints": [{"name": "pod-a", "address": "10.0.0.1:8000", "model": "m"}],
            "scheduling": {"max_queue": 1, "running_slots": 1},
            "server": {"grpc_port": 0, "metrics_port": 0},
        }
    )
    service = EppService(config)
    store, router, metrics = service.store, service.router, service.metrics
    store.sync(config.endpoints)
    store.scraped(store.all()[0], PodMetrics(model="m"))

    def page() -> str:
        return metrics.exposition().decode()

    async def scenario() -> tuple[str, str]:
        first = await router.route(
            IncomingRequest(
                path="/v1/chat/completions", body=_body("m", "one " * 50), request_id="a"
            )
        )
        second = await router.route(
            IncomingRequest(
                path="/v1/chat/completions", body=_body("m", "two " * 50), request_id="b"
            )
        )
        waiting = [
            asyncio.ensure_future(
                router.route(
                    IncomingRequest(
                        path="/v1/chat/completions",
                        body=_body("m", f"w{i} " * 50),
                        request_id=f"w{i}",
                    )
                )
            )
            for i in range(2)
        ]
        await asyncio.sleep(0.05)
        during = page()
        router.complete(first.token, 200)
        router.complete(second.token, 200)
        for future in waiting:  # one slot: each end lets the next waiting request go
            routed = await asyncio.wait_for(future, 5)
            router.complete(routed.token, 200)
        return during, page()

    during, after = asyncio.run(scenario())
    queued = _samples(during, "inference_extension_flow_control_queue_size")
    assert sum(s.value for s in queued) == 2
    assert queued[0].labels["inference_pool"] == "static"
    assert sum(s.value for s in _samples(after, "llm_d_epp_flow_control_queue_size")) == 0
    assert sum(s.value for s in _samples(after, "llm_d_epp_flow_control_queue_bytes")) == 0
    outcomes = {
        s.labels["outcome"]: s.value
        for s in _samples(after, "llm_d_epp_flow_control_requests_total")
    }
    assert outcomes == {"Dispatched": 4.0}
    enqueued = {
        s.labels["outcome"]: s.value
        for s in _samples(
            after, "inference_extension_flow_control_request_enqueue_duration_seconds_count"
        )
    }
    assert enqueued == {"Dispatched": 2.0, "NotYetFinalized": 2.0}
    cycles = _samples(
        after, "inference_extension_flow_control_dispatch_cycle_duration_seconds_count"
    )
    assert cycles[0].value >= 1
    running = _samples(after, "inference_objective_running_requests")
    assert [s.value for s in running] == [0.0]
    durations = _samples(after, "inference_objective_request_duration_seconds_count")
    assert sum(s.value for s in durations) == 4


def test_a_response_end_the_observer_saw_records_duration_ttft_size_and_pod_errors():
    """The observer filter's stream (as Envoy sends it) hands its response headers' time
    and content-length to `Router.complete`: request duration, TTFT and response size,
    and a pod's 500 counted as ModelServerError for the request's model."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from extproc.fakes import header_map

    from epp.extproc.messages import ROUTE_TOKEN_HEADER
    from epp.extproc.observer import ObserverStream

    service = _service()
    router, metrics = service.router, service.metrics
    ends = []
    for n, status in enumerate(("200", "500")):
        routed = router.route_now(
            IncomingRequest(path="/v1/chat/completions", body=_body("m"), request_id=f"r{n}")
        )
        observer = ObserverStream()
        request = header_map([(ROUTE_TOKEN_HEADER, routed.token)])
        observer.feed(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=request)))
        response = header_map([(":status", status), ("content-length", "321")])
        headers = pb.HttpHeaders(headers=response, end_of_stream=True)
        end = observer.feed(pb.ProcessingRequest(response_headers=headers))
        assert end is not None and end.response_bytes == 321 and end.first_byte_at
        router.complete(end.token, end.status, end.served_address, end.first_byte_at, 321)
        ends.append(end)
    page = metrics.exposition().decode()
    labels = {"model_name": "m", "target_model_name": "m"}

    def total(name: str, **more: str) -> float:
        wanted = {**labels, **more}
        return sum(
            s.value
            for s in _samples(page, name)
            if all(s.labels.get(k) == v for k, v in wanted.items())
        )

    assert total("inference_objective_request_duration_seconds_count") == 2
    assert total("inference_objective_response_sizes_sum") == 642
    assert total("llm_d_epp_request_ttft_seconds_count", streaming="false") == 2
    assert total("inference_objective_request_error_total", error_code="ModelServerError") == 1
    assert total("llm_d_epp_request_error_total", fairness_id="default-flow") == 1
    assert total("inference_objective_request_total") == 2
