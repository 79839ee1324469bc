"""The simulated vLLM engine: waiting queue, running slots, KV blocks, LoRA slots, latency.

A pure model with no I/O and no clock of its own. Whoever drives it owns time: the HTTP
server (`epp.sim.server`) turns the seconds it returns into asyncio sleeps, and a
discrete-event benchmark can turn them into events in virtual time. The only time that
enters is the `now` passed to `start_ready`, in engine seconds, used to know whether an
adapter is still loading.

The driver's loop is:

1. `submit(...)` a request; it joins the FIFO waiting queue or is refused (HTTP 429 for
   `QUEUE_FULL`, 400 for `TOO_LONG`).
2. `start_ready(now)` after every submit and finish: starts the waiting requests that get
   a running slot, their KV blocks and (if any) an adapter slot, and says for each how
   many prompt tokens came from the prefix cache and how long its prefill takes.
3. The first output token is due `prefill_seconds` after the start, each further one
   `decode_step_seconds()` after the previous (asked anew each step, as the batch changes).
4. `finish(req_id, output_tokens)` when the request is done or abandoned.

Latency follows the llm-d simulator's model: prefill = overhead + uncached prompt tokens x
per-token cost (+ adapter load), decode = one inter-token latency per token after the
first, slowed as the batch fills. Each request's KV blocks (prompt plus `max_tokens`) are
reserved when it starts, so the engine never preempts (`preemptions` stays 0); vLLM grows
allocations per step and preempts under pressure instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from epp.prefix.hashing import BlockHash
from epp.sim.kv_cache import PrefixBlockPool
from epp.sim.lora_slots import AdapterSlots


class Admission(StrEnum):
    """What `submit` did with a request."""

    QUEUED = "queued"
    QUEUE_FULL = "queue_full"  # HTTP 429: try another pod or later
    TOO_LONG = "too_long"  # prompt + max_tokens can never fit in the KV cache: HTTP 400


class FinishReason(StrEnum):
    """vLLM's `finished_reason` label values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REPETITION = "repetition"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity and latency of one simulated pod (defaults: a small, fast GPU)."""

    block_size: int = 16
    num_gpu_blocks: int = 4096  # KV capacity in blocks
    max_num_seqs: int = 8  # running slots
    max_waiting: int = 64  # queued requests beyond the free slots; more is refused
    prefill_overhead_s: float = 0.002
    prefill_per_token_s: float = 0.0001
    decode_per_token_s: float = 0.001  # inter-token latency with a batch of one
    batch_slowdown: float = 0.5  # ITL x (1 + batch_slowdown x (running - 1) / max_num_seqs)
    max_loras: int = 4
    lora_load_s: float = 0.2

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must not be negative")
        for name in (
            "prefill_overhead_s",
            "prefill_per_token_s",
            "decode_per_token_s",
            "batch_slowdown",
            "lora_load_s",
        ):
            value = getattr(self, name)
            # `not value >= 0` also refuses NaN.
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0")

    @property
    def max_context_tokens(self) -> int:
        """Prompt + output tokens of the longest request the KV cache can ever hold."""
        return self.num_gpu_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class StartedRequest:
    """A request that just got a running slot: its first token is due after `prefill_seconds`."""

    req_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    prefill_seconds: float  # includes `adapter_wait_seconds`
    adapter_wait_seconds: float


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters, named and counted as vLLM's /metrics counts them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, counted when a request starts
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    preemptions: int = 0
    finished: dict[FinishReason, int] = field(
        default_factory=lambda: dict.fromkeys(FinishReason, 0)
    )


@dataclass(slots=True)
class _Request:
    req_id: str
    prompt_hashes: Sequence[BlockHash]
    prompt_tokens: int
    max_tokens: int
    adapter: str | None
    anonymous_blocks: int  # KV blocks not keyed by a hash: partial prompt tail + output


