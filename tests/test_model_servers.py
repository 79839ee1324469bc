"""Pools of SGLang and Triton TensorRT-LLM pods installed with GIE v1.5.0's chart
(`inferencePool.modelServerType`): the EPP reads the series and the page the chart's flags
name, from pages real servers produced (tests/fixtures/upstream: SGLang's documented
/metrics capture, the Triton TensorRT-LLM backend's), not vLLM's.

The chart is rendered by tools/helm_render; its EPP `args:` go through `epp serve`'s own
parsing. Discovery runs against the stand-in API server (tests/kube_standin.py: no real API
server can run here); each pod's page is served over real HTTP (aiohttp) on a loopback
address, and the EPP's own router picks the pod.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from deploy.conftest import helm_render_binary, render_chart  # noqa: F401
from kube_standin import KubeStandIn, pod, pool, running
from kubernetes import client as k8s
from upstream_args import GIE_V15_VALUES, UPSTREAM, epp_containers, gie_v15_chart, plugins_files

from epp.app import EppService, config_from_args, parse_serve_args
from epp.config import EppConfig
from epp.datalayer.kubernetes_resources import INFERENCE_POOL, POD
from epp.datalayer.metrics_parser import MetricsFormatError, PageReader, parse_vllm_metrics
from epp.datalayer.scraper import page_reader
from epp.request import IncomingRequest, RequestRejected

SGLANG_PAGE = UPSTREAM / "sglang-40ef116f" / "sglang-metrics.txt"
TRITON_PAGE = UPSTREAM / "tensorrtllm_backend-v1.0.0" / "triton-metrics.txt"
NS = "llm"
IP = "127.0.0.9"
WAIT_S = 10.0


def chart_config(
    render_chart: Callable[..., Any],  # noqa: F811
    tmp_path: Path,
    model_server: str,
    flags: dict[str, Any] | None = None,
) -> EppConfig:
    """`epp serve`'s configuration from GIE v1.5.0's EPP args for `model_server` (its
    plugins file made local: the one change)."""
    values: dict[str, Any] = {
        "inferencePool": {
            "modelServers": {"matchLabels": {"app": model_server}},
            "modelServerType": model_server,
        }
    }
    if flags:
        values["inferenceExtension"] = {"flags": flags}
    user = tmp_path / "values.yaml"
    user.write_text(yaml.safe_dump(values))
    rendered = render_chart(
        GIE_V15_VALUES, user, chart=gie_v15_chart(tmp_path), name="pool", namespace=NS
    )
    (container,) = epp_containers(rendered.objects)
    args = list(container["args"])
    for i, arg in enumerate(args[:-1]):
        if arg == "--config-file":
            local = tmp_path / Path(args[i + 1]).name
            local.write_text(plugins_files(rendered.objects)[local.name])
            args[i + 1] = str(local)
    parsed, upstream = parse_serve_args(args)
    return config_from_args(parsed, upstream)


# --- the pages, read with the specs the chart passes ------------------------------------


def test_sglang_page_read_with_the_charts_specs(render_chart, tmp_path):  # noqa: F811
    config = chart_config(render_chart, tmp_path, "sglang")
    m = page_reader(config.datalayer).parse(SGLANG_PAGE.read_text())
    assert (m.waiting, m.running) == (2826.0, 162.0)
    assert m.kv_usage == pytest.approx(0.28)
    assert m.model == "meta-llama/Llama-3.1-8B-Instruct"
    # What SGLang does not export: vLLM's prefix-cache counters, LoRA info, cache info.
    assert (m.prefix_queries, m.prefix_hits, m.block_size) == (0.0, 0.0, None)
    assert m.generation_tokens is None  # so its busy gauges never count as frozen
    assert not m.prefix_counters  # nor its decisions as stale
    assert m.running_adapters == frozenset()
    # vLLM's reader finds nothing there: the 503 the flags used to cause.
    with pytest.raises(MetricsFormatError):
        parse_vllm_metrics(SGLANG_PAGE.read_text())


def test_triton_page_read_with_the_charts_label_matchers(render_chart, tmp_path):  # noqa: F811
    config = chart_config(render_chart, tmp_path, "triton-tensorrt-llm")
    m = page_reader(config.datalayer).parse(TRITON_PAGE.read_text())
    # request_type="waiting" and "scheduled" of one family; "context", "max" and "active"
    # are other series of it and must not count.
    assert (m.waiting, m.running) == (1.0, 1.0)
    assert m.kv_usage == pytest.approx(0.4875)  # kv_cache_block_type="fraction" only
    assert m.model is None  # Triton names its backend model, not the served one
    with pytest.raises(MetricsFormatError):
        parse_vllm_metrics(TRITON_PAGE.read_text())


def test_label_matchers_select_series_and_engines_are_summed():
    reader = PageReader.from_texts('q{kind="waiting"}', "q{kind=running}", "kv", "", "cache")
    page = "\n".join(
        [
            'q{kind="waiting",dp="0"} 2',
            'q{kind="waiting",dp="1"} 3',
            'q{kind="running",dp="0"} 7',
            'q{kind="max"} 512',
            'kv{dp="0"} 0.2',
            'kv{dp="1"} 0.6',
            'cache{page_size="1",num_pages="4096",dp="0"} 1',
            'cache{page_size="1",num_pages="4096",dp="1"} 1',
            'vllm:lora_requests_info{running_lora_adapters="a",max_lora="2"} 5',
        ]
    )
    m = reader.parse(page)
    assert (m.waiting, m.running) == (5.0, 7.0)
    assert m.kv_usage == pytest.approx(0.4)  # the engines' mean
    assert (m.block_size, m.num_gpu_blocks) == (1, 8192)  # SGLang's label names
    assert m.running_adapters == frozenset()  # lora_info "": not read


def test_the_vllm_fallback_names_apply_to_the_default_spec_only():
    old = "vllm:gpu_cache_usage_perc 0.5\nvllm:num_requests_waiting 1\n"
    assert parse_vllm_metrics(old).kv_usage == 0.5
    custom = PageReader.from_texts("vllm:num_requests_waiting", "", "my_kv", "", "")
    assert custom.parse(old).kv_usage == 0.0


# --- a pool of such pods, discovered and routed to ----------------------------------------


class Page:
    """What the pod's metrics path answers (a test may change it between scrapes)."""

    def __init__(self, text: str) -> None:
        self.text = text


