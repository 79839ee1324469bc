"""`epp serve`'s process (EppService.run_until_stopped), in this process with real
signals: once started, the start-up heap is frozen (gc.freeze, docs/benchmarks/loop.md);
SIGTERM drains and a second one stops at once."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

from epp.app import EppService
from epp.config import EppConfig


async def test_the_serving_process_freezes_its_start_up_heap_and_stops_on_signals() -> None:
    config = EppConfig.model_validate(
        {
            "endpoints": [{"name": "pod-0", "address": "127.0.0.1:1", "model": "m"}],
            "server": {
                "grpc_host": "127.0.0.1", "grpc_port": 0, "grpc_health_port": 0,
                "metrics_host": "127.0.0.1", "metrics_port": 0, "secure_serving": False,
                "drain_timeout_s": 30, "drain_quiet_s": 30,
            },
            "log_level": "warning",
        }
    )  # fmt: skip
    service = EppService(config)
    assert gc.get_freeze_count() == 0
    serving = asyncio.create_task(service.run_until_stopped())
    try:
        for _ in range(500):
            if service.metrics_port:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # start() returned: the freeze follows it
        assert service.metrics_port and gc.get_freeze_count() > 0
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert not serving.done()  # draining: not ready, still serving
        assert not service.ready
        os.kill(os.getpid(), signal.SIGTERM)  # the second stops at once
        await asyncio.wait_for(serving, 10)
    finally:
        serving.cancel()
        gc.unfreeze()  # the rest of the suite collects as usual