class SimEngine:
    """One vLLM engine's scheduling and KV-cache state; see the module docstring for the loop."""

    __slots__ = ("_adapters", "_pool", "_running", "_waiting", "config", "counters")

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.counters = EngineCounters()
        self._pool = PrefixBlockPool(self.config.num_gpu_blocks)
        self._adapters = AdapterSlots(self.config.max_loras, self.config.lora_load_s)
        # Both dicts keep insertion order: `_waiting` is the FIFO queue.
        self._waiting: dict[str, _Request] = {}
        self._running: dict[str, _Request] = {}

    # -- driving -------------------------------------------------------------------------

    def submit(
        self,
        req_id: str,
        prompt_hashes: Sequence[BlockHash],
        prompt_tokens: int,
        max_tokens: int,
        adapter: str | None = None,
    ) -> Admission:
        """Queue a request, or refuse it when the queue is full or it can never fit.

        `prompt_hashes` are the chained hashes of the prompt's full blocks
        (`block_hashes(tokens, block_size, seed)`), so there are `prompt_tokens //
        block_size` of them. The queue is full when it already holds `max_waiting`
        requests beyond those the free running slots will take.
        """
        config = self.config
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if len(prompt_hashes) != prompt_tokens // config.block_size:
            raise ValueError("need one hash per full block of the prompt")
        if req_id in self._waiting or req_id in self._running:
            raise ValueError(f"request {req_id!r} is already in the engine")
        needed = self.blocks_needed(prompt_tokens, max_tokens)
        if needed > config.num_gpu_blocks:
            return Admission.TOO_LONG
        free_slots = max(0, config.max_num_seqs - len(self._running))
        if len(self._waiting) >= config.max_waiting + free_slots:
            return Admission.QUEUE_FULL
        self._waiting[req_id] = _Request(
            req_id=req_id,
            prompt_hashes=prompt_hashes,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            adapter=adapter,
            anonymous_blocks=needed - len(prompt_hashes),
        )
        return Admission.QUEUED

    def start_ready(self, now: float) -> list[StartedRequest]:
        """Start waiting requests, oldest first, while slots and KV blocks last.

        A request whose KV blocks do not fit blocks the queue behind it (as in vLLM); one
        whose adapter cannot get a slot is passed over, and keeps its place.
        """
        config = self.config
        free_slots = config.max_num_seqs - len(self._running)
        started: list[StartedRequest] = []
        if free_slots <= 0 or not self._waiting:
            return started
        pool = self._pool
        adapters = self._adapters
        block_size = config.block_size
        counters = self.counters
        for req in self._waiting.values():
            if len(started) == free_slots:
                break
            if req.adapter is not None and not adapters.can_activate(req.adapter):
                continue
            hit_blocks = pool.leading_hits(req.prompt_hashes)
            if not pool.try_pin(req.prompt_hashes, req.anonymous_blocks):
                break
            # Like vLLM, at least the last prompt token is computed to produce the first
            # output, so a fully cached prompt still recomputes its last block.
            cached_tokens = min(hit_blocks, (req.prompt_tokens - 1) // block_size) * block_size
            adapter_wait = 0.0 if req.adapter is None else adapters.activate(req.adapter, now)
            prefill = (
                config.prefill_overhead_s
                + (req.prompt_tokens - cached_tokens) * config.prefill_per_token_s
                + adapter_wait
            )
            counters.prompt_tokens += req.prompt_tokens
            counters.prefix_cache_queries += req.prompt_tokens
            counters.prefix_cache_hits += cached_tokens
            started.append(
                StartedRequest(
                    req_id=req.req_id,
                    prompt_tokens=req.prompt_tokens,
                    cached_tokens=cached_tokens,
                    prefill_seconds=prefill,
                    adapter_wait_seconds=adapter_wait,
                )
            )
        for request in started:
            self._running[request.req_id] = self._waiting.pop(request.req_id)
        return started

    def decode_step_seconds(self) -> float:
        """Inter-token latency for the batch as it is now (more running, slower steps)."""
        config = self.config
        extra = max(0, len(self._running) - 1)
        return config.decode_per_token_s * (
            1.0 + config.batch_slowdown * extra / config.max_num_seqs
        )

    def finish(
        self, req_id: str, output_tokens: int, reason: FinishReason = FinishReason.LENGTH
    ) -> None:
        """End a running or still waiting request: free its slot, unpin its blocks.

        Its prompt blocks stay cached (evictable) for later requests to reuse. Raises
        KeyError for a request the engine does not hold.
        """
        req = self._running.pop(req_id, None)
        if req is None:
            del self._waiting[req_id]
        else:
            self._pool.unpin(req.prompt_hashes, req.anonymous_blocks)
            if req.adapter is not None:
                self._adapters.deactivate(req.adapter)
            self.counters.generation_tokens += output_tokens
        self.counters.finished[reason] += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no running request holds; returns how many were dropped."""
        return self._pool.reset()

    def blocks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a request reserves when it starts: prompt plus every output token."""
        return -(-(prompt_tokens + max_tokens) // self.config.block_size)

    # -- gauges --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by running requests; cached idle blocks count as free."""
        return self._pool.pinned_blocks / self.config.num_gpu_blocks

    @property
    def cached_blocks(self) -> int:
        """Hashed prompt blocks in the cache, held or idle."""
        return self._pool.cached_blocks

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        return self._adapters.loaded

    @property
    def running_adapters(self) -> tuple[str, ...]:
        return self._adapters.running

    @property
    def waiting_adapters(self) -> tuple[str, ...]:
        return tuple(sorted({r.adapter for r in self._waiting.values() if r.adapter}))

    def is_running(self, req_id: str) -> bool:
        return req_id in self._running

    def is_waiting(self, req_id: str) -> bool:
        return req_id in self._waiting
