"""The simulated vLLM engine: waiting queue, running slots, KV blocks, LoRA slots, latency.

A pure model with no I/O and no clock of its own. Whoever drives it owns time: the HTTP
server (`vllm_sim.server`) turns the seconds it returns into asyncio sleeps, and a
discrete-event benchmark can turn them into events in virtual time. Time enters only as
the `now` passed to `start_ready` (and to the queries that take one), in engine seconds,
which must never go back: it says whether an adapter is still loading and where the
pod's prefill compute stands.

The driver's loop is:

1. `submit(...)` a request; it joins the FIFO waiting queue or is refused (HTTP 429 for
   `QUEUE_FULL`, 400 for `TOO_LONG`).
2. `start_ready(now)` after every submit and finish: starts the waiting requests that get
   a running slot, their KV blocks and (if any) an adapter slot, and says for each how
   many prompt tokens came from the prefix cache and when its prefill ends.
3. The first output token is due `prefill_seconds` after the start, each further one
   `decode_step_seconds(t)` after the previous, asked anew for each step's start `t` (the
   batch and the pod's prefills change).
4. `finish(req_id, output_tokens)` when the request is done or abandoned; with
   `output_token_ids`, the full blocks its output filled are cached (see below).

Latency. A request's own prefill takes `EngineConfig.prefill_seconds`: overhead +
uncached prompt tokens x per-token cost + cached prompt tokens x lookup cost (the llm-d
simulator's formula). Prefill is compute-bound and the pod's compute is shared: in vLLM
one scheduler step carries at most `max_num_batched_tokens` tokens, running requests
first and in order, so the prefill chunks of concurrent prompts are computed one after
the other, oldest first. The engine models the pod's prefill compute as one first come,
first served lane. A request started at `now` begins its prefill at

    begin = max(now + adapter wait, end of the prefills started before it)
    end   = begin + its own prefill time

and `StartedRequest.prefill_seconds` is `end - now`: the wait for its turn (or its
adapter, `prefill_wait_seconds`) plus its own prefill. Two cold prompts started together
thus take one and two prefill times; a cached prompt behind a cold one waits for it, then
takes its own short time. A request abandoned before its first token keeps its place
(vLLM would stop computing it; the times given to the requests behind it stand).

Decode is one inter-token latency per token after the first, ITL(batch) =
`decode_per_token_s` x (1 + `batch_slowdown` x (running - 1) / `max_num_seqs`), as the
batch fills. A step taken while a prefill is in progress also carries a prefill chunk,
vLLM's chunked prefill: decodes and prefill tokens share the step's budget, and the step
takes as long as its compute, so

    decode step at t = ITL(batch) + min(W(t), max_num_batched_tokens x per-token cost)

where W(t) is the prefill work left at t (the prefill in progress and those queued behind
it, in seconds), and 0 when no prefill is in progress. A pod that prefills continuously
decodes one token per chunk (0.45 s on `llama-8b-a100`, 2,048-token chunks), not one per
ITL: that is how vLLM's decodes slow down under prefill load. Simplifications: the decode
tokens' share of a step's budget (at most `max_num_seqs` of it) is not taken from the
chunk, the prefill is not lengthened by the decode part of the steps it shares (one ITL
per chunk, 2-9%), and the prefills of several prompts are not packed into one step.

Each request's KV blocks are reserved when it starts, as many as vLLM's allocation grows
to by its last step (prompt plus `max_tokens`, less the last output token, which is
sampled but never fed back), so the engine never preempts (`preemptions` stays 0); vLLM
grows allocations per step and preempts under pressure instead. A started request whose
prefill has not begun holds its slot and blocks here, while vLLM, which has not
scheduled it yet, counts it as waiting: `num_prefill_queued(now)` gives how many such
requests there are, and the /metrics page reports them as waiting. `vllm_sim.presets` has
configurations for real GPUs and models.

Prefix caching follows vLLM's block pool (`vllm_sim.kv_cache`), with blocks keyed by
vLLM's chained block hashes (`vllm_sim.hashing`: the driver hashes the prompt, the engine
the output, with the same adapter and salt). A request reuses the cached blocks at the
start of its prompt, at most `(prompt_tokens - 1) // block_size` of them (the last
prompt token is always computed, to sample from), and every later full prompt block is
computed and cached anew, even when a copy of it is already cached (the
recomputed last block of a fully cached prompt, the blocks after a hole). Full blocks of
generated tokens are cached too, chained to the prompt's, when the driver tells `finish`
which tokens it generated (`output_token_ids`): the KV of every token but the last
sampled one is computed, so `(prompt_tokens + output_tokens - 1) // block_size` blocks
are full. vLLM caches each of them in the step that fills it; the engine, which does
not step, caches them all when the request finishes (they were reserved, so capacity is
the same). The difference is one of timing only: an event subscriber hears of an output
block when the request ends rather than when the block fills, and a prompt sent while
the request still runs (quoting output streamed so far) cannot hit its output blocks yet.

When a block becomes reusable: a prompt block is cached (and announced) when the request
that computes it starts, and its KV is computed when that request's prefill ends; only
then can another request reuse it (`cached_prefix_blocks(hashes, now)` sees the computed
ones). A request looks its prefix up when its own prefill begins, which is when vLLM's
scheduler first gives it a share of a step (a waiting request is looked up only once the
running prefills leave budget over; vLLM v1 registers a block's hash when the step that
computes it is scheduled, `KVCacheManager.allocate_slots`). Since prefills run first come,
first served, every prefill started before it is over by then: a request started while
another still computes the same prefix on the same pod waits for it and reuses it, as on
vLLM. `EngineConfig.lookup_at_admission` is the pessimistic what-if where the lookup
happens at the start instead, so such a request computes the prefix again.

LoRA adapters have a rank; loading one costs `lora_load_s` x rank / 16 (see
`EngineConfig.lora_load_seconds`). `load_adapter` / `unload_adapter` are vLLM's runtime
load and unload; an adapter the engine was never told about is loaded on first use with
the default rank, so a driver may also just name adapters in `submit`.

KV-cache events: built with `kv_events=True`, the engine queues vLLM's `BlockStored`,
`BlockRemoved` and `AllBlocksCleared` events as its block pool changes; the driver takes
them with `drain_kv_events()` after each call and publishes them as one batch (vLLM's
block pool works the same way). Submits must then carry the prompt's token ids. Like
vLLM, a block stored as a second copy of a cached hash is announced again with that hash
(and each copy is removed on its own later), and output blocks are announced one
`BlockStored` each (vLLM fills them in different steps), from `finish`. vLLM publishes
the `AllBlocksCleared` of a reset with its next step's events: a driver that wants the
same leaves it queued until its next drain after a start or finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from vllm_sim.hashing import BlockHash, block_extra_keys, block_hashes
from vllm_sim.kv_cache import BlockTable, PrefixBlockPool
from vllm_sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from vllm_sim.latency import RequestTokenStats
from vllm_sim.lora_slots import AdapterSlots

DEFAULT_LORA_RANK = 16
# `EngineConfig.lora_load_s` is the load time of an adapter of this rank.
LORA_REFERENCE_RANK = 16


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
    """Capacity and latency of one simulated pod (defaults: a small, fast GPU, the
    `tiny` preset; `vllm_sim.presets` has real ones)."""

    block_size: int = 16
    num_gpu_blocks: int = 4096  # KV capacity in blocks
    max_num_seqs: int = 8  # running slots
    max_waiting: int = 64  # queued requests beyond the free slots; more is refused
    prefill_overhead_s: float = 0.002
    prefill_per_token_s: float = 0.0001
    decode_per_token_s: float = 0.001  # inter-token latency with a batch of one
    batch_slowdown: float = 0.5  # ITL x (1 + batch_slowdown x (running - 1) / max_num_seqs)
    max_loras: int = 4
    lora_load_s: float = 0.2  # load time of a rank-16 adapter; proportional to rank
    # Cost of each prompt token found in the prefix cache (lookup, block-table work).
    prefill_per_cached_token_s: float = 0.0
    # Only reported (cache_config_info): the share of GPU memory the KV sizing assumed.
    gpu_memory_utilization: float = 0.9
    # vLLM's token budget per step: a decode step taken while a prefill runs carries a
    # chunk of up to this many prefill tokens (see `decode_step_seconds`). 2,048 is
    # vLLM's default for an OpenAI server on an A100 or a card under 70 GiB.
    max_num_batched_tokens: int = 2048
    # What-if, off by default: look a prompt's cached prefix up when the request is
    # admitted rather than when its prefill begins, so that a request admitted while
    # another one still computes the blocks it needs computes them again.
    lookup_at_admission: bool = False

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_loras",
            "max_num_batched_tokens",
        ):
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
            "prefill_per_cached_token_s",
        ):
            value = getattr(self, name)
            # `not value >= 0` also refuses NaN.
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    @property
    def max_context_tokens(self) -> int:
        """Prompt + output tokens of the longest request the KV cache can ever hold."""
        return self.num_gpu_blocks * self.block_size

    def prefill_seconds(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Prefill time of a prompt of which `cached_tokens` come from the prefix cache."""
        return (
            self.prefill_overhead_s
            + (prompt_tokens - cached_tokens) * self.prefill_per_token_s
            + cached_tokens * self.prefill_per_cached_token_s
        )

    @property
    def prefill_chunk_seconds(self) -> float:
        """Compute time of one full prefill chunk: `max_num_batched_tokens` uncached tokens."""
        return self.max_num_batched_tokens * self.prefill_per_token_s

    def lora_load_seconds(self, rank: int = DEFAULT_LORA_RANK) -> float:
        """Time to load an adapter of `rank`: linear in rank, through zero.

        An adapter's weights (A: r x d_in, B: d_out x r per target layer) grow linearly
        with r, and so do reading and copying them. The spec's two points, 200 ms at rank
        16 and 800 ms at rank 64 on an A100, lie on one line through the origin (12.5 ms
        per unit of rank), so ranks outside [16, 64] are extrapolated on it.
        """
        if rank < 1:
            raise ValueError("a LoRA rank must be at least 1")
        return self.lora_load_s * rank / LORA_REFERENCE_RANK


