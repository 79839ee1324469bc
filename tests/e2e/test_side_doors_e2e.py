"""Side doors, end to end through the real Envoy, the real EPP process and simulated pods.

- Request trailers (an HTTP/2 client; Envoy's HTTP/1 codec drops them by default): in
  BUFFERED mode the body message has end_of_stream false and the trailers come only after
  it is answered, so an EPP waiting for end_of_stream never routed it (504 at Envoy's
  message_timeout). Both body modes, both request trailer modes.
- The InferenceObjective header, which sets a request's priority: the generated Envoy
  removes it before any filter (so before the EPP) unless --keep-objective-headers.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.h2c import H2Response, post_with_trailers

from epp.datalayer.discovery.models import OBJECTIVE_HEADERS
from epp.envoy_config import render
from epp_harness.stack import HOST, LocalStack, envoy_binary, free_ports

pytestmark = pytest.mark.e2e
MODEL = "sim-llama-8b"
FAST_PODS = ["--prefill-per-token-ms", "0.01", "--decode-per-token-ms", "0.2"]
CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()
# Well under Envoy's message_timeout (5 s in the generated configs), which a request the
# EPP never routes runs into.
TRAILERS_TIMEOUT_S = 4.0


def routed_count(stack: LocalStack) -> int:
    lines = Path(stack.log_paths["epp"]).read_text().splitlines()
    return sum('"request_routed"' in line for line in lines)


def wait_routed(stack: LocalStack, count: int) -> bool:
    # The decision's log line may be written a moment after the answer; a generous
    # deadline on that positive signal costs nothing when it comes.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if routed_count(stack) >= count:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def envoy_like(stack: LocalStack, change: Callable[[dict[str, Any]], None]) -> Iterator[int]:
    """A second Envoy with the stack's configuration as `change` alters it: its port."""
    assert stack.work_dir is not None
    config = yaml.safe_load((stack.work_dir / "envoy.yaml").read_text())
    listen, admin = free_ports(2)
    config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listen
    config["admin"]["address"]["socket_address"]["port_value"] = admin
    change(config)
    path = stack.work_dir / f"envoy-{listen}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (stack.work_dir / f"envoy-{listen}.log").open("w")
    argv = [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    child = subprocess.Popen([*argv, "--log-level", "warning"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert child.poll() is None, (stack.work_dir / f"envoy-{listen}.log").read_text()
            with contextlib.suppress(OSError):
                import urllib.request

                with urllib.request.urlopen(f"http://{HOST}:{admin}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            assert time.monotonic() < deadline, "the second Envoy did not become ready"
            time.sleep(0.05)
        yield listen
    finally:
        child.terminate()
        child.wait(10)
        log.close()


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def trailer_mode(mode: str) -> Callable[[dict[str, Any]], None]:
    def change(config: dict[str, Any]) -> None:
        ext_proc = _hcm(config)["http_filters"][0]["typed_config"]
        ext_proc["processing_mode"]["request_trailer_mode"] = mode

    return change


def no_route_retries(config: dict[str, Any]) -> None:
    _hcm(config)["route_config"]["virtual_hosts"][0]["routes"][0]["route"].pop("retry_policy")


def chat_with_trailers(port: int, body: bytes = CHAT) -> H2Response:
    return post_with_trailers(
        HOST,
        port,
        "/v1/chat/completions",
        body,
        [("content-type", "application/json")],
        [("x-client-checksum", "abc")],
        TRAILERS_TIMEOUT_S,
    )


def assert_routed_200(stack: LocalStack, port: int) -> None:
    before = routed_count(stack)
    response = chat_with_trailers(port)
    assert response.status == 200, (response, "a 504 after ~5 s: never routed")
    assert json.loads(response.body)["choices"], response.body[:200]
    assert wait_routed(stack, before + 1), "the pod answered without the EPP's decision"


@pytest.fixture(scope="module")
def buffered(tmp_path_factory) -> Iterator[LocalStack]:
    work = tmp_path_factory.mktemp("buffered-trailers")
    with LocalStack(pods=2, sim_args=FAST_PODS, body_mode="BUFFERED", work_dir=work) as s:
        yield s


def test_buffered_request_with_trailers_is_routed(buffered: LocalStack):
    """The generated BUFFERED configuration (request trailers SEND)."""
    port = int(buffered.envoy_url.rsplit(":", 1)[1])
    assert_routed_200(buffered, port)


def test_buffered_request_with_trailers_is_routed_when_trailers_are_skipped(buffered):
    """A gateway configured with request_trailer_mode SKIP (the old generated default)."""
    with envoy_like(buffered, trailer_mode("SKIP")) as port:
        assert_routed_200(buffered, port)


def test_buffered_body_less_request_with_trailers_gets_the_epps_400(buffered):
    """No body message comes; with trailers SEND the EPP answers instead of a pod Envoy
    picks without a decision (what SKIP does: that request reaches some pod)."""
    port = int(buffered.envoy_url.rsplit(":", 1)[1])
    response = chat_with_trailers(port, b"")
    assert response.status == 400, response
    assert b"only trailers" in response.body, response.body[:200]


def test_duplex_request_with_trailers_is_routed_once(tmp_path):
    """FULL_DUPLEX_STREAMED: the EPP routes when the trailers come and answers the body
    (end_of_stream false) then the trailers. Envoy 1.40 forwards a body injected this way
    twice when the route has a retry policy (envoyproxy/envoy#45470; the generated
    configuration has one): shown below, so that a fixed Envoy is noticed."""
    with LocalStack(pods=2, sim_args=FAST_PODS, work_dir=tmp_path) as stack:
        with envoy_like(stack, no_route_retries) as port:
            assert_routed_200(stack, port)
        port = int(stack.envoy_url.rsplit(":", 1)[1])
        response = chat_with_trailers(port)
        assert response.status == 400 and b"Extra data" in response.body, (
            "Envoy no longer forwards the body twice: update docs/reliability.md (Side doors)",
            response,
        )


def echo_objectives(keep: bool) -> Callable[[dict[str, Any]], None]:
    """The route answers with the objective headers as every filter (the EPP too) saw
    them; `keep`: the early header mutation of a config rendered with
    --keep-objective-headers."""

    def change(config: dict[str, Any]) -> None:
        hcm = _hcm(config)
        if keep:
            kept = yaml.safe_load(
                render(
                    mode="epp", listen_port=1, admin_port=2, epp_port=3,
                    pods=["127.0.0.1:4"], keep_objective_headers=True,
                )
            )  # fmt: skip
            hcm["early_header_mutation_extensions"] = _hcm(kept)["early_header_mutation_extensions"]
        echo = [
            {"header": {"key": f"seen-{name}", "value": f"%REQ({name})%"}}
            for name in OBJECTIVE_HEADERS
        ]
        hcm["route_config"]["virtual_hosts"][0]["response_headers_to_add"] += echo

    return change


def seen_objectives(port: int) -> dict[str, str]:
    import urllib.request

    request = urllib.request.Request(f"http://{HOST}:{port}/v1/chat/completions", data=CHAT)
    request.add_header("content-type", "application/json")
    for name in OBJECTIVE_HEADERS:
        request.add_header(name, "premium")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        return {name: response.headers.get(f"seen-{name}", "") for name in OBJECTIVE_HEADERS}


def test_client_objective_headers_are_removed_before_the_epp_unless_kept(tmp_path):
    with LocalStack(pods=1, sim_args=FAST_PODS, work_dir=tmp_path) as stack:
        with envoy_like(stack, echo_objectives(keep=False)) as port:
            assert seen_objectives(port) == dict.fromkeys(OBJECTIVE_HEADERS, "")
        with envoy_like(stack, echo_objectives(keep=True)) as port:
            assert seen_objectives(port) == dict.fromkeys(OBJECTIVE_HEADERS, "premium")
