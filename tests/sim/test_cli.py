"""`epp sim` as a real process: announces its address, serves, exits 0 on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from vllm_sim.cli import build_parser, config_from_args, main
from vllm_sim.failures import FailureConfig, FailureKind
from vllm_sim.kv_publisher import KvEventsConfig


def test_flags_map_to_the_engine_in_seconds() -> None:
    args = build_parser().parse_args(
        [
            "--lora-adapters", " a, b,,a ", "--prefill-per-token-ms", "0.5",
            "--max-num-seqs", "3", "--max-num-batched-tokens", "8192",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.engine.max_num_batched_tokens == 8192
    assert config.model == "sim-llama-8b"
    assert config.lora_adapters == ("a", "b")
    assert config.engine.prefill_per_token_s == pytest.approx(0.0005)
    assert config.engine.max_num_seqs == 3


def test_lora_adapters_take_ranks() -> None:
    args = build_parser().parse_args(["--lora-adapters", "sql:64, chat ,sql:64,tiny:8"])
    config = config_from_args(args)
    assert config.lora_adapters == ("sql", "chat", "tiny")
    assert dict(config.lora_ranks) == {"sql": 64, "tiny": 8}
    assert config.lora_enabled
    assert not config_from_args(build_parser().parse_args([])).lora_enabled
    assert config_from_args(build_parser().parse_args(["--enable-lora"])).lora_enabled


def test_kv_event_and_failure_flags() -> None:
    args = build_parser().parse_args(
        [
            "--kv-events-port", "5557", "--kv-replay-port", "5558",
            "--kv-replay-buffer", "50", "--kv-events-topic", "kv@x",
            "--failure-rate", "0.25", "--failure-kinds", "500,hang", "--seed", "3",
            "--metrics-delay-ms", "1500",
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.kv_events == KvEventsConfig(
        port=5557, replay_port=5558, host="127.0.0.1", topic="kv@x", replay_buffer=50
    )
    assert config.failures == FailureConfig(
        rate=0.25,
        kinds=(FailureKind.INTERNAL_ERROR, FailureKind.HANG),
        seed=3,
        metrics_delay_s=1.5,
    )
    plain = config_from_args(build_parser().parse_args([]))
    assert (plain.kv_events, plain.failures) == (None, FailureConfig())


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-seqs", "0"],
        ["--time-scale", "0"],
        ["--model", "a", "--lora-adapters", "a"],
        ["--lora-adapters", "a:x"],
        ["--lora-adapters", "a:0"],
        ["--lora-adapters", "a:16,a:64"],
        ["--lora-adapters", ":16"],
        ["--kv-replay-port", "5558"],
        ["--kv-events-port", "70000"],
        ["--failure-rate", "2"],
        ["--failure-kinds", "418"],
        ["--failure-kinds", "slow-metrics"],
        ["--metrics-delay-ms", "-5"],
        ["--preset", "gpt-5"],
    ],
)
def test_nonsense_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "epp sim: error:" in capsys.readouterr().err


def test_help_documents_the_failure_switches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for needle in (
        "x-sim-fail: 429|500|503|hang|drop|slow-metrics",
        "POST /sim/fail",
        "--failure-rate",
        "--metrics-delay-ms",
        "/v1/load_lora_adapter",
        "--kv-events-port",
        "llama-70b-h100",
    ):
        assert needle in text


@pytest.mark.e2e  # starts the simulator as a process
def test_announces_kv_event_endpoints() -> None:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vllm_sim", "--port", "0", "--model", "m",
            "--kv-events-port", "0", "--kv-replay-port", "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        announcement = json.loads(proc.stderr.readline())
        port = announcement["url"].rsplit(":", 1)[1]
        kv = announcement["kv_events"]
        assert kv["topic"] == f"kv@127.0.0.1:{port}@m"
        assert kv["endpoint"].startswith("tcp://127.0.0.1:")
        assert kv["replay_endpoint"].startswith("tcp://127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.e2e  # starts the simulator as a process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serves_until_signalled(signum: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_sim", "--port", "0", "--name", "pod-cli"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        announcement = json.loads(proc.stderr.readline())
        assert announcement["event"] == "sim listening"
        with urllib.request.urlopen(announcement["url"] + "/health", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["x-sim-pod"] == "pod-cli"
        proc.send_signal(signum)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
