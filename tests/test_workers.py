"""`server.workers` planning (epp/serving/workers.py) and SO_REUSEPORT only above one
worker: in process, no process started (the processes: tests/test_workers_e2e.py)."""

from __future__ import annotations

import socket

import pytest

from epp.app import config_from_args, parse_serve_args
from epp.config import EppConfig
from epp.extproc.server import HealthState, build_health_server
from epp.serving.workers import WorkersError, metrics_ports, plan_workers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(**server: object) -> EppConfig:
    return EppConfig.model_validate({"server": {"grpc_host": "127.0.0.1", **server}})


def test_the_flag_sets_the_setting_and_one_worker_is_the_default():
    args, upstream = parse_serve_args(["--workers", "3"])
    assert config_from_args(args, upstream).server.workers == 3
    args, upstream = parse_serve_args([])
    assert config_from_args(args, upstream).server.workers == 1


def test_metrics_ports_skip_the_other_ports_of_the_node():
    config = EppConfig.model_validate({"server": {"workers": 3}})  # debug 9091, gRPC 9002/9003
    assert metrics_ports(config) == [9090, 9092, 9093]
    zero = EppConfig.model_validate({"server": {"workers": 2, "metrics_port": 0}})
    assert metrics_ports(zero) == [0, 0]


def test_the_plan_shares_one_port_and_makes_the_workers_each_others_peers():
    plan = plan_workers(_config(workers=2, grpc_port=0, grpc_health_port=0, metrics_port=0))
    try:
        first, second = plan.configs
        # Port 0 is made concrete once: both workers bind the same port.
        assert first.server.grpc_port == second.server.grpc_port != 0
        assert first.server.grpc_health_port == second.server.grpc_health_port != 0
        assert first.server.debug_port == 9091 and second.server.debug_port is None
        a, b = first.replicas, second.replicas
        assert a.peers == [f"127.0.0.1:{b.listen_port}"]
        assert b.peers == [f"127.0.0.1:{a.listen_port}"]
        assert a.listen_host == b.listen_host == "127.0.0.1"
        assert a.secret_file == b.secret_file and a.secret_file is not None
        assert a.secret_file.stat().st_mode & 0o077 == 0
        assert len(a.secret_file.read_text()) >= 16
        secret = a.secret_file
    finally:
        plan.close()
    assert not secret.exists()


def test_without_sharing_the_workers_have_no_peers():
    plan = plan_workers(_config(workers=2, grpc_port=0, grpc_health_port=0, worker_sharing=False))
    plan.close()
    assert [c.replicas.peers for c in plan.configs] == [[], []]
    assert plan.secret_dir is None


def test_a_port_in_use_fails_the_plan_in_one_line():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError, match=rf"127.0.0.1:{port} for ext_proc.*in use"):
            plan_workers(_config(workers=2, grpc_port=port, grpc_health_port=0))


def test_workers_with_remote_peers_are_refused():
    config = EppConfig.model_validate(
        {"server": {"workers": 2}, "replicas": {"peers": ["10.0.0.1:9010"]}}
    )
    with pytest.raises(WorkersError, match=r"replicas\.peers"):
        plan_workers(config)


@pytest.mark.parametrize(("workers", "shared"), [(1, False), (2, True)])
async def test_so_reuseport_only_above_one_worker(workers: int, shared: bool):
    """One process: a second server on its port fails (the loud clash kept); workers:
    both bind it."""
    port = _free_port()
    config = _config(workers=workers, grpc_health_port=port).server
    first, _ = build_health_server(HealthState(), config)
    try:
        if shared:
            second, bound = build_health_server(HealthState(), config)
            assert bound == port
            await second.stop(None)
        else:
            with pytest.raises(OSError, match="in use"):
                build_health_server(HealthState(), config)
    finally:
        await first.stop(None)
