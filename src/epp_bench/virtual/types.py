"""What the virtual-time runner and its routers share: prepared requests, the pods a
router may look at, a routing choice, and the router contract."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vllm_sim.engine import SimEngine
from vllm_sim.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A workload request turned into what both sides of the wire need, computed once.

    `path` and `body` are what Envoy would hand the EPP; `prompt_tokens` and `hashes`
    are the engine's own view of the prompt, computed by the simulated pod's code
    (`vllm_sim.openai_request.engine_prompt`: the simulator's tokenizer and chat
    template, vLLM's block hashing with the adapter and cache_salt as extra keys), never
    by the router's.
    """

    index: int
    path: str
    body: bytes
    model: str
    adapter: str | None
    prompt_tokens: int
    max_tokens: int
    hashes: tuple[BlockHash, ...]
    priority: int = 0  # < 0: sheddable (sent as the EPP's trusted priority header)
    # The engine's prompt token ids (uint32), for engines that publish KV events.
    token_ids: array | None = None


@dataclass(frozen=True, slots=True)
class VirtualPods:
    """The simulated fleet: names in order, one engine each. Routers read, never drive."""

    names: tuple[str, ...]
    engines: tuple[SimEngine, ...]
    served_model: str

    def __len__(self) -> int:
        return len(self.names)


# RouteChoice.status of a request the router holds (admission): it comes back later
# from `release`.
WAITING = 0


@dataclass(slots=True)
class RouteChoice:
    """A routing answer: a pod index, or no pod and the status the client gets (WAITING:
    the router holds the request and hands it back from `release`)."""

    pod: int | None
    status: int = 200
    reason: str | None = None
    ticket: object = None  # whatever the router needs back in `complete`


class VirtualRouter(Protocol):
    name: str

    def tick(self, now: float) -> None:
        """Called before every event at virtual time `now` (scrapes fall due here)."""
        ...

    def route(self, request: PreparedRequest, now: float) -> RouteChoice: ...

    def release(self, now: float, final: bool = False) -> list[tuple[int, RouteChoice]]:
        """Requests the router held that now have a pod or an answer: (request index,
        choice). `final`: nothing else will happen, answer every one still held."""
        ...

    def complete(self, choice: RouteChoice, status: int) -> None:
        """The request routed by `choice` ended with `status` (200, or 429/400 from the pod)."""
        ...

    def stats(self) -> dict[str, object]:
        """Router-specific figures for the result's `extra` (empty for most)."""
        ...


def leading_cached_blocks(engine: SimEngine, hashes: Sequence[BlockHash], now: float) -> int:
    """How many leading blocks of a prompt a request sent to the engine at `now` would
    reuse: every block cached there, computed before its own prefill begins (read-only)."""
    return engine.reusable_prefix_blocks(hashes, now)


def queue_would_refuse(engine: SimEngine) -> bool:
    """Whether `submit` would answer QUEUE_FULL now (same rule as SimEngine.submit)."""
    config = engine.config
    free_slots = max(0, config.max_num_seqs - engine.num_running)
    return engine.num_waiting >= config.max_waiting + free_slots
