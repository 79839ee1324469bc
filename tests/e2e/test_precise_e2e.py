"""Precise mode through the real stack: three simulated pods publishing vLLM KV events
over ZMQ, `epp serve` following them (kv_events.mode auto, per-pod endpoints from labels:
the pods share one host), and the real Envoy in front.

What the engines hold is read from the engines themselves (`GET /sim/kv` on each pod: its
block pool's cached hashes), never from the events, and compared block by block with what
the EPP's index holds for the pod (`GET /debug/index?pod=`: the engine hashes its events
stored). Prompts are token ids, so that the EPP's hashes and the engine's agree by
construction and the test is about the events, not about tokenization."""

from __future__ import annotations

import json
import random
import signal

import pytest
from e2e.harness import MODEL, Rig, http, rig, wait_for

from epp.envoy_config import render
from epp_harness.stack import HOST, free_ports

pytestmark = pytest.mark.e2e
PODS = 3
BLOCK = 16


def ids_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30_000) for _ in range(n)]


def complete(r: Rig, ids: list[int], url: str | None = None) -> str:
    """Send one completion (through Envoy by default); the pod that served it."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2}
    status, headers, text = http(f"{url or r.envoy_url}/v1/completions", body)
    assert status == 200, text[:300]
    return headers["x-sim-pod"]


def engine_blocks(address: str) -> set[str]:
    status, _, body = http(f"http://{address}/sim/kv", timeout=5)
    assert status == 200
    return set(json.loads(body)["blocks"])


def index_view(r: Rig, pod: str) -> dict:
    """The pod's /debug/index, every page of its engine blocks joined."""
    url = f"http://{HOST}:{r.epp_metrics_port}/debug/index?pod={pod}&limit=10000"
    status, _, body = http(url, timeout=5)
    if status != 200:
        return {"mode": None, "engine_blocks": []}
    view = json.loads(body)
    while "next" in view:
        status, _, body = http(f"{url}&after={view['next']}", timeout=5)
        assert status == 200
        page = json.loads(body)
        view = {**page, "engine_blocks": view["engine_blocks"] + page["engine_blocks"]}
    return view


def page_start_time(address: str) -> float:
    status, _, body = http(f"http://{address}/metrics", timeout=5)
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("process_start_time_seconds "):
            return float(line.split()[1])
    raise AssertionError("the pod's page has no process_start_time_seconds")


def epp_endpoint(r: Rig, name: str) -> dict:
    return {e["name"]: e for e in r.epp_endpoints()}[name]


def in_step(r: Rig, i: int) -> bool:
    view = index_view(r, f"pod-{i}")
    return view["mode"] == "precise" and set(view["engine_blocks"]) == engine_blocks(r.pods[i])


def all_in_step(r: Rig) -> bool:
    return all(in_step(r, i) for i in range(PODS))


def modes(r: Rig) -> dict[str, str]:
    return {e["name"]: e["index_mode"] for e in r.epp_endpoints()}


def start(r: Rig) -> list[int]:
    ports = free_ports(2 * PODS)
    r.start_pods(
        PODS,
        lambda i: [
            "--kv-events-port",
            str(ports[2 * i]),
            "--kv-replay-port",
            str(ports[2 * i + 1]),
        ],
    )
    r.start_epp(
        {
            "kv_events": {"mode": "auto", "reconnect_max_s": 0.5, "resync_timeout_s": 1.0},
            "prefix": {"block_size": BLOCK},
        },
        labels_for=lambda i: {
            "kv_events_endpoint": f"tcp://{HOST}:{ports[2 * i]}",
            "kv_events_replay": f"tcp://{HOST}:{ports[2 * i + 1]}",
        },
    )
    listen, admin = free_ports(2)
    config = render(
        mode="epp", listen_port=listen, admin_port=admin, epp_port=r.epp_grpc_port,
        pods=r.pods, body_mode="BUFFERED",
    )  # fmt: skip
    r.start_envoy(config, listen)
    wait_for(lambda: set(modes(r).values()) == {"precise"}, timeout=30, what="precise pods")
    return ports


def test_precise_index_equals_the_engines_routing_follows_and_a_restart_leaves_nothing(tmp_path):
    with rig(tmp_path) as r:
        start(r)
        # A workload through Envoy: 6 shared prefixes, 4 requests each with own suffixes.
        for turn in range(4):
            for group in range(6):
                complete(r, ids_of(group, 12 * BLOCK) + ids_of(1000 * turn + group, 40))
        wait_for(lambda: all_in_step(r), timeout=20, what="the index to equal the engines")
        assert all(index_view(r, f"pod-{i}")["engine_blocks"] for i in range(PODS))

        # Routing follows the engines' word: each pod is given a prefix directly (the EPP
        # never routed it, so only the pod's events can tell it), then a prompt that
        # continues it goes to that pod through Envoy.
        secrets = {f"pod-{i}": ids_of(5000 + i, 20 * BLOCK) for i in range(PODS)}
        for i, address in enumerate(r.pods):
            assert complete(r, secrets[f"pod-{i}"], f"http://{address}") == f"pod-{i}"
        wait_for(lambda: all_in_step(r), timeout=20, what="the directly served prefixes")
        for pod, prefix in secrets.items():
            for k in range(2):
                assert complete(r, prefix + ids_of(7000 + k, 24)) == pod

        # Kill pod-1 and start it on the same ports: it comes back with an empty cache, and
        # the EPP holds nothing of the old one for it.
        proc = r.procs[1]
        assert proc.name == "pod-1"
        proc.signal(signal.SIGKILL)
        proc.wait(5)
        wait_for(
            lambda: not index_view(r, "pod-1")["engine_blocks"], timeout=10, what="pod-1 dropped"
        )
        proc.start()
        wait_for(lambda: http(f"http://{r.pods[1]}/health", timeout=1)[0] == 200)
        # The EPP learns of the new process from its subscriber (the sequence went back)
        # and from the pod's page (a later start time), whichever comes first. The page
        # drops the entries again unless the subscriber's resync began more than
        # kv_subscriber's restart margin (3 s) after the new process started; the
        # simulator binds its publisher within a second of starting, so here it does.
        # Wait for the page, so that this drop cannot come after the new engine's first
        # blocks were indexed below, and so that pod-1 (scrapes failed while it was down)
        # is a routing candidate again.
        started = page_start_time(r.pods[1])
        wait_for(
            lambda: epp_endpoint(r, "pod-1")["start_time"] == started,
            timeout=30,
            what="the EPP to read the restarted pod's page",
        )
        wait_for(lambda: in_step(r, 1), timeout=30, what="pod-1 followed again")
        assert engine_blocks(r.pods[1]) == set()
        assert index_view(r, "pod-1")["engine_blocks"] == []
        # Its old prefix is no reason to go there now; the new engine's blocks are.
        fresh = ids_of(9000, 20 * BLOCK)
        assert complete(r, fresh, f"http://{r.pods[1]}") == "pod-1"
        wait_for(lambda: all_in_step(r), timeout=20, what="the index to equal the engines again")
        assert complete(r, fresh + ids_of(9001, 24)) == "pod-1"
        endpoints = {e["name"]: e for e in r.epp_endpoints()}
        assert endpoints["pod-1"]["kv_events"]["resyncs"] >= 2
        assert r.epp_metric('epp_kv_events_total{reason="blocks_stored"}') > 0
