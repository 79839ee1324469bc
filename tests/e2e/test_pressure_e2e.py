"""Behaviour under pressure through the real stack: real Envoy, real `epp serve`, real
simulated pods on 127.0.0.1. Bursts must be served, not refused; pods excluded for
errors must come back."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from epp_bench.picker.pressure import FAST_PODS, burst_prompts, fire, herd_prompts
from epp_harness.stack import LocalStack

pytestmark = pytest.mark.e2e
MODEL = "sim-llama-8b"


def test_the_spec_herd_and_a_200_burst_on_idle_pods_are_all_served(tmp_path):
    """A thundering herd (4 pods, max_queue 20, 50 concurrent requests of one new
    prefix) and 200 distinct requests at once: zero refused (before: 140 of 200 got 429,
    since every dispatch since the last scrape counted as queued)."""
    with LocalStack(
        pods=4,
        sim_args=FAST_PODS,
        epp_config_yaml="scheduling: {max_queue: 20}\n",
        work_dir=tmp_path,
        log_level="warning",
    ) as stack:
        herd = asyncio.run(fire(stack, "herd", herd_prompts(50)))
        burst = asyncio.run(fire(stack, "burst", burst_prompts(200)))
    assert dict(herd.statuses) == {200: 50}
    assert len(herd.per_pod) == 4  # spread: the other pods warm their caches in parallel
    assert max(herd.per_pod.values()) <= 20
    assert dict(burst.statuses) == {200: 200}
    assert len(burst.per_pod) == 4
    assert max(burst.per_pod.values()) - min(burst.per_pod.values()) <= 10


def _post(url: str, prompt: str, headers: dict[str, str] | None = None) -> int:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("content-type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _served_by(url: str, prompt: str) -> tuple[int, str]:
    """(status, the pod that answered: x-sim-pod)."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            return response.status, response.headers.get("x-sim-pod", "")
    except urllib.error.HTTPError as err:
        return err.code, ""


def _excluded(stack: LocalStack) -> set[str]:
    assert stack.epp_metrics_url is not None
    url = stack.epp_metrics_url.replace("/metrics", "/debug/endpoints")
    with urllib.request.urlopen(url, timeout=5) as response:
        return {e["name"] for e in json.loads(response.read()) if e["excluded"]}


def test_pods_excluded_for_5xx_answers_come_back(tmp_path):
    """One client's 100 requests that the pods answer with 500 exclude pods (seen on
    /debug/endpoints; at most half of them, the floor), other requests are served
    meanwhile, and the excluded pods come back and serve again once their error rate
    decays (before the decay, an excluded pod got no request whose success could lower
    its error rate, and never came back)."""
    with LocalStack(pods=4, sim_args=FAST_PODS, work_dir=tmp_path, log_level="warning") as stack:
        url = f"{stack.envoy_url}/v1/completions"
        failing = [_post(url, f"bad {i} " * 20, {"x-sim-fail": "500"}) for i in range(100)]
        assert failing.count(500) >= 20  # the pods failed them
        excluded = _excluded(stack)  # read at once: readmission takes seconds
        assert excluded, "the pods' 500s excluded no pod"
        assert len(excluded) <= 2  # scheduling.max_error_exclusion_share: 0.5 of 4
        started = time.monotonic()
        during: list[tuple[int, str]] = []
        still_out = excluded
        while still_out:
            assert time.monotonic() - started < 20, f"never readmitted: {still_out}"
            status, pod = _served_by(url, f"meanwhile {len(during)} " * 20)
            during.append((status, pod))
            # Nothing fails any more, so the excluded set only shrinks: a pod excluded
            # after the request was excluded when it was routed.
            still_out = _excluded(stack)
            assert pod not in still_out, f"{pod} excluded but routed to"
            time.sleep(0.05)
        readmitted_after = time.monotonic() - started
        # Back in rotation: a burst spreads over every pod, the readmitted ones included
        # (one request at a time would go to the pods of full health, which score higher).
        after = asyncio.run(fire(stack, "after", burst_prompts(100)))
    assert {status for status, _ in during} <= {200}, during
    # The decay model (datalayer/health.py) readmits within about 10 s of the last error.
    assert readmitted_after < 15
    assert dict(after.statuses) == {200: 100}
    assert excluded <= set(after.per_pod), after.per_pod


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_a_request_waiting_in_admission_outlives_envoys_message_timeout(tmp_path, body_mode):
    """The generated config's message_timeout is 5 s; a request held 7 s in the EPP's
    admission queue must still be served (the EPP re-arms Envoy's timer once)."""
    config = "scheduling: {max_queue: 1, running_slots: 1}\n"
    slow = ["--decode-per-token-ms", "100", "--prefill-per-token-ms", "0.01"]
    with LocalStack(
        pods=1, body_mode=body_mode, sim_args=slow, epp_config_yaml=config, work_dir=tmp_path
    ) as stack:
        url = f"{stack.envoy_url}/v1/completions"
        results: dict[str, tuple[int, float]] = {}

        def send(key: str, prompt: str, max_tokens: int) -> None:
            started = time.monotonic()
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
            request = urllib.request.Request(url, data=body.encode(), method="POST")
            request.add_header("content-type", "application/json")
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                    results[key] = (response.status, time.monotonic() - started)
            except urllib.error.HTTPError as err:
                results[key] = (err.code, time.monotonic() - started)

        holders = [
            threading.Thread(target=send, args=(f"hold{i}", f"hold {i} " * 10, 80))
            for i in range(2)
        ]
        # Each holder in flight on the pod before the next request, and the EPP's view of
        # the pod full (a page showing the second holder queued) before the waiter: a page
        # fetched after a dispatch but before the request reached the pod would otherwise
        # leave room for the waiter on a loaded machine.
        for count, thread in enumerate(holders, start=1):
            thread.start()
            _wait_until(lambda n=count: _pod_in_flight(stack) >= n, f"{count} holders on the pod")
        _wait_until(lambda: _epp_queue_depth(stack) >= 1, "the EPP seeing the pod's queue")
        send("waiter", "waiter " * 10, 2)
        for thread in holders:
            thread.join()
    status, waited = results["waiter"]
    assert status == 200
    assert waited > 5.5  # it really waited past the message timeout


def _pod_in_flight(stack: LocalStack) -> float:
    """Requests the pods report running or waiting on their own vLLM metrics pages."""
    total = 0.0
    for pod in stack.pods:
        with urllib.request.urlopen(pod.metrics_url, timeout=5) as response:
            page = response.read().decode()
        for line in page.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _epp_queue_depth(stack: LocalStack) -> float:
    """The EPP's queue depth of the pods (epp_queue_depth), from its metrics page."""
    assert stack.epp_metrics_url is not None
    with urllib.request.urlopen(stack.epp_metrics_url, timeout=5) as response:
        page = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("epp_queue_depth{")
    )
