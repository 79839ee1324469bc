"""Real vLLM servers (CPU build, the tiny local model of tools/vllm_check) for end-to-end
tests, and vLLM's own block hashes. Imports without vLLM: vLLM runs from its own venv
(.bench/vllm-venv) in child processes.

- `VllmServer`: one API server in its own process group, its KV events published on
  ipc:// sockets in a short private directory (vLLM's PUB binds ipc:// endpoints; a
  tcp://host:port endpoint would make it connect instead, and a wildcard would listen on
  every interface). Killable and restartable on the same port and sockets.
- `BlockHasher`: tools/vllm_check/block_hashes.py in the vLLM venv, kept running: the hash
  vLLM gives each full block of a token sequence, from vLLM's own code, so that what a
  probe shows an engine holds can be named block by block without the KV events.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from e2e.harness import Proc, http

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "vllm_check"


def _load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"vllm_check_{name}", TOOLS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


server = _load_tool("vllm_server")
MODEL = server.MODEL_NAME


def skip_reason() -> str | None:
    """Why the real-vLLM tests cannot run here (None: they can)."""
    if os.environ.get("EPP_VLLM_E2E", "1") == "0":
        return "EPP_VLLM_E2E=0"
    why = server.missing()
    return f"{why}: set it up with {server.SETUP_COMMANDS}" if why else None


@dataclass
class VllmServer:
    name: str
    port: int
    work: Path  # logs
    block_size: int
    num_blocks: int
    max_model_len: int
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: Proc | None = None
    sockets: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="vkv-")))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def base(self) -> str:
        return f"http://{self.address}"

    @property
    def kv_endpoint(self) -> str:
        return f"ipc://{self.sockets}/pub"

    @property
    def replay_endpoint(self) -> str:
        return f"ipc://{self.sockets}/replay"

    @property
    def log(self) -> Path:
        return self.work / f"{self.name}.log"

    def start(self) -> VllmServer:
        argv = server.server_argv(
            self.port,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            kv_events=server.kv_events_config(self.kv_endpoint, self.replay_endpoint),
            extra=self.extra,
        )
        self.proc = Proc(self.name, argv, self.log, env=server.server_env(self.env)).start()
        return self

    def wait_healthy(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            assert self.proc is not None and self.proc.alive, (
                f"{self.name} exited before healthy:\n{self.tail()}"
            )
            if http(f"{self.base}/health", timeout=2)[0] == 200:
                return time.monotonic() - start
            time.sleep(1.0)
        raise AssertionError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL to the whole group (API server, engine core): a crash, no clean-up."""
        assert self.proc is not None
        self.proc.signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            # The engine core can outlive the API server: sweep the group.
            if self.proc.popen is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.popen.pid, signal.SIGKILL)

    def close(self) -> None:
        self.stop()
        for path in self.sockets.glob("*"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.sockets.rmdir()

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def metric(self, name: str) -> float:
        """The sum of a family's samples on /metrics (one engine: one sample)."""
        status, _, page = http(f"{self.base}/metrics", timeout=10)
        assert status == 200, f"{self.name} /metrics -> {status}"
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in page.decode().splitlines()
            if line.startswith((name + "{", name + " "))
        )


class BlockHasher:
    """vLLM's block hashes (16 hex digits each) of token sequences, from vLLM's code."""

    def __init__(self, block_size: int, log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [str(server.VLLM_PYTHON), str(TOOLS / "block_hashes.py"), "--block-size",
             str(block_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=server.server_env(), start_new_session=True,
        )  # fmt: skip
        self._ready = False

    def hashes(self, tokens: list[int]) -> list[str]:
        assert self._proc.stdin and self._proc.stdout
        if not self._ready:
            assert json.loads(self._proc.stdout.readline()) == {"ready": True}
            self._ready = True
        self._proc.stdin.write(json.dumps(tokens) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, "block_hashes.py exited"
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(10)
        self._log.close()
