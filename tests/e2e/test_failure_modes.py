"""The EPP failing or restarting, through a real Envoy: fail-open never lets a client pick
its pod, SIGTERM drains, and SIGKILL costs no request already routed (the routing stream
ends once the destination is sent)."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
from e2e.harness import chat_body, http, in_threads, rig, wait_for

from epp.envoy_config import render
from epp_harness.stack import HOST, free_ports

pytestmark = pytest.mark.e2e
SLOW_STREAMS = ["--decode-per-token-ms", "60"]  # 30 tokens: about 2 s per generation


class Listener:
    """A local ip:port that counts the connections it gets (a forged destination)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.address = f"{HOST}:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def envoy_without_epp(r, **kwargs):
    r.reserve_epp_ports()  # nothing listens there: the EPP is down
    listen, admin = free_ports(2)
    config = render(
        mode="epp", listen_port=listen, admin_port=admin, epp_port=r.epp_grpc_port,
        pods=r.pods, fail_open=True, body_mode="BUFFERED", **kwargs,
    )  # fmt: skip
    r.start_envoy(config, listen)


def test_fail_open_with_the_epp_down_balances_and_ignores_forged_destinations(tmp_path):
    forged_target = Listener()
    try:
        with rig(tmp_path) as r:
            r.start_pods(3)
            envoy_without_epp(r)
            served = []
            for forged in (forged_target.address, r.pods[2]) * 3:
                status, headers, _ = http(
                    f"{r.envoy_url}/v1/chat/completions",
                    chat_body("forged"),
                    {"x-gateway-destination-endpoint": forged, "x-epp-route-token": "x"},
                )
                assert status == 200
                served.append(headers["x-sim-pod"])
            # Envoy's own round robin, not the client's choice of pod-2.
            assert len(set(served)) == 3
        assert forged_target.connections == 0
    finally:
        forged_target.close()


def test_fail_open_original_dst_with_the_epp_down_is_503_never_the_clients_address(tmp_path):
    forged_target = Listener()
    try:
        with rig(tmp_path) as r:
            r.start_pods(1)
            envoy_without_epp(r, pod_cluster="original_dst")
            for forged in (forged_target.address, r.pods[0]):
                status, headers, _ = http(
                    f"{r.envoy_url}/v1/chat/completions",
                    chat_body("forged"),
                    {"x-gateway-destination-endpoint": forged},
                )
                assert status == 503 and "x-sim-pod" not in headers
        assert forged_target.connections == 0
    finally:
        forged_target.close()


def stream_generation(r, i: int) -> tuple[int, bool]:
    status, _, body = http(
        f"{r.envoy_url}/v1/chat/completions",
        chat_body(f"drain {i}", stream=True, max_tokens=30),
        timeout=60,
    )
    return status, body.decode().rstrip().endswith("data: [DONE]")


def start_generations(r, count: int) -> tuple[threading.Thread, list]:
    results: list = []
    before = r.epp_routed()
    thread = threading.Thread(
        target=lambda: results.extend(in_threads(count, lambda i: stream_generation(r, i)))
    )
    thread.start()
    # All routed (every routing stream done) before the EPP is hit.
    wait_for(lambda: r.epp_routed() >= before + count, what="routing")
    # ... and every generation running on a pod: Envoy has acted on each destination.
    wait_for(lambda: pods_in_flight(r) >= count, what="generations in flight on the pods")
    return thread, results


def pods_in_flight(r) -> float:
    """Requests the pods report running or waiting (their own vLLM metrics pages)."""
    total = 0.0
    for address in r.pods:
        for line in http(f"http://{address}/metrics", timeout=5)[2].decode().splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_sigterm_drains_while_in_flight_generations_complete(tmp_path):
    with rig(tmp_path) as r:
        r.start_pods(2, lambda i: SLOW_STREAMS)
        # Quiet for 3 s: the late request below has that long after readiness drops to
        # open its routing stream, even on a stalled machine; still far under the timeout.
        r.start_epp({"server": {"drain_timeout_s": 10, "drain_quiet_s": 3.0}})
        listen, admin = free_ports(2)
        r.start_envoy(
            render(
                mode="epp", listen_port=listen, admin_port=admin,
                epp_port=r.epp_grpc_port, pods=r.pods,
            ),
            listen,
        )  # fmt: skip
        thread, results = start_generations(r, 8)
        sent = time.monotonic()
        r.epp.signal(signal.SIGTERM)
        wait_for(lambda: r.epp_ready() == 503, timeout=2, what="readiness to drop")
        # Still routing while draining: a new request gets its pod.
        assert http(f"{r.envoy_url}/v1/chat/completions", chat_body("late"))[0] == 200
        assert r.epp.wait(15) == 0
        # Quiet for drain_quiet_s after the last routing stream, not the 10 s timeout.
        assert time.monotonic() - sent < 8
        thread.join()
        assert results == [(200, True)] * 8


def test_sigkill_costs_no_routed_generation_and_a_new_epp_routes_again(tmp_path):
    with rig(tmp_path) as r:
        r.start_pods(2, lambda i: SLOW_STREAMS)
        r.start_epp()
        listen, admin = free_ports(2)
        r.start_envoy(
            render(
                mode="epp", listen_port=listen, admin_port=admin,
                epp_port=r.epp_grpc_port, pods=r.pods,
            ),
            listen,
        )  # fmt: skip
        thread, results = start_generations(r, 8)
        r.epp.signal(signal.SIGKILL)
        thread.join()
        assert results == [(200, True)] * 8
        r.start_epp()  # same ports
        wait_for(
            lambda: http(f"{r.envoy_url}/v1/chat/completions", chat_body("again"))[0] == 200,
            timeout=10,
            what="routing through the new EPP",
        )