async def serve_page(page: Page, port: int, path: str) -> web.AppRunner:
    """The model server's page, over real HTTP, as its /metrics (or another path)."""
    app = web.Application()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page.text, content_type="text/plain")

    app.router.add_get(path, metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, IP, port).start()
    return runner


def free_port() -> int:
    with socket.socket() as s:
        s.bind((IP, 0))
        return int(s.getsockname()[1])


async def until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def standin() -> Any:
    with running() as s:
        yield s


@asynccontextmanager
async def routed_pool(
    config: EppConfig, standin: KubeStandIn, page: Page, target_port: int, metrics_port: int
) -> AsyncIterator[EppService]:
    """One pod of the chart's pool (`app: <type>`) on the stand-in, its page served where
    the config says, and the EPP started on loopback ports."""
    data = config.model_dump()
    data["server"].update(grpc_port=0, grpc_health_port=0, metrics_port=0, grpc_host="127.0.0.1")
    config = EppConfig.model_validate(data)
    runner = await serve_page(page, metrics_port, config.datalayer.metrics_path)
    labels = {"app": "model-server"}
    standin.apply(INFERENCE_POOL, pool("pool", labels, [target_port]), NS)
    standin.apply(POD, pod("pod-0", labels, IP), NS)
    svc = EppService(config, kube_client=k8s.ApiClient(k8s.Configuration(host=standin.url)))
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop(grace_s=0.1)
        await runner.cleanup()


