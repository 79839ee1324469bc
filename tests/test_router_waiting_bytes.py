"""What a request waiting in admission is counted for against flow_control.max_bytes:
what the wait holds, i.e. its body, plus the copy naming a target model when the model
table rewrote it. A real Router over a real store (helpers.router_with)."""

from __future__ import annotations

import asyncio
import json

from helpers import router_with

from epp.datalayer.discovery.models import build_model_table
from epp.request import IncomingRequest, with_model

POOL = "pool"


def model_object(name: str, model: str, targets) -> dict:
    spec = {
        "modelName": model,
        "poolRef": {"name": POOL},
        "targetModels": [{"name": n, "weight": w} for n, w in targets],
    }
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": spec}


def body(model: str, n: int) -> bytes:
    return json.dumps({"model": model, "prompt": f"question {n} " * 500}).encode()


async def test_a_waiting_rewritten_request_counts_both_bodies_it_holds():
    router, *_ = router_with(
        [{"name": "p0", "address": "127.0.0.1:8001", "model": "m"}],
        scheduling={"max_queue": 1, "running_slots": 1},
    )
    router.set_model_table(build_model_table([model_object("chat", "chat", [("m", 1)])], [], POOL))
    for n in range(2):  # the pod's running slot and queue: saturated
        await router.route(
            IncomingRequest(path="/v1/completions", body=body("m", n), request_id=f"r{n}")
        )
    plain, rewritten = body("m", 9), body("chat", 9)
    waiters = [
        asyncio.create_task(
            router.route(IncomingRequest(path="/v1/completions", body=b, request_id=f"w{i}"))
        )
        for i, b in enumerate((plain, rewritten))
    ]
    await asyncio.sleep(0.01)
    assert router.waiting == 2
    held = len(plain) + len(rewritten) + len(with_model(rewritten, "m"))
    assert router.flow_control.bytes == held
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
