"""LoRA adapter slots: at most `max_loras` adapters resident on the simulated GPU.

vLLM batches requests for at most `max_loras` distinct adapters at a time; an adapter that
is not resident must be loaded first, which costs time. The simulator keeps resident
adapters in LRU order and loads a new one into a free slot, or in place of the least
recently used adapter that no running request uses. A request whose adapter cannot get a
slot is skipped by the scheduler (not head-of-line blocking), as vLLM does.

Load completion is tracked in engine seconds (`ready_at`), so a second request for an
adapter that is still loading waits for the same load rather than paying for another.
An adapter removed (unloaded) while requests use it leaves its slot when the last of them
finishes.
"""

from __future__ import annotations

from collections import OrderedDict


class AdapterSlots:
    """Resident adapters, their load-completion times, and how many running requests use each."""

    __slots__ = ("_in_use", "_ready_at", "_removing", "load_seconds", "max_loras")

    def __init__(self, max_loras: int, load_seconds: float) -> None:
        if max_loras < 1:
            raise ValueError("max_loras must be at least 1")
        self.max_loras = max_loras
        self.load_seconds = load_seconds  # used when `activate` is given no load time
        # Resident adapter -> engine time its load completes; least recently used first.
        self._ready_at: OrderedDict[str, float] = OrderedDict()
        self._in_use: dict[str, int] = {}
        self._removing: set[str] = set()

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

    def activate(self, adapter: str, now: float, load_seconds: float | None = None) -> float:
        """Take a slot for one request; returns the seconds it waits for the adapter to load.

        `load_seconds` is what loading this adapter costs if it is not resident (default:
        `self.load_seconds`). Call only after `can_activate` said yes.
        """
        ready_at = self._ready_at.get(adapter)
        if ready_at is None:
            ready_at = self._load(adapter, now, load_seconds)
        else:
            self._ready_at.move_to_end(adapter)
        self._removing.discard(adapter)
        self._in_use[adapter] = self._in_use.get(adapter, 0) + 1
        return max(0.0, ready_at - now)

    def preload(self, adapter: str, now: float, load_seconds: float) -> bool:
        """Make `adapter` resident ahead of its requests, if a slot is free or idle.

        Returns False (nothing changed) when every slot is used by a running request.
        """
        if adapter in self._ready_at:
            self._ready_at.move_to_end(adapter)
            self._removing.discard(adapter)
            return True
        if not self.can_activate(adapter):
            return False
        self._load(adapter, now, load_seconds)
        return True

    def remove(self, adapter: str) -> None:
        """Unload `adapter`: now if idle, else when its last running request finishes."""
        if adapter in self._in_use:
            self._removing.add(adapter)
        else:
            self._ready_at.pop(adapter, None)

    def deactivate(self, adapter: str) -> None:
        """One request using `adapter` finished; the adapter stays resident."""
        count = self._in_use[adapter] - 1
        if count:
            self._in_use[adapter] = count
            return
        del self._in_use[adapter]
        if adapter in self._removing:
            self._removing.discard(adapter)
            self._ready_at.pop(adapter, None)

    def _load(self, adapter: str, now: float, load_seconds: float | None) -> float:
        if len(self._ready_at) >= self.max_loras:
            victim = next(name for name in self._ready_at if name not in self._in_use)
            del self._ready_at[victim]
        ready_at = now + (self.load_seconds if load_seconds is None else load_seconds)
        self._ready_at[adapter] = ready_at
        return ready_at
