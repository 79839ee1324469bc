"""Precise mode: a pod's own KV events decide what the index says it holds.

`PreciseIndex.apply(pod, batch)` applies one decoded batch (`epp.prefix.kv_events`) of a
followed pod to the prefix index (`epp.prefix.index`), in order:

- `BlockStored`: each engine block is keyed by the router's own chained hash of its
  `token_ids` (`epp.prefix.hashing`), exactly as the router hashes a request's prompt, so
  a request matches what the engine really holds. The chain starts from the parent's key
  (looked up by the engine's `parent_block_hash`), or at prompt start from
  `chain_seed(model or LoRA name, LoRA name, cache_salt)`, the router's own seed: the
  LoRA name comes from `lora_name` (or, from engines that do not send it, the first extra
  key of block 0 when `lora_id` is set) and `cache_salt` from block 0's extra keys, as
  the engine mixes them. Extra keys we cannot reproduce (multimodal hashes) are mixed
  into the key, so those blocks never match a text prompt, as they should not. An engine
  block of k x `block_size` tokens gives k keys of ours; a size that is not a multiple of
  ours is counted (`unsupported_block_size`) and kept unmatchable.
- A parent the index does not know (the router restarted, the replay buffer did not go
  back far enough, the capacity bound dropped it) is first *placed*: vLLM computes a
  prompt from the first block it lacks, so the parent of a stored block was a hit and
  every block before it too. If the block's tokens continue exactly one open prediction
  of the pod (a request routed there) right after that prediction's block p - 1, the
  parent is that block and the prediction's prefix up to it is relearnt as reported
  (`relearned_blocks`; two predictions placing it differently: `relearn_ambiguous`, not
  guessed). Invariant: an entry is reported only on the engine's word, a BlockStored of
  the block or of a child that continues a prompt routed to that pod. A parent that
  cannot be placed is not dropped silently: the blocks are kept under their engine
  hashes with no key (`unknown_parent`), so that their eviction is recognised and their
  children are known to be unmatchable too. They match nothing; a resync replaces them.
- `BlockRemoved`: the engine hash names our keys; they are dropped for this pod only.
- `AllBlocksCleared`: the pod's entries are all dropped (its predicted entries too).
- Blocks on other tiers (`medium` CPU, disk) and KV cache groups other than full
  attention are ignored, and counted.

Predicted entries are the index's (`PrefixIndex.record` on a precise pod, under the
request's route token): a block the engine reports confirms its prediction; unconfirmed
ones go `predicted_ttl_s` after their request ended (`completed`, the Router's
completion listener), or at `predicted_max_s` at the latest.

Everything here is synchronous, bounded by the events given, and touches only the named
pod's bit in the index: bad input for one pod never changes another pod's entries.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import xxhash

from epp.prefix.hashing import BlockHash, block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.prefix.kv_events import (
    MEDIUM_GPU,
    SPEC_FULL_ATTENTION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    KvEventStats,
)
from epp.prefix.precise_stale import PreciseStaleCheck, claim_cap

_encode = msgspec.msgpack.Encoder().encode
_NO_KEYS: tuple[BlockHash, ...] = ()
# Candidate blocks of open predictions hashed to place one stored block of an unknown
# parent (about 0.2 us each): a bound on the work one event can cause.
_RELEARN_BUDGET = 4096


def request_seed(model: str | None, lora_name: str | None, cache_salt: str | None) -> int:
    """The chain seed the router uses for a request served as `lora_name` (an adapter) or
    else as `model` (epp.routing: `chain_seed(served, adapter, cache_salt)`)."""
    return chain_seed(lora_name or model or "", lora_name, cache_salt)


class PreciseIndex:
    """Applies the KV events of followed (`attach`ed) pods to a PrefixIndex."""

    def __init__(
        self,
        index: PrefixIndex,
        block_size: int,
        stats: KvEventStats | None = None,
        stale: PreciseStaleCheck | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.index = index
        self.block_size = block_size
        self.stats = stats or KvEventStats()
        self.stale = stale or PreciseStaleCheck()
        self._models: dict[str, str | None] = {}
        self._engine_block_size: dict[str, int] = {}  # the last one each pod's events showed
        # Called with the pod after `detach`: its KV state no longer comes as events (the
        # wiring wakes its scrape loop, which then needs pages at the fast interval).
        self.detached: list[Callable[[str], None]] = []

    # -- pods -------------------------------------------------------------------------

    def attach(self, pod: str, model: str | None) -> None:
        """Follow the pod's events: it is precise from now on. `model` is the name it
        serves (what clients put in `model`), the root of its chain seeds. Its
        approximate entries are dropped; so are its precise ones if the model changed."""
        if pod in self._models and self._models[pod] != model:
            self.index.clear_pod(pod)
        self._models[pod] = model
        self.index.set_precise(pod, True)

    def detach(self, pod: str) -> None:
        """Stop following the pod: it is approximate again, with no entries."""
        self._models.pop(pod, None)
        self.index.set_match_unit(pod, 1)
        self.stale.forget_pod(pod)
        self.index.set_precise(pod, False)
        for listener in self.detached:
            listener(pod)

    def remove_pod(self, pod: str) -> None:
        self._models.pop(pod, None)
        self.index.set_match_unit(pod, 1)
        self._engine_block_size.pop(pod, None)
        self.stale.forget_pod(pod)
        self.index.remove_pod(pod)

    def is_attached(self, pod: str) -> bool:
        return pod in self._models

    def reset_pod(self, pod: str) -> None:
        """Drop the pod's entries (a resync starts, the publisher restarted, events were
        lost): the pod stays precise and followed. Its open stale-routing claims are
        dropped unchecked: what its engine computed meanwhile may be unknown."""
        if pod in self._models:
            self.index.clear_pod(pod)
            self.stale.forget_pod(pod)

    # -- stale routing (epp.prefix.precise_stale) ---------------------------------------

    def dispatched(
        self,
        token: str,
        pod: str,
        hashes: Sequence[BlockHash],
        matched: int,
        prompt_tokens: int,
        now: float,
    ) -> bool:
        """A decision sent `hashes` to a precise pod predicting `matched` blocks cached:
        open its stale-routing claim (call before `index.record` of the same hashes).
        False (nothing to check) for approximate pods and predictions of nothing."""
        if matched < 1 or pod not in self._models or not self.index.is_precise(pod):
            return False
        engine_bs = self._engine_block_size.get(pod, self.block_size)
        claimed = min(matched, claim_cap(prompt_tokens, self.block_size, engine_bs), len(hashes))
        if claimed < 1:
            return False
        return self.stale.dispatched(
            token,
            pod,
            hashes,
            matched,
            prompt_tokens,
            block_size=self.block_size,
            engine_block_size=engine_bs,
            confirmed=self.index.reported(pod, hashes[claimed - 1]),
            now=now,
        )

    def completed(self, token: str, now: float) -> None:
        """The request routed under `token` ended (the Router's completion listener): its
        predicted entries live `predicted_ttl_s` more; its stale-routing claim is due."""
        self.index.completed(token, now)
        self.stale.completed(token, now)

    def poll(self, now: float) -> None:
        """Check due stale-routing claims (`self.stale.stale` / `.checked` grow)."""
        self.stale.poll(now)

    # -- events -----------------------------------------------------------------------

    def apply(self, pod: str, batch: EventBatch) -> int:
        return self.apply_events(pod, batch.events)

    def apply_events(self, pod: str, events: Sequence[KvEvent]) -> int:
        """Apply events in order; the number of engine blocks they named. Events for a
        pod that is not attached are dropped and counted."""
        if pod not in self._models or not self.index.is_precise(pod):
            self.stats.problem("unknown_pod", len(events), pod=pod)
            return 0
        blocks = 0
        for event in events:
            if isinstance(event, BlockStored):
                blocks += len(event.block_hashes)
                self._stored(pod, event)
            elif isinstance(event, BlockRemoved):
                blocks += len(event.block_hashes)
                self._removed(pod, event)
            elif isinstance(event, AllBlocksCleared):
                self.index.clear_pod(pod)
                self.stats.add("all_blocks_cleared")
        return blocks

    def _removed(self, pod: str, event: BlockRemoved) -> None:
        stats = self.stats
        if self._ignored(event, len(event.block_hashes)):
            return
        found = self.index.remove_engine_blocks(pod, event.block_hashes)
        stats.add("blocks_removed", found)
        if found != len(event.block_hashes):
            stats.add("unknown_removals", len(event.block_hashes) - found)

    def _stored(self, pod: str, event: BlockStored) -> None:
        hashes = event.block_hashes
        if self._ignored(event, len(hashes)):
            return
        self.stats.add("blocks_stored", len(hashes))
        index = self.index
        keys = self._keys(pod, event)
        if keys is None:  # counted: kept unmatchable
            index.store_engine_blocks(pod, hashes, _NO_KEYS, 1)
            return
        per_block = event.block_size // self.block_size
        index.store_engine_blocks(pod, hashes, keys, per_block)
        self._engine_block_size[pod] = event.block_size
        index.set_match_unit(pod, per_block)
        self.stale.stored(pod, keys)

    def _ignored(self, event: BlockStored | BlockRemoved, n: int) -> bool:
        """Blocks on another tier, or of a KV cache group other than full attention:
        counted, not applied."""
        if event.medium not in (None, MEDIUM_GPU):
            self.stats.add("ignored_medium", n)
            return True
        other_spec = isinstance(event, BlockStored) and event.kv_cache_spec_kind not in (
            None,
            SPEC_FULL_ATTENTION,
        )
        if event.group_idx or other_spec:
            self.stats.add("ignored_group", n)
            return True
        return False

    def _keys(self, pod: str, event: BlockStored) -> list[BlockHash] | None:
        """Our keys of the stored blocks (`per_block` a block, in order); None (counted)
        when they cannot be known."""
        ours = self.block_size
        if event.block_size % ours:
            self.stats.problem(
                "unsupported_block_size",
                len(event.block_hashes),
                pod=pod,
                engine_block_size=event.block_size,
                block_size=ours,
            )
            return None
        seed = self._seed(pod, event)
        if seed is None:
            return None
        try:
            tokens = array("I", event.token_ids)
        except (OverflowError, TypeError):
            self.stats.problem("invalid_event", pod=pod, error="a token id outside 0..2**32-1")
            return None
        opaque = self._opaque(event)
        if opaque is None:
            return block_hashes(tokens, ours, seed)
        self.stats.add("opaque_extra_keys", sum(1 for item in opaque if item is not None))
        return _keys_with_extras(tokens, event.block_size, ours, seed, opaque)

    def _seed(self, pod: str, event: BlockStored) -> int | None:
        """The chain seed of the stored blocks: the root seed at prompt start, else the
        parent's last key (relearnt if the index lacks it). None (counted) if unknown."""
        n = len(event.block_hashes)
        if event.parent_block_hash is None:
            seed = self._root_seed(pod, event)
            if seed is None:
                self.stats.add("opaque_extra_keys", n)
            return seed
        parent = self.index.engine_block(pod, event.parent_block_hash)
        if not parent:  # None: never seen; (): seen, but its keys are unknown
            parent = self._relearn_parent(pod, event, self.block_size)
        if not parent:
            self.stats.add("unknown_parent", n)
            return None
        return parent if isinstance(parent, int) else parent[-1]

    def _relearn_parent(self, pod: str, event: BlockStored, ours: int) -> BlockHash | None:
        """Our key for the unknown parent of a stored block, learnt from what was routed to
        the pod; None if no open prediction tells it, or two tell different ones.

        vLLM computes a prompt from the first block it lacks: every block before the
        first one it stores was a hit, held by the engine. So if the stored block's tokens
        continue exactly one open prediction of the pod after its block `p - 1` (our key
        of block p, chained from block p - 1, is the prediction's next key), the parent is
        that block and the engine holds the prediction's whole prefix up to it: relearnt
        as reported (`PrefixIndex.relearn_engine_block`). Plain text blocks only (no
        foreign extra keys). Bounded: at most `_RELEARN_BUDGET` candidate blocks hashed."""
        if len(event.token_ids) < ours or self._opaque(event) is not None:
            return None
        try:
            first = array("I", event.token_ids[:ours]).tobytes()
        except (OverflowError, TypeError):
            return None
        digest = xxhash.xxh64_intdigest
        found: list[BlockHash] | None = None
        budget = _RELEARN_BUDGET
        for keys in self.index.open_predictions(pod):
            for p in range(1, min(len(keys), budget + 1)):
                if digest(first, keys[p - 1]) == keys[p]:
                    if found is None:
                        found = keys[:p]
                    elif found[-1] != keys[p - 1]:
                        self.stats.add("relearn_ambiguous")
                        return None
                    break
            budget -= len(keys) - 1
            if budget <= 0:
                break
        parent = event.parent_block_hash
        if found is None or parent is None:
            return None
        if not self.index.relearn_engine_block(pod, parent, found):
            return None
        self.stats.add("relearned_blocks", len(found))
        return found[-1]

    def _root_seed(self, pod: str, event: BlockStored) -> int | None:
        """The chain seed of a prompt's first block; None if its extra keys hold more than
        the LoRA name and a cache salt (we cannot reproduce such a key)."""
        lora = _lora_name(event)
        salt: str | None = None
        extra = event.extra_keys
        if extra:
            rest = _without_lora(extra[0], lora)
            if rest:
                if len(rest) != 1 or not isinstance(rest[0], str):
                    return None
                salt = rest[0]
        return request_seed(self._models.get(pod), lora, salt)

    @staticmethod
    def _opaque(event: BlockStored) -> list[Any] | None:
        """Per block, the extra keys beyond the LoRA name (and block 0's salt) as a hashable
        value, None where there are none; None overall when no block has any."""
        extra = event.extra_keys
        if not extra or extra.count(None) == len(extra):  # vLLM sends None per plain block
            return None
        lora = _lora_name(event)
        out: list[Any] | None = None
        for i, keys in enumerate(extra):
            rest = _without_lora(keys, lora)
            if i == 0 and event.parent_block_hash is None and rest:
                rest = rest[1:]  # the salt, already in the seed (see _root_seed)
            if rest:
                if out is None:
                    out = [None] * len(extra)
                out[i] = rest
        return out


def _lora_name(event: BlockStored) -> str | None:
    if event.lora_name is not None:
        return event.lora_name
    if event.lora_id is not None and event.extra_keys:
        first = event.extra_keys[0]
        if isinstance(first, list | tuple) and first and isinstance(first[0], str):
            return first[0]  # an engine that does not send lora_name: its first extra key
    return None


def _without_lora(keys: object, lora: str | None) -> list[Any]:
    if keys is None:
        return []
    items = list(keys) if isinstance(keys, list | tuple) else [keys]
    if lora is not None and items and items[0] == lora:
        return items[1:]
    return items


def _keys_with_extras(
    tokens: array, engine_block_size: int, ours: int, seed: int, opaque: list[Any]
) -> list[BlockHash]:
    """Our keys block by block, with each engine block's foreign extra keys mixed into its
    seed (so its keys and every later one differ from a plain text prompt's)."""
    keys: list[BlockHash] = []
    prev = seed
    for i, extra in enumerate(opaque):
        if extra is not None:
            try:
                mixed = _encode(extra)
            except (TypeError, ValueError, OverflowError):
                mixed = repr(extra).encode("utf-8", "surrogatepass")
            prev = xxhash.xxh64_intdigest(mixed, prev)
        chunk = tokens[i * engine_block_size : (i + 1) * engine_block_size]
        group = block_hashes(chunk, ours, prev)
        keys.extend(group)
        prev = group[-1]
    return keys


__all__ = ["PreciseIndex", "PreciseStaleCheck", "request_seed"]
