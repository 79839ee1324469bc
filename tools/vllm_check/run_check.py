"""Start real vLLM (CPU) and/or the simulator (`python -m vllm_sim`), run the same workload on
each, save the captures.

    .venv/bin/python tools/vllm_check/run_check.py --target both
    .venv/bin/python tools/vllm_check/compare.py

One server at a time, each in its own process group, always stopped (SIGTERM to the
group, SIGKILL after a grace period) on success, failure or Ctrl-C. Everything binds
127.0.0.1; ports are picked free at start. Waits are bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from capture import capture, http
from vllm_server import MODEL_DIR, MODEL_NAME, VLLM_PYTHON, VLLM_VENV, server_argv, server_env

ROOT = Path(__file__).resolve().parents[2]
OUT_DIR = ROOT / "docs" / "benchmarks" / "sim-vs-vllm"
LOG_DIR = ROOT / ".bench" / "vllm-check-logs"
# The simulated pod (the vllm_sim package; `epp sim` runs the same), with this interpreter,
# which is the project venv's.
SIM_COMMAND = (sys.executable, "-m", "vllm_sim")
# vLLM's CPU attention backend only takes blocks that are a multiple of 32 tokens
# ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), and the CPU platform
# defaults to 128; 32 is the closest to the GPU default (16). The sim runs with the same.
BLOCK_SIZE = 32
# Small on purpose: the long prompt must push earlier blocks out. vLLM holds one of these
# back as its null block, so 39 are usable; max_model_len must fit in them.
NUM_BLOCKS = 40
MAX_MODEL_LEN = 1024
LONG_PROMPT_TOKENS = 900


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GroupRss:
    """Peak resident memory of a whole process group, sampled once a second."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) != self.pgid:  # field 5 (pgrp), after pid and comm
                    continue
                with open(f"/proc/{entry}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
            except (OSError, IndexError, ValueError):
                continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.peak_kb = max(self.peak_kb, self.sample())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)


@contextlib.contextmanager
def process_group(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # Children (vLLM's engine core) can outlive the leader: sweep the group either way.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode} before healthy:\n{tail}")
        try:
            if http("GET", base + "/health", timeout=2)[0] == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{base} not healthy after {timeout_s:.0f} s (log: {log})")


def vllm_version() -> str:
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout.strip() or out.stderr.strip()[-200:]


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_VENV} missing: run tools/vllm_check/setup_venv.sh first")
    if not (MODEL_DIR / "config.json").exists():
        raise SystemExit(f"{MODEL_DIR} missing: run tools/vllm_check/build_model.py first")
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    topic = f"kv@127.0.0.1:{port}@{MODEL_NAME}"
    kv_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # Not a wildcard, so vLLM's PUB *connects* here and our SUB binds (127.0.0.1 only).
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": topic,
    }
    cmd = server_argv(
        port,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=MAX_MODEL_LEN,
        kv_events=json.dumps(kv_config),
        extra=args.vllm_arg,
    )
    env = server_env()
    base = f"http://127.0.0.1:{port}"
    log = LOG_DIR / "vllm.log"
    print(f"starting vLLM on {base} (log {log})", flush=True)
    version = vllm_version()
    started = time.monotonic()
    with process_group(cmd, env, log) as proc:
        rss = GroupRss(proc.pid)
        try:
            ready_s = wait_healthy(base, proc, args.start_timeout, log)
            print(f"vLLM healthy after {ready_s:.0f} s", flush=True)
            meta = {
                "server": f"vllm {version}",
                "command": _redact(cmd),
                "env": {k: env[k] for k in sorted(env) if k.startswith(("VLLM_", "HF_"))},
                "startup_s": round(ready_s, 1),
                "block_size": args.block_size,
                "num_gpu_blocks": args.num_blocks,
                "kv_events_config": kv_config,
            }
            result = capture(
                base,
                MODEL_NAME,
                target="vllm",
                long_prompt_tokens=LONG_PROMPT_TOKENS,
                kv_sub=(kv_config["endpoint"], True),
                kv_replay=kv_config["replay_endpoint"],
                meta=meta,
            )
            result["meta"]["peak_rss_mb"] = round(max(rss.peak_kb, rss.sample()) / 1024)
            result["meta"]["wall_s"] = round(time.monotonic() - started, 1)
            result["meta"]["log_warnings"] = _interesting_log_lines(log)
            return result
        finally:
            rss.stop()


