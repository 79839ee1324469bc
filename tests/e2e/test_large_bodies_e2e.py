"""Large bodies through a real Envoy, the real EPP process and simulated vLLM pods, in both
body modes: a 5 MB chat with one base64 image is routed (the default limit takes it) to
the pod its text is cached on, and a body over the limit gets the EPP's 413 without the
EPP holding it (the EPP process's peak RSS, VmHWM, reset before the request: Linux's
/proc/PID/clear_refs)."""

from __future__ import annotations

import base64
import http.client
import json
import random
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from epp_harness.stack import LocalStack

pytestmark = pytest.mark.e2e
MODEL = "sim-llama-8b"
FAST_PODS = ["--prefill-per-token-ms", "0.01", "--decode-per-token-ms", "0.2"]
MIB = 1024 * 1024
SYSTEM = "You describe photographs for a museum catalogue, carefully and briefly. " * 60
QUESTION = "What is in this picture?"


def send(stack: LocalStack, body: bytes, piece: int = MIB) -> tuple[int, dict[str, str], bytes]:
    """POST with Content-Length, the body in pieces; a refusal may come before the upload
    ends (the gateway then stops reading): the answer is read all the same."""
    url = urlsplit(stack.envoy_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(len(body)))
        conn.endheaders()
        try:
            for i in range(0, len(body), piece):
                conn.send(body[i : i + piece])
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def chat_body(parts: list[dict]) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode()


def image_part(size: int) -> dict:
    data = base64.b64encode(random.Random(5).randbytes(size * 3 // 4)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def routed_tokens(stack: LocalStack, request_id: str) -> int:
    for line in Path(stack.log_paths["epp"]).read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "request_routed" and entry.get("request_id") == request_id:
            return int(entry["input_tokens"])
    raise AssertionError(f"no request_routed line for {request_id}")


def peak_rss_reset(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def status_bytes(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


MODES = ["FULL_DUPLEX_STREAMED", "BUFFERED"]


@pytest.fixture(scope="module", params=MODES)
def stack(request, tmp_path_factory) -> Iterator[LocalStack]:
    """The EPP with its default configuration."""
    with LocalStack(
        pods=3,
        sim_args=FAST_PODS,
        body_mode=request.param,
        work_dir=tmp_path_factory.mktemp(request.param.lower()),
    ) as s:
        yield s


@pytest.mark.parametrize("mode", MODES)
def test_a_body_over_the_limit_gets_413_without_being_held(mode, tmp_path):
    """24 MiB over a 16 MiB limit (under the generated Envoy's 32 MiB buffer, which would
    answer a BUFFERED body past it itself): the EPP refuses it at its Content-Length.
    Before, it buffered the body up to the limit (duplex) or whole (BUFFERED) first."""
    limit = "server:\n  max_body_bytes: 16777216\n"
    with LocalStack(
        pods=1, sim_args=FAST_PODS, body_mode=mode, epp_config_yaml=limit, work_dir=tmp_path
    ) as small:
        pid = small.pids["epp"]
        body = chat_body([{"type": "text", "text": "x" * (24 * MIB)}])
        peak_rss_reset(pid)
        before = status_bytes(pid, "VmRSS")
        status, headers, answer = send(small, body)
        grown = status_bytes(pid, "VmHWM") - before
    assert status == 413, answer[:300]
    assert headers.get("x-request-dropped-reason") == "rejected-body-too-large"
    assert "16777216" in json.loads(answer)["error"]["message"]
    assert grown < 8 * MIB, f"the EPP's peak RSS grew {grown / MIB:.0f} MiB for a refused body"


def test_a_5mb_chat_with_one_image_is_routed_where_its_text_is_cached(stack):
    text_only = chat_body([{"type": "text", "text": QUESTION}])
    pods = set()
    for _ in range(3):
        status, headers, answer = send(stack, text_only)
        assert status == 200, answer[:300]
        pods.add(headers["x-sim-pod"])
        text_tokens = routed_tokens(stack, headers["x-epp-request-id"])
    assert len(pods) == 1
    with_image = chat_body([{"type": "text", "text": QUESTION}, image_part(5 * 1000 * 1000)])
    assert len(with_image) > 5 * 1000 * 1000
    status, headers, answer = send(stack, with_image)
    assert status == 200, answer[:300]
    # The text before the image hashes as without it: the same pod, where it is cached.
    assert headers["x-sim-pod"] in pods
    # The image counts as its stand-in (a few tokens), not as 5 MB of text.
    assert routed_tokens(stack, headers["x-epp-request-id"]) - text_tokens < 40
