"""vLLM's runtime LoRA endpoints: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Same bodies, answers and error messages as vLLM's `OpenAIServingModels` (with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` set): 200 with a text body on success, 400
`InvalidUserInput` for a missing field or an adapter loaded twice, 404 `NotFoundError`
for unloading an unknown one.

A load answers once the adapter is loaded, `lora_load_s` x rank / 16 engine seconds
later, as vLLM's answers once the weights are read. The simulator cannot read the
adapter's `adapter_config.json`, so the rank comes from an optional `"rank"` field in the
body (a simulator extension a real vLLM ignores), 16 by default.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from vllm_sim.engine import DEFAULT_LORA_RANK, SimEngine
from vllm_sim.openai_errors import ApiError
from vllm_sim.openai_request import parse_json_object
from vllm_sim.served_models import LoraAdapter, ServedModels

log = logging.getLogger("vllm_sim")

INVALID_USER_INPUT = "InvalidUserInput"


class LoraAdmin:
    """Loads and unloads adapters of one pod: its served names and its engine's slots."""

    __slots__ = ("_engine", "_engine_now", "_loading", "_served", "_sleep", "enabled")

    def __init__(
        self,
        served: ServedModels,
        engine: SimEngine,
        *,
        enabled: bool,
        engine_now: Callable[[], float],
        sleep_engine_seconds: Callable[[float], Awaitable[None]],
    ) -> None:
        self._served = served
        self._engine = engine
        self._engine_now = engine_now
        self._sleep = sleep_engine_seconds
        self._loading: set[str] = set()
        self.enabled = enabled

    async def load(self, request: web.Request) -> web.Response:
        body = parse_json_object(await request.read())
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ApiError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", INVALID_USER_INPUT
            )
        if name in self._loading or self._served.adapter(name) is not None:
            raise ApiError(
                400, f"The lora adapter '{name}' has already been loaded.", INVALID_USER_INPUT
            )
        if name == self._served.base:
            raise ApiError(400, f"'{name}' is the base model's name.", INVALID_USER_INPUT)
        if not self.enabled:
            raise ApiError(400, "LoRA is not enabled. Use --enable-lora to enable LoRA.")
        rank = _rank(body)
        self._loading.add(name)
        try:
            load_seconds = self._engine.load_adapter(name, rank, now=self._engine_now())
            await self._sleep(load_seconds)
            self._served.add(LoraAdapter(name, rank, path))
        except BaseException:
            self._engine.unload_adapter(name)
            raise
        finally:
            self._loading.discard(name)
        log.info("LoRA adapter loaded name=%s rank=%d load_s=%.3f", name, rank, load_seconds)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = parse_json_object(await request.read())
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                INVALID_USER_INPUT,
            )
        if not self._served.remove(name):
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self._engine.unload_adapter(name)
        log.info("LoRA adapter unloaded name=%s", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _rank(body: dict[str, Any]) -> int:
    rank = body.get("rank", DEFAULT_LORA_RANK)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ApiError(400, "'rank' must be an integer >= 1.", INVALID_USER_INPUT, param="rank")
    return rank