def sim_kv_flags() -> set[str]:
    """The flags the simulator's --help lists (older builds had no KV-event flags)."""
    help_text = subprocess.run(
        [*SIM_COMMAND, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]+", help_text))


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    flags = sim_kv_flags()
    cmd = [
        *SIM_COMMAND,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--name",
        "sim-0",
        "--model",
        MODEL_NAME,
        "--block-size",
        str(args.block_size),
        "--num-gpu-blocks",
        str(args.num_blocks),
        "--time-scale",
        "0.1",
        "--log-level",
        "warning",
    ]
    kv_sub = kv_replay = None
    if "--kv-events-port" in flags:
        pub_port = free_port()
        cmd += ["--kv-events-port", str(pub_port)]
        kv_sub = (f"tcp://127.0.0.1:{pub_port}", False)
        if "--kv-replay-port" in flags:
            replay_port = free_port()
            cmd += ["--kv-replay-port", str(replay_port)]
            kv_replay = f"tcp://127.0.0.1:{replay_port}"
    else:
        print("the simulator has no --kv-events-port: no KV events from it", flush=True)
    base = f"http://127.0.0.1:{port}"
    log = LOG_DIR / "sim.log"
    print(f"starting the simulator (vllm_sim) on {base}", flush=True)
    started = time.monotonic()
    with process_group(cmd, dict(os.environ), log) as proc:
        ready_s = wait_healthy(base, proc, 60, log)
        meta = {
            "server": "epp sim",
            "command": _redact(cmd),
            "startup_s": round(ready_s, 1),
            "block_size": args.block_size,
            "num_gpu_blocks": args.num_blocks,
            "kv_event_flags": sorted(f for f in flags if "kv" in f),
        }
        result = capture(
            base,
            MODEL_NAME,
            target="sim",
            long_prompt_tokens=LONG_PROMPT_TOKENS,
            kv_sub=kv_sub,
            kv_replay=kv_replay,
            meta=meta,
        )
        result["meta"]["wall_s"] = round(time.monotonic() - started, 1)
        return result


def _redact(cmd: list[str]) -> list[str]:
    """Paths relative to the repository, so captures do not carry this machine's layout."""
    return [c.replace(str(ROOT) + "/", "") for c in cmd]


def _interesting_log_lines(log: Path, limit: int = 25) -> list[str]:
    keep = []
    pattern = re.compile(r"WARNING|ERROR|block_size|num_gpu_blocks|Overriding|prefix|KV cache")
    for line in log.read_text(errors="replace").splitlines():
        if pattern.search(line):
            keep.append(re.sub(r"\x1b\[[0-9;]*m", "", line)[:300])
    return keep[-limit:]


def save(result: dict[str, Any], out_dir: Path, tag: str = "") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['target']}{'-' + tag if tag else ''}.json"
    # Paths relative to the repository (vLLM's log lines and /v1/models carry the model dir).
    text = json.dumps(result, indent=1).replace(str(ROOT) + "/", "")
    path.write_text(text + "\n")
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)", flush=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["vllm", "sim", "both"], default="both")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="KV capacity")
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra vLLM argument (repeat; use --vllm-arg=--flag for dashes)",
    )
    parser.add_argument("--tag", default="", help="capture file suffix: vllm-TAG.json")
    parser.add_argument("--start-timeout", type=float, default=400.0, help="vLLM start, seconds")
    args = parser.parse_args()
    # SIGTERM to us must still run the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.target in ("sim", "both"):
        save(run_sim(args), args.out, args.tag)
    if args.target in ("vllm", "both"):
        save(run_vllm(args), args.out, args.tag)


if __name__ == "__main__":
    main()