@dataclass(frozen=True, slots=True)
class StartedRequest:
    """A request that just got a running slot: its first token is due after `prefill_seconds`.

    `prefill_seconds` runs from the start to the end of the request's prefill: the wait
    for its turn on the pod's prefill compute (behind the prefills started before it)
    or for its adapter, whichever is longer (`prefill_wait_seconds`), then its own
    prefill (`EngineConfig.prefill_seconds` of its uncached and cached tokens).
    """

    req_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens reused from the prefix cache
    prefill_seconds: float  # includes `prefill_wait_seconds`
    adapter_wait_seconds: float
    prefill_wait_seconds: float = 0.0  # until its own prefill compute begins


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
    queue_full_rejections: int = 0  # submits refused with QUEUE_FULL


@dataclass(slots=True)
class _Request:
    req_id: str
    prompt_hashes: Sequence[BlockHash]
    prompt_tokens: int
    max_tokens: int
    adapter: str | None
    anonymous_blocks: int  # KV blocks not keyed by a hash: partial prompt tail + output
    adapter_rank: int = DEFAULT_LORA_RANK
    token_ids: Sequence[int] | None = None  # the prompt's, when the driver gave them
    cache_salt: str | None = None
    cached_tokens: int = 0  # set when it starts
    pool_epoch: int = 0  # the block pool's epoch when its blocks were pinned
    block_table: BlockTable = field(default_factory=list)  # set when it starts


