"""Precise mode in virtual time: the EPP's index fed by the simulated engines' KV events.

`epp_precise` is the EPP of `epp_bench.virtual.epp` with every pod in precise mode
(`epp.prefix.precise.PreciseIndex.attach`):

- The engines run with KV events on (`SimEngine(kv_events=True)`); after every engine
  call the runner drains them (`drain_kv_events`, as `vllm_sim.server` drains them into
  its ZMQ publisher) and hands them to `on_kv_events`. Each drained batch goes through
  the real wire format: encoded as the pod's publisher encodes it
  (`vllm_sim.kv_events.encode_event_batch`, map-style msgpack), decoded by the router's
  own decoder (`epp.prefix.kv_events.KvEventDecoder`) and applied with
  `PreciseIndex.apply`, `delivery_s` of virtual time later (a ZMQ hop; default 10 ms).
  No batch is lost and none is reordered: what a lossy transport does is the live
  subscriber's business (`epp.prefix.kv_subscriber`), not measured here.
- A dispatched request's blocks become *predicted* entries on the chosen pod (what
  `PrefixIndex.record` does for a precise pod under the request's token), living in
  virtual time until `predicted_ttl_s` (default 2 s) after the request ended, at most
  `predicted_max_s` (120 s), unless an event confirms them.
- The router tokenizes with the engine's tokenizer (`EngineTokenizer`): precise mode
  keys the engine's blocks by the router's hash of their token ids, so it matches a
  request only when the router's token ids are the engine's. Live, that is the model's
  own tokenizer (`tokenizers:` in the config; tests/tokenization checks its parity with
  the simulator's `HfDirTokenizer`); here the simulated pods' `SimTokenizer` plays the
  model's tokenizer. `epp_precise_fixed2` and `epp_precise_fixed30` are the same with
  predicted entries living a fixed 2 s (the design before: 2 s is shorter than a
  request's wait in a deep engine queue, docs/benchmarks/precise.md) or 30 s from
  dispatch, whatever their request does. The approximate `epp` keeps its default byte estimate;
  `epp_approx_engine_tok` is the approximate EPP with the engine's tokenizer, to tell
  the tokenizer's share of a difference from the events'.
- Stale routing from the events (`PreciseIndex.dispatched` / `completed` as the Router's
  `before_record` and `completed` hooks, as `epp.wiring.connect` wires them; `poll` at every
  event, `epp.prefix.precise_stale`): reported as `stale_events` /
  `stale_events_checked`.

The runner also reports an engine-side stale rate for every EPP router
(`engine_stale`), the same definition for both modes.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from epp.config import EppConfig
from epp.prefix.kv_events import KvEventDecoder
from epp.prefix.precise import PreciseIndex
from epp.tokenization.protocol import ChatMessage, ChatOptions, Encoded
from epp_bench.virtual.epp import EppVirtualRouter
from epp_bench.virtual.types import PreparedRequest, VirtualPods
from vllm_sim.kv_events import KvEvent, encode_event_batch
from vllm_sim.tokenizer import ChatMessage as SimChatMessage
from vllm_sim.tokenizer import SimTokenizer

DEFAULT_DELIVERY_S = 0.010
# A decision is stale (engine side) when the engine reused less than this share of the
# prefix the EPP predicted for the chosen pod.
STALE_THRESHOLD = 0.5


class EngineTokenizer:
    """The simulated pods' tokenizer behind the router's `Tokenizer` protocol: the same
    ids the engine computes for a completion (with BOS, as vLLM encodes completions) and
    for a chat (Llama 3's template as the simulator renders it)."""

    name = "vllm-sim-pieces"

    def __init__(self) -> None:
        self._sim = SimTokenizer()

    def encode(self, text: str) -> array:
        return self._sim.encode(text, add_special_tokens=True)

    def encode_chat(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> array:
        turns = [SimChatMessage(m.role, m.content) for m in messages]
        generation = True if options is None else options.add_generation_prompt
        return self._sim.encode_chat(turns, add_generation_prompt=generation)

    def encode_prefix(self, text: str, max_tokens: int | None = None) -> Encoded:
        return _head(self.encode(text), max_tokens)

    def encode_chat_prefix(
        self,
        messages: Sequence[ChatMessage],
        max_tokens: int | None = None,
        options: ChatOptions | None = None,
    ) -> Encoded:
        return _head(self.encode_chat(messages, options), max_tokens)


def _head(ids: array, max_tokens: int | None) -> Encoded:
    if max_tokens is None or len(ids) <= max_tokens:
        return Encoded(ids, len(ids))
    return Encoded(ids[:max_tokens], len(ids))


class ApproxEngineTokEppRouter(EppVirtualRouter):
    """The approximate EPP tokenizing with the engine's tokenizer (module docstring)."""

    name = "epp_approx_engine_tok"

    def __init__(
        self,
        pods: VirtualPods,
        config: EppConfig | None = None,
        *,
        seed: int = 0,
        adapters: dict[str, str] | None = None,
    ) -> None:
        super().__init__(pods, config, seed=seed, adapters=adapters, tokenizer=EngineTokenizer())


class PreciseEppRouter(EppVirtualRouter):
    """The EPP with every pod precise, fed by the engines' KV events (module docstring)."""

    name = "epp_precise"

    def __init__(
        self,
        pods: VirtualPods,
        config: EppConfig | None = None,
        *,
        seed: int = 0,
        adapters: dict[str, str] | None = None,
        delivery_s: float = DEFAULT_DELIVERY_S,
        predicted_ttl_s: float | None = None,
        predicted_max_s: float | None = None,
    ) -> None:
        if delivery_s < 0:
            raise ValueError("delivery_s must not be negative")
        super().__init__(pods, config, seed=seed, adapters=adapters, tokenizer=EngineTokenizer())
        # Before any entry is predicted.
        ttl = self.index.predicted_ttl_s if predicted_ttl_s is None else predicted_ttl_s
        most = self.index.predicted_max_s if predicted_max_s is None else predicted_max_s
        if not 0 < ttl <= most:
            raise ValueError("need 0 < predicted_ttl_s <= predicted_max_s")
        self.index.predicted_ttl_s, self.index.predicted_max_s = ttl, most
        self.delivery_s = delivery_s
        self.precise = PreciseIndex(self.index, self.config.prefix.block_size)
        self.decoder = KvEventDecoder(stats=self.precise.stats)
        for name in pods.names:
            self.precise.attach(name, pods.served_model)
        # Stale routing as `epp.wiring.connect` wires it: a decision on a precise pod opens a
        # claim before its blocks are recorded; the claim is checked after it ended.
        self.router.hooks.before_record.append(self.precise.dispatched)
        self.router.hooks.completed.append(self.precise.completed)
        # (due, pod, payload) in due order (one delay for all: FIFO is due order).
        self._inbox: deque[tuple[float, str, bytes]] = deque()
        self.batches = 0
        self.payload_bytes = 0
        self.ingest_cpu_s = 0.0  # decoding and applying the batches (not in a decision)

    # -- events ------------------------------------------------------------------------

    def on_kv_events(self, pod_index: int, events: Sequence[KvEvent], now: float) -> None:
        """A pod's engine changed its cache at `now`: its batch arrives `delivery_s` later."""
        if not events:
            return
        payload = encode_event_batch(events, now)
        self.batches += 1
        self.payload_bytes += len(payload)
        self._inbox.append((now + self.delivery_s, self._pods.names[pod_index], payload))

    def _deliver(self, until: float) -> None:
        inbox = self._inbox
        if not inbox or inbox[0][0] > until:
            return
        started = time.process_time()
        while inbox and inbox[0][0] <= until:
            _, pod, payload = inbox.popleft()
            batch = self.decoder.decode(payload, pod)
            if batch is not None:
                self.precise.apply(pod, batch)
        self.ingest_cpu_s += time.process_time() - started

    def tick(self, now: float) -> None:
        super().tick(now)
        self._deliver(now)
        self.precise.poll(now)

    def flush(self) -> None:
        """Deliver everything still in flight and settle every claim (end of run)."""
        self._deliver(float("inf"))
        self.precise.poll(float("inf"))

    def stats(self) -> dict[str, Any]:
        self.flush()
        stale = self.precise.stale
        return {
            **super().stats(),
            "delivery_s": self.delivery_s,
            "predicted_ttl_s": self.index.predicted_ttl_s,
            "predicted_max_s": self.index.predicted_max_s,
            "predictions_capped": self.index.predictions_capped,
            "kv_event_batches": self.batches,
            "kv_event_bytes": self.payload_bytes,
            "kv_event_ingest_cpu_s": self.ingest_cpu_s,
            "kv_event_stats": dict(self.precise.stats.counts),
            "stale_events": stale.stale,
            "stale_events_checked": stale.checked,
            "stale_events_dropped": stale.dropped,
            "stale_events_rate": stale.stale / stale.checked if stale.checked else None,
        }


def engine_stale(
    predictions: Mapping[int, tuple[int, int]],
    outcomes: Sequence[Any],
    prepared: Sequence[PreparedRequest],
    block_size: int,
) -> dict[str, Any]:
    """The engine-side stale-routing rate, one definition for every EPP router.

    A decision that predicted `m` >= 1 cached blocks on the chosen pod is *checked* once
    its request started on that pod (status 200); it is *stale* when the prompt tokens
    the engine reused there (`cached_tokens`, looked up when its prefill began) are fewer
    than half the tokens predicted. The prediction is in the router's tokens and blocks
    (`m x block_size` of its `prompt_tokens`); it is scaled to the engine's prompt length
    (router and engine may tokenize differently) and capped at what an engine can reuse
    (it always computes the last prompt token: `(prompt_tokens - 1) // block_size`
    blocks).
    """
    checked = stale = 0
    predicted_tokens = reused_tokens = 0.0
    for index, (matched, router_tokens) in predictions.items():
        if matched < 1:
            continue
        outcome = outcomes[index]
        if outcome.status != 200 or not outcome.prompt_tokens:
            continue
        engine_tokens = prepared[index].prompt_tokens
        scale = engine_tokens / router_tokens if router_tokens else 1.0
        cap = (engine_tokens - 1) // block_size * block_size
        predicted = min(matched * block_size * scale, cap)
        if predicted <= 0:
            continue
        checked += 1
        predicted_tokens += predicted
        reused_tokens += min(outcome.cached_tokens, predicted)
        if outcome.cached_tokens < STALE_THRESHOLD * predicted:
            stale += 1
    return {
        "stale_engine": stale,
        "stale_engine_checked": checked,
        "stale_engine_rate": stale / checked if checked else None,
        # Of the tokens predicted cached on the chosen pods, the share the engines reused.
        "predicted_tokens_reused": reused_tokens / predicted_tokens if predicted_tokens else None,
    }
