"""Real simulated pods on loopback, and a real HTTP client to talk to them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from vllm_sim.engine import EngineConfig
from vllm_sim.failures import FailureConfig
from vllm_sim.kv_publisher import KvEventsConfig
from vllm_sim.server import RunningPod, SimPodConfig, start_pod

StartPod = Callable[..., Awaitable[RunningPod]]

# Fast enough for tests, slow enough that latency still shows in the numbers.
FAST_ENGINE = {
    "prefill_overhead_s": 0.001,
    "prefill_per_token_s": 0.00001,
    "decode_per_token_s": 0.001,
    "lora_load_s": 0.01,
}


@pytest.fixture
async def start() -> AsyncIterator[StartPod]:
    """`await start(model=..., lora_adapters=..., kv_events=..., **engine_overrides)` -> a pod.
    `shutdown_timeout` is aiohttp's wait for handlers on close (start_pod's default)."""
    pods: list[RunningPod] = []

    async def _start(
        *,
        pod_name: str = "pod-test",
        model: str = "sim-llama-8b",
        lora_adapters: tuple[str, ...] = (),
        time_scale: float = 1.0,
        client_max_size: int = 1024 * 1024,
        lora_ranks: dict[str, int] | None = None,
        enable_lora: bool = False,
        kv_events: KvEventsConfig | None = None,
        failures: FailureConfig | None = None,
        shutdown_timeout: float = 1.0,
        **engine: float,
    ) -> RunningPod:
        config = SimPodConfig(
            pod_name=pod_name,
            model=model,
            lora_adapters=lora_adapters,
            engine=EngineConfig(**(FAST_ENGINE | engine)),  # type: ignore[arg-type]
            time_scale=time_scale,
            client_max_size=client_max_size,
            lora_ranks=lora_ranks or {},
            enable_lora=enable_lora,
            kv_events=kv_events,
            failures=failures or FailureConfig(),
        )
        pod = await start_pod(config, "127.0.0.1", 0, shutdown_timeout=shutdown_timeout)
        pods.append(pod)
        return pod

    yield _start
    for pod in pods:
        await pod.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session