class SimEngine:
    """One vLLM engine's scheduling and KV-cache state; see the module docstring for the loop."""

    __slots__ = (
        "_adapter_ids",
        "_adapter_ranks",
        "_adapters",
        "_kv_events",
        "_lane",
        "_lane_free_at",
        "_next_adapter_id",
        "_pool",
        "_running",
        "_waiting",
        "config",
        "counters",
        "request_stats",
    )

    def __init__(self, config: EngineConfig | None = None, *, kv_events: bool = False) -> None:
        self.config = config or EngineConfig()
        self.counters = EngineCounters()
        self.request_stats = RequestTokenStats()
        self._pool = PrefixBlockPool(self.config.num_gpu_blocks)
        self._adapters = AdapterSlots(self.config.max_loras, self.config.lora_load_s)
        # Both dicts keep insertion order: `_waiting` is the FIFO queue.
        self._waiting: dict[str, _Request] = {}
        self._running: dict[str, _Request] = {}
        # Registered adapters' ranks, and their integer ids (vLLM's lora_int_id, from 1).
        self._adapter_ranks: dict[str, int] = {}
        self._adapter_ids: dict[str, int] = {}
        self._next_adapter_id = 1
        # The pod's prefill compute, first come first served: (begin, end, req_id) of each
        # prefill not over yet, in start order, and when the last one ends.
        self._lane: deque[tuple[float, float, str]] = deque()
        self._lane_free_at = 0.0
        self._kv_events: list[KvEvent] | None = [] if kv_events else None
        if kv_events:
            self._pool.removed = []

    # -- driving -------------------------------------------------------------------------

    def submit(
        self,
        req_id: str,
        prompt_hashes: Sequence[BlockHash],
        prompt_tokens: int,
        max_tokens: int,
        adapter: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> Admission:
        """Queue a request, or refuse it when the queue is full or it can never fit.

        `prompt_hashes` are the chained hashes of the prompt's full blocks,
        `vllm_sim.hashing.block_hashes(tokens, block_size, lora_name=adapter,
        cache_salt=cache_salt)`, so there are `prompt_tokens // block_size` of them. The
        queue is full when it already holds `max_waiting` requests beyond those the free
        running slots will take.

        `prompt_token_ids` (required with KV events on) and `cache_salt` feed the
        `BlockStored` events; the hashes alone decide what is reused. The token ids also
        let `finish` hash the blocks the output fills, chained to the prompt's with the
        same adapter and salt: without them no output block is cached.
        """
        config = self.config
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if len(prompt_hashes) != prompt_tokens // config.block_size:
            raise ValueError("need one hash per full block of the prompt")
        if req_id in self._waiting or req_id in self._running:
            raise ValueError(f"request {req_id!r} is already in the engine")
        if self._kv_events is not None and prompt_token_ids is None:
            raise ValueError("with KV events on, submit needs the prompt's token ids")
        if prompt_token_ids is not None and len(prompt_token_ids) != prompt_tokens:
            raise ValueError("prompt_token_ids must hold prompt_tokens token ids")
        needed = self.blocks_needed(prompt_tokens, max_tokens)
        if needed > config.num_gpu_blocks:
            return Admission.TOO_LONG
        if self.queue_full:
            self.counters.queue_full_rejections += 1
            return Admission.QUEUE_FULL
        self._waiting[req_id] = _Request(
            req_id=req_id,
            prompt_hashes=prompt_hashes,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            adapter=adapter,
            anonymous_blocks=self._blocks_reserved(prompt_tokens, max_tokens) - len(prompt_hashes),
            adapter_rank=DEFAULT_LORA_RANK
            if adapter is None
            else self._adapter_ranks.get(adapter, DEFAULT_LORA_RANK),
            token_ids=prompt_token_ids,
            cache_salt=cache_salt,
        )
        return Admission.QUEUED

    def start_ready(self, now: float) -> list[StartedRequest]:
        """Start waiting requests, oldest first, while slots and KV blocks last.

        A request whose KV blocks do not fit blocks the queue behind it (as in vLLM); one
        whose adapter cannot get a slot is passed over, and keeps its place. Each started
        request's prefill is queued on the pod's prefill compute (module docstring).
        `now` must never go back from one call to the next.
        """
        config = self.config
        free_slots = config.max_num_seqs - len(self._running)
        started: list[StartedRequest] = []
        if free_slots <= 0 or not self._waiting:
            return started
        pool = self._pool
        pool.settle(now)
        adapters = self._adapters
        block_size = config.block_size
        counters = self.counters
        events = self._kv_events
        for req in self._waiting.values():
            if len(started) == free_slots:
                break
            if req.adapter is not None and not adapters.can_activate(req.adapter):
                continue
            # Like vLLM, at least the last prompt token is computed to produce the first
            # output, so a fully cached prompt still recomputes its last block (into a
            # new copy, see `vllm_sim.kv_cache`). Only blocks computed by the time of the
            # lookup are reused: when the request's prefill begins (every prefill started
            # before it has ended by then), or with `lookup_at_admission`, now.
            lookup_at = now if config.lookup_at_admission else max(now, self._lane_free_at)
            hit_blocks = min(
                pool.leading_hits(req.prompt_hashes, lookup_at),
                (req.prompt_tokens - 1) // block_size,
            )
            table = pool.allocate(req.prompt_hashes, hit_blocks, req.anonymous_blocks, lookup_at)
            if table is None:
                break
            req.block_table = table
            req.pool_epoch = pool.epoch
            if events is not None:
                self._record_pin_events(req, hit_blocks)
            cached_tokens = hit_blocks * block_size
            req.cached_tokens = cached_tokens
            adapter_wait = 0.0
            if req.adapter is not None:
                adapter_wait = adapters.activate(
                    req.adapter, now, config.lora_load_seconds(req.adapter_rank)
                )
            compute = config.prefill_seconds(req.prompt_tokens, cached_tokens)
            begin = max(now + adapter_wait, self._lane_free_at)
            end = begin + compute
            self._lane_free_at = end
            if end > now:
                self._lane.append((begin, end, req.req_id))
                # The blocks it computes are reusable once its prefill is over.
                pool.mark_ready_at(table[hit_blocks : len(req.prompt_hashes)], end)
            wait = begin - now
            counters.prompt_tokens += req.prompt_tokens
            counters.prefix_cache_queries += req.prompt_tokens
            counters.prefix_cache_hits += cached_tokens
            started.append(
                StartedRequest(
                    req_id=req.req_id,
                    prompt_tokens=req.prompt_tokens,
                    cached_tokens=cached_tokens,
                    prefill_seconds=wait + compute,
                    adapter_wait_seconds=adapter_wait,
                    prefill_wait_seconds=wait,
                )
            )
        for request in started:
            self._running[request.req_id] = self._waiting.pop(request.req_id)
        return started

    def decode_step_seconds(self, now: float | None = None) -> float:
        """Inter-token latency for the batch as it is now (more running, slower steps).

        With `now`, a step taken while a prefill is in progress also carries a prefill
        chunk: ITL(batch) + min(prefill work left at `now`, one chunk of
        `max_num_batched_tokens` tokens) (module docstring). Without it, ITL(batch).
        """
        config = self.config
        extra = max(0, len(self._running) - 1)
        step = config.decode_per_token_s * (
            1.0 + config.batch_slowdown * extra / config.max_num_seqs
        )
        if now is None:
            return step
        return step + self.prefill_in_step_seconds(now)

    def prefill_in_step_seconds(self, now: float) -> float:
        """Prefill compute a decode step taken at `now` carries: none when no prefill is in
        progress, else the prefill work left (this one's and those queued behind it), at
        most one chunk of `max_num_batched_tokens` uncached tokens."""
        lane = self._lane
        while lane and lane[0][1] <= now:
            lane.popleft()
        if not lane or lane[0][0] > now:
            return 0.0
        cap = self.config.prefill_chunk_seconds
        work = 0.0
        for begin, end, _ in lane:
            work += end - max(begin, now)
            if work >= cap:
                return cap
        return work

    def prefill_busy_until(self, now: float) -> float:
        """When the prefills started so far are all over (`now` if they already are)."""
        return max(now, self._lane_free_at)

    def num_prefill_queued(self, now: float) -> int:
        """Running requests whose prefill has not begun by `now`.

        vLLM has not scheduled a token of theirs yet, so they are still in its waiting
        queue: /metrics counts them as waiting, not running.
        """
        running = self._running
        count = 0
        for begin, _, req_id in reversed(self._lane):
            if begin <= now:
                break
            if req_id in running:
                count += 1
        return count

    def finish(
        self,
        req_id: str,
        output_tokens: int,
        reason: FinishReason = FinishReason.LENGTH,
        *,
        output_token_ids: Sequence[int] | None = None,
    ) -> None:
        """End a running or still waiting request: free its slot, unpin its blocks.

        Its cached blocks stay cached (evictable) for later requests to reuse. With
        `output_token_ids` (the ids of the tokens it generated, in order), the full
        blocks of prompt + output whose KV was computed (every token but the last one
        generated) are cached as well, chained to the prompt's, as vLLM caches them
        during decode, and announced with one `BlockStored` each. Raises KeyError for a
        request the engine does not hold.
        """
        req = self._running.pop(req_id, None)
        if req is None:
            del self._waiting[req_id]
        else:
            anonymous = req.anonymous_blocks
            if output_token_ids is not None and output_tokens > 1:
                anonymous -= self._cache_output_blocks(req, output_tokens, output_token_ids)
            self._pool.release(req.block_table, anonymous)
            if req.adapter is not None:
                self._adapters.deactivate(req.adapter)
            self.counters.generation_tokens += output_tokens
            if reason is FinishReason.LENGTH or reason is FinishReason.STOP:
                self.request_stats.observe(
                    req.prompt_tokens, req.cached_tokens, output_tokens, req.max_tokens
                )
        self.counters.finished[reason] += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; returns how many idle blocks were dropped.

        Blocks that running requests hold stay allocated until they finish, but are no
        longer reusable (nor are their output blocks cached): after a reset, nothing
        cached survives, and a KV-event subscriber, told `AllBlocksCleared`, is right.
        The event is queued like any other; vLLM publishes it with its next step's
        events, not on its own.
        """
        dropped = self._pool.reset()
        if self._kv_events is not None:
            self._kv_events.append(AllBlocksCleared())
        return dropped

    # -- LoRA adapters ---------------------------------------------------------------------

    def load_adapter(
        self, name: str, rank: int = DEFAULT_LORA_RANK, now: float | None = None
    ) -> float:
        """Register adapter `name` of `rank` (vLLM's runtime load); returns its load time.

        With `now`, the adapter is also made resident in a free or idle slot, ready at
        `now` + its load time, so that its first request does not pay the load again
        (vLLM's load "pre-loads it for incoming requests"). With every slot busy it is
        loaded on first use instead.
        """
        load_seconds = self.config.lora_load_seconds(rank)
        self._adapter_ranks[name] = rank
        self._adapter_id(name)
        if now is not None:
            self._adapters.preload(name, now, load_seconds)
        return load_seconds

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name`: its slot is freed now, or when its last request ends."""
        self._adapter_ranks.pop(name, None)
        self._adapter_ids.pop(name, None)
        self._adapters.remove(name)

    def adapter_rank(self, name: str) -> int:
        return self._adapter_ranks.get(name, DEFAULT_LORA_RANK)

    def _adapter_id(self, name: str) -> int:
        adapter_id = self._adapter_ids.get(name)
        if adapter_id is None:
            adapter_id = self._adapter_ids[name] = self._next_adapter_id
            self._next_adapter_id += 1
        return adapter_id

    # -- KV events -----------------------------------------------------------------------

    @property
    def kv_events_enabled(self) -> bool:
        return self._kv_events is not None

    def drain_kv_events(self) -> list[KvEvent]:
        """The events queued since the last drain, oldest first (always [] when off)."""
        events = self._kv_events
        if not events:
            return []
        self._kv_events = []
        return events

    def _record_pin_events(self, req: _Request, hit_blocks: int) -> None:
        """Evictions the start caused, then one `BlockStored` for the blocks it computed.

        Blocks reused from the cache produce no event, as in vLLM; every full prompt block
        after them is stored, as one run whose parent is the last reused block, even the
        hashes that were cached already (a second copy, announced again as vLLM does).
        """
        self._record_removals()
        hashes = req.prompt_hashes
        if hit_blocks < len(hashes):
            parent = hashes[hit_blocks - 1] if hit_blocks else None
            self._record_stored(req, hit_blocks, hashes[hit_blocks:], parent, req.token_ids)

    def _record_removals(self) -> None:
        events = self._kv_events
        removed = self._pool.removed
        assert events is not None and removed is not None
        if removed:
            events.extend(BlockRemoved(block_hashes=[block]) for block in removed)
            removed.clear()

    def _record_stored(
        self,
        req: _Request,
        first_block: int,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        sequence: Sequence[int] | None,
    ) -> None:
        """One `BlockStored` for blocks `first_block`.. of `sequence` (prompt + output);
        `parent` is block `first_block - 1`'s hash (None for block 0)."""
        events = self._kv_events
        assert events is not None and sequence is not None
        block_size = self.config.block_size
        adapter = req.adapter
        end_block = first_block + len(hashes)
        events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(sequence[first_block * block_size : end_block * block_size]),
                block_size=block_size,
                lora_id=None if adapter is None else self._adapter_id(adapter),
                lora_name=adapter,
                extra_keys=[
                    block_extra_keys(i, adapter, req.cache_salt)
                    for i in range(first_block, end_block)
                ],
            )
        )

    def _cache_output_blocks(
        self, req: _Request, output_tokens: int, output_token_ids: Sequence[int]
    ) -> int:
        """Cache the full blocks of prompt + output of a finishing request; returns how
        many of its anonymous blocks now hold them."""
        prompt_ids = req.token_ids
        pool = self._pool
        if prompt_ids is None or req.pool_epoch != pool.epoch:
            return 0  # no tokens to hash, or detached from the cache by a reset
        block_size = self.config.block_size
        prompt_tokens = req.prompt_tokens
        first = len(req.prompt_hashes)
        # The last generated token is sampled but never fed back: its KV is not computed.
        generated = min(output_tokens - 1, len(output_token_ids), req.max_tokens - 1)
        full = (prompt_tokens + generated) // block_size
        if full <= first:
            return 0
        parent: BlockHash | None = req.prompt_hashes[-1] if first else None
        sequence = list(prompt_ids)
        sequence.extend(output_token_ids[: full * block_size - prompt_tokens])
        hashes = block_hashes(
            sequence,
            block_size,
            lora_name=req.adapter,
            cache_salt=req.cache_salt,
            start_block=first,
            parent=parent,
        )
        pool.cache_anonymous(req.block_table, hashes)
        if self._kv_events is not None:
            # vLLM caches (and announces) each output block in the step that fills it.
            for index, block_hash in enumerate(hashes, start=first):
                self._record_stored(req, index, [block_hash], parent, sequence)
                parent = block_hash
        return len(hashes)

    def blocks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks the longest request of this size could need: prompt plus every
        output token (a request needing more than the pool is refused as TOO_LONG)."""
        return -(-(prompt_tokens + max_tokens) // self.config.block_size)

    def _blocks_reserved(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks a request reserves when it starts: vLLM's allocation by the request's
        last step, which feeds every token but the last one generated."""
        return -(-(prompt_tokens + max_tokens - 1) // self.config.block_size)

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
        """Cached KV blocks (prompt and output), held or idle; copies of a hash count each."""
        return self._pool.cached_blocks

    def cached_block_hashes(self) -> list[BlockHash]:
        """The hash of every cached block (each hash once): what a KV-event subscriber
        that missed nothing holds for this pod."""
        return self._pool.cached_hashes()

    @property
    def loaded_adapters(self) -> tuple[str, ...]:
        return self._adapters.loaded

    @property
    def running_adapters(self) -> tuple[str, ...]:
        return self._adapters.running

    @property
    def waiting_adapters(self) -> tuple[str, ...]:
        return tuple(sorted({r.adapter for r in self._waiting.values() if r.adapter}))

    @property
    def num_waiting_deferred(self) -> int:
        """Waiting requests passed over because their adapter cannot get a slot now.

        vLLM's `num_requests_waiting_by_reason{reason="deferred"}`; the rest wait for
        capacity (slots or KV blocks).
        """
        can_activate = self._adapters.can_activate
        return sum(
            1
            for r in self._waiting.values()
            if r.adapter is not None and not can_activate(r.adapter)
        )

    @property
    def queue_full(self) -> bool:
        """Whether `submit` would answer QUEUE_FULL now."""
        free_slots = max(0, self.config.max_num_seqs - len(self._running))
        return len(self._waiting) >= self.config.max_waiting + free_slots

    def cached_prefix_blocks(
        self, prompt_hashes: Sequence[BlockHash], now: float | None = None
    ) -> int:
        """How many leading blocks of a prompt are in the cache (read-only); with `now`,
        only blocks whose prefill is over by then (their KV is computed)."""
        return self._pool.leading_hits(prompt_hashes, now)

    def reusable_prefix_blocks(self, prompt_hashes: Sequence[BlockHash], now: float) -> int:
        """How many leading blocks of a prompt a request started at `now` would find
        cached when it looks them up (read-only; before the last-token cap)."""
        config = self.config
        lookup_at = now if config.lookup_at_admission else max(now, self._lane_free_at)
        return self._pool.leading_hits(prompt_hashes, lookup_at)

    def is_running(self, req_id: str) -> bool:
        return req_id in self._running

    def is_waiting(self, req_id: str) -> bool:
        return req_id in self._waiting
