"""The names a pod answers to: its base model and the LoRA adapters loaded right now.

Adapters come from the command line at startup and from `/v1/load_lora_adapter` at
runtime, and leave with `/v1/unload_lora_adapter`; `/v1/models` lists them in load order
with the base model as their parent, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm_sim.engine import DEFAULT_LORA_RANK
from vllm_sim.openai_errors import ApiError


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    rank: int = DEFAULT_LORA_RANK
    path: str | None = None  # `lora_path` as loaded; None for adapters named at startup

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a LoRA adapter needs a name")
        if self.rank < 1:
            raise ValueError(f"LoRA adapter {self.name!r}: rank must be at least 1")


class ServedModels:
    """The base model and the LoRA adapters a pod answers to."""

    __slots__ = ("_adapters", "base")

    def __init__(self, base: str, adapters: Iterable[str | LoraAdapter] = ()) -> None:
        self.base = base
        self._adapters: dict[str, LoraAdapter] = {}
        for adapter in adapters:
            self.add(adapter if isinstance(adapter, LoraAdapter) else LoraAdapter(adapter))

    @property
    def adapters(self) -> tuple[str, ...]:
        """Adapter names, in load order."""
        return tuple(self._adapters)

    def adapter(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def add(self, adapter: LoraAdapter) -> None:
        if adapter.name == self.base:
            raise ValueError("a LoRA adapter cannot share the base model's name")
        if adapter.name in self._adapters:
            raise ValueError(f"LoRA adapter {adapter.name!r} is already loaded")
        self._adapters[adapter.name] = adapter

    def remove(self, name: str) -> bool:
        return self._adapters.pop(name, None) is not None

    def resolve(self, requested: str | None) -> tuple[str, str | None]:
        """(model name as requested, adapter or None); a missing name means the base model."""
        if requested is None or requested == self.base:
            return self.base, None
        if requested in self._adapters:
            return requested, requested
        raise ApiError(
            404, f"The model `{requested}` does not exist.", "NotFoundError", param="model"
        )
