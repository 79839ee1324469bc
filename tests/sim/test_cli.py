"""`epp sim` as a real process: announces its address, serves, exits 0 on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import pytest

from epp.sim.cli import build_parser, config_from_args, main


def test_flags_map_to_the_engine_in_seconds() -> None:
    args = build_parser().parse_args(
        ["--lora-adapters", " a, b,,a ", "--prefill-per-token-ms", "0.5", "--max-num-seqs", "3"]
    )
    config = config_from_args(args)
    assert config.model == "sim-llama-8b"
    assert config.lora_adapters == ("a", "b")
    assert config.engine.prefill_per_token_s == pytest.approx(0.0005)
    assert config.engine.max_num_seqs == 3


@pytest.mark.parametrize(
    "argv",
    [["--max-num-seqs", "0"], ["--time-scale", "0"], ["--model", "a", "--lora-adapters", "a"]],
)
def test_nonsense_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "epp sim: error:" in capsys.readouterr().err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serves_until_signalled(signum: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "epp", "sim", "--port", "0", "--name", "pod-cli"],
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