def route(svc: EppService, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "hello " * 20}).encode()
    routed = svc.router.route_now(
        IncomingRequest(path="/v1/completions", body=body, request_id="r1")
    )
    svc.router.complete(routed.token, 200)
    return routed.endpoint.name


async def test_an_sglang_pool_is_scraped_and_routed_to(
    render_chart,  # noqa: F811
    tmp_path,
    standin,
):
    config = chart_config(render_chart, tmp_path, "sglang")
    port = free_port()
    real = SGLANG_PAGE.read_text()
    page = Page(real)
    async with routed_pool(config, standin, page, port, port) as svc:
        await until(lambda: svc.store.get("pod-0") is not None, "pod-0 discovered")
        endpoint = svc.store.get("pod-0")
        await until(lambda: endpoint.metrics is not None or endpoint.consecutive_failures > 2,
                    "pod-0 scraped")  # fmt: skip
        assert endpoint.metrics is not None, endpoint.last_error
        assert endpoint.metrics.waiting == 2826.0 and endpoint.health == 1.0
        assert endpoint.model == "meta-llama/Llama-3.1-8B-Instruct"
        await until(lambda: svc.ready, "ready")
        # The captured server had 2,826 requests queued: saturated, so a new request
        # waits in admission (429 from route_now, which does not wait), not 503.
        with pytest.raises(RequestRejected) as rejected:
            route(svc, "meta-llama/Llama-3.1-8B-Instruct")
        assert rejected.value.status == 429
        # The queue drained (the same page, its queue gauge at 0): routed to the pod.
        queued = 'sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2826.0'
        assert queued in real
        page.text = real.replace(queued, queued.replace("2826.0", "0.0"))
        await until(lambda: endpoint.metrics.waiting == 0.0, "the drained page scraped")
        assert route(svc, "meta-llama/Llama-3.1-8B-Instruct") == "pod-0"


async def test_a_triton_pool_is_scraped_on_its_metrics_port_and_routed_to(
    render_chart,  # noqa: F811
    tmp_path,
    standin,
):
    # Triton serves its metrics on their own port (8002 by default), not the inference
    # port the pool targets: the operator adds --model-server-metrics-port through the
    # chart's flags map, which renders it as `--model-server-metrics-port` `"<port>"`.
    metrics_port, target_port = free_port(), free_port()
    config = chart_config(
        render_chart, tmp_path, "triton-tensorrt-llm", {"model-server-metrics-port": metrics_port}
    )
    assert config.datalayer.metrics_port == metrics_port
    async with routed_pool(
        config, standin, Page(TRITON_PAGE.read_text()), target_port, metrics_port
    ) as svc:
        await until(lambda: svc.store.get("pod-0") is not None, "pod-0 discovered")
        endpoint = svc.store.get("pod-0")
        assert endpoint.metrics_url == f"http://{IP}:{metrics_port}/metrics"
        assert endpoint.address == f"{IP}:{target_port}"
        await until(lambda: endpoint.metrics is not None or endpoint.consecutive_failures > 2,
                    "pod-0 scraped")  # fmt: skip
        assert endpoint.metrics is not None, endpoint.last_error
        assert endpoint.metrics.kv_usage == pytest.approx(0.4875)
        await until(lambda: svc.ready, "ready")
        assert route(svc, "ensemble") == "pod-0"  # a pod of unknown model serves any


@pytest.mark.parametrize(
    ("key", "spec", "message"),
    [
        ("waiting_metric", "q{a!=b}", "only '=' label matchers"),
        ("kv_usage_metric", "kv{a=b", "must close with '}'"),
        ("running_metric", "9lives", "not a metric name"),
        ("cache_info_metric", 'c{a="x",a="y"}', "given twice"),
    ],
)
def test_a_bad_metric_spec_is_refused_at_load_naming_its_key(key, spec, message):
    with pytest.raises(ValueError, match=message) as refused:
        EppConfig.model_validate({"datalayer": {key: spec}})
    assert f"datalayer.{key}" in str(refused.value)
