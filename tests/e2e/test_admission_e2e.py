"""Admission through a real Envoy (issue 15, finding 5): a request whose subset hint names
only a saturated pod waits in the EPP, and a request that may use another pod is served
meanwhile, instead of waiting behind it until the saturated pod frees up.

The subset hint reaches the EPP as a gateway sends it: Envoy dynamic metadata in the
`envoy.lb.subset_hint` namespace, forwarded to ext_proc (`metadata_options.
forwarding_namespaces`). Here Envoy's own header_to_metadata filter sets it from a test
header, standing in for the gateway that would compute it (GKE's, for instance)."""

from __future__ import annotations

import threading
import time

import pytest
import yaml
from e2e.harness import HOST, chat_body, http, rig, wait_for

from epp.envoy_config import render
from epp_harness.stack import free_ports

pytestmark = pytest.mark.e2e
SLOW = ["--decode-per-token-ms", "100"]  # 40 tokens: about 4 s per generation
HINT_HEADER = "x-test-subset"


def envoy_forwarding_subset_hints(r) -> None:
    listen, admin = free_ports(2)
    config = yaml.safe_load(
        render(mode="epp", listen_port=listen, admin_port=admin, epp_port=r.epp_grpc_port,
               pods=r.pods)
    )  # fmt: skip
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = manager["http_filters"]
    routing = filters[0]["typed_config"]
    assert (
        filters[0]["name"] == "envoy.filters.http.ext_proc" and "observability_mode" not in routing
    )
    routing["metadata_options"]["forwarding_namespaces"] = {"untyped": ["envoy.lb.subset_hint"]}
    filters.insert(
        0,
        {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "request_rules": [
                    {
                        "header": HINT_HEADER,
                        "on_header_present": {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "key": "x-gateway-destination-endpoint-subset",
                            "type": "STRING",
                        },
                        "remove": True,
                    }
                ],
            },
        },
    )
    r.start_envoy(yaml.safe_dump(config), listen)


def pod_gauge(r, name: str, pod: str) -> float:
    _, _, page = http(f"http://{HOST}:{r.epp_metrics_port}/metrics", timeout=5)
    prefix = f'{name}{{pod="{pod}"}} '
    for line in page.decode().splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_hinted_to_a_saturated_pod_delays_no_request_for_another_pod(tmp_path):
    with rig(tmp_path) as r:
        r.start_pods(2, lambda i: SLOW if i == 0 else [])
        r.start_epp(
            {"scheduling": {"max_queue": 1, "running_slots": 1}, "flow_control": {"ttl_s": 30}}
        )
        envoy_forwarding_subset_hints(r)
        url = f"{r.envoy_url}/v1/chat/completions"
        only_pod0 = {HINT_HEADER: r.pods[0]}
        ended: dict[str, tuple[int, str | None, float]] = {}

        def send(name: str, headers: dict | None, max_tokens: int) -> None:
            status, answer, _ = http(url, chat_body(name, max_tokens=max_tokens), headers, 60)
            ended[name] = (status, answer.get("x-sim-pod"), time.monotonic())

        def start(name: str, headers: dict | None, max_tokens: int) -> threading.Thread:
            thread = threading.Thread(target=send, args=(name, headers, max_tokens))
            thread.start()
            return thread

        threads = [start(f"held-{i}", only_pod0, 40) for i in range(2)]
        wait_for(
            lambda: pod_gauge(r, "epp_pod_in_flight_requests", "pod-0") == 2,
            what="pod-0 saturated by two hinted generations",
        )
        threads.append(start("hinted", only_pod0, 2))
        wait_for(lambda: r.epp_metric("epp_flow_control_queue_size") == 1, what="one waiting")
        send("free", None, 2)  # any pod: pod-1 is idle
        free_status, free_pod, _ = ended["free"]
        still_running = {"held-0", "held-1", "hinted"} - set(ended)
        for thread in threads:
            thread.join(60)
    assert (free_status, free_pod) == (200, "pod-1")
    # It did not wait for pod-0 to free up (before: it waited behind "hinted", which
    # waited for a held generation to end).
    assert still_running == {"held-0", "held-1", "hinted"}
    assert {name: ended[name][:2] for name in ("held-0", "held-1", "hinted")} == {
        "held-0": (200, "pod-0"),
        "held-1": (200, "pod-0"),
        "hinted": (200, "pod-0"),
    }
