"""LocalStack(kv_events=True): every pod gets KV-event and replay ports of its own, passed
to the simulator and named in the EPP's endpoint labels (pods on one host cannot share the
templated :5557). Planning only; tests/epp_bench/test_precise_live.py runs such a stack."""

from __future__ import annotations

import yaml

from epp_harness.stack import HOST, LocalStack, PodInfo


def _port(endpoint: str | None) -> str:
    assert endpoint is not None and endpoint.startswith(f"tcp://{HOST}:")
    return endpoint.rpartition(":")[2]


def test_each_pod_gets_its_own_event_and_replay_ports() -> None:
    stack = LocalStack(pods=3, kv_events=True, sim_args=["--num-gpu-blocks", "64"])
    pods = stack.plan_pods()
    assert [p.name for p in pods] == ["pod-0", "pod-1", "pod-2"]
    ports = [p.address.rpartition(":")[2] for p in pods]
    ports += [_port(p.kv_events_endpoint) for p in pods]
    ports += [_port(p.kv_replay_endpoint) for p in pods]
    assert len(set(ports)) == 9
    argv = stack.pod_argv(pods[1])
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--kv-events-port"] == _port(pods[1].kv_events_endpoint)
    assert flags["--kv-replay-port"] == _port(pods[1].kv_replay_endpoint)
    assert argv[-2:] == ["--num-gpu-blocks", "64"]  # the caller's flags come last, and win


def test_endpoint_labels_tell_the_epp_where_each_pods_events_are() -> None:
    stack = LocalStack(pods=2, kv_events=True)
    stack.pods = stack.plan_pods()
    endpoints = yaml.safe_load(stack.endpoints_yaml())["endpoints"]
    for entry, pod in zip(endpoints, stack.pods, strict=True):
        assert entry["name"] == pod.name and entry["address"] == pod.address
        assert entry["labels"] == {
            "kv_events_endpoint": pod.kv_events_endpoint,
            "kv_events_replay": pod.kv_replay_endpoint,
        }


def test_without_kv_events_pods_publish_nothing_and_have_no_labels() -> None:
    stack = LocalStack(pods=2)
    pods = stack.plan_pods()
    assert all(p.kv_events_endpoint is None and p.labels == {} for p in pods)
    assert "--kv-events-port" not in stack.pod_argv(pods[0])
    assert PodInfo("p", "127.0.0.1:1").labels == {}
