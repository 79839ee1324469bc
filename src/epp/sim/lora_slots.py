"""LoRA adapter slots: at most `max_loras` adapters resident on the simulated GPU.

vLLM batches requests for at most `max_loras` distinct adapters at a time; an adapter that
is not resident must be loaded first, which costs time. The simulator keeps resident
adapters in LRU order and loads a new one into a free slot, or in place of the least
recently used adapter that no running request uses. A request whose adapter cannot get a
slot is skipped by the scheduler (not head-of-line blocking), as vLLM does.

Load completion is tracked in engine seconds (`ready_at`), so a second request for an
adapter that is still loading waits for the same load rather than paying for another.
"""

from __future__ import annotations

from collections import OrderedDict


class AdapterSlots:
    """Resident adapters, their load-completion times, and how many running requests use each."""

    __slots__ = ("_in_use", "_ready_at", "load_seconds", "max_loras")

    def __init__(self, max_loras: int, load_seconds: float) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        self.max_loras = max_loras
        self.load_seconds = load_seconds
        # Resident adapter -> engine time its load completes; least recently used first.
        self._ready_at: OrderedDict[str, float] = OrderedDict()
        self._in_use: dict[str, int] = {}

    @property
    def loaded(self) -> tuple[str, ...]:
        """Resident adapters, least recently used first."""
        return tuple(self._ready_at)

    @property
    def running(self) -> tuple[str, ...]:
        """Adapters used by at least one running request, sorted by name."""
        return tuple(sorted(self._in_use))

    def can_activate(self, adapter: str) -> bool:
        if adapter in self._ready_at or len(self._ready_at) < self.max_loras:
            return True
        return any(name not in self._in_use for name in self._ready_at)

    def activate(self, adapter: str, now: float) -> float:
        """Take a slot for one request; returns the seconds it waits for the adapter to load.

        Call only after `can_activate` said yes.
        """
        ready_at = self._ready_at.get(adapter)
        if ready_at is None:
            if len(self._ready_at) >= self.max_loras:
                victim = next(name for name in self._ready_at if name not in self._in_use)
                del self._ready_at[victim]
            ready_at = now + self.load_seconds
            self._ready_at[adapter] = ready_at
        else:
            self._ready_at.move_to_end(adapter)
        self._in_use[adapter] = self._in_use.get(adapter, 0) + 1
        return max(0.0, ready_at - now)

    def deactivate(self, adapter: str) -> None:
        """One request using `adapter` finished; the adapter stays resident."""
        count = self._in_use[adapter] - 1
        if count:
            self._in_use[adapter] = count
        else:
            del self._in_use[adapter]
