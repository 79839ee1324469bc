"""vLLM's KV-cache event batches, decoded strictly and defensively (no I/O here).

A batch is frame 3 of a ZMQ message from a vLLM pod's publisher (docs: vllm.md):
`[ts, events, data_parallel_rank]`. The modules, in the order data flows:

- `fields`: the kinds of field an event carries and how each is read by hand;
- `events`: the events the router keeps (`BlockStored`, `BlockRemoved`,
  `AllBlocksCleared`), the one declaration of their fields;
- `layouts`: the layouts vLLM sends (map events with int or bytes hashes, the pre-0.26
  positional events), each built from that declaration, and the by-hand reader;
- `decoder`: `KvEventDecoder`, bounded by `DecodeLimits`; never raises on input;
- `stats`: `KvEventStats`, the problem counters (`REASONS`) and their rate-limited warning;
- `split`: `split_events`, a batch cut into slices of bounded work;
- `frames`: the sequence frame.
"""

from epp.prefix.kv_events.decoder import DecodeLimits, KvEventDecoder
from epp.prefix.kv_events.events import (
    MEDIUM_GPU,
    SPEC_FULL_ATTENTION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)
from epp.prefix.kv_events.fields import MASK64
from epp.prefix.kv_events.frames import REPLAY_END_SEQ, SEQ_BYTES, decode_seq, encode_seq
from epp.prefix.kv_events.split import event_blocks, split_events
from epp.prefix.kv_events.stats import REASONS, KvEventStats

__all__ = [
    "MASK64",
    "MEDIUM_GPU",
    "REASONS",
    "REPLAY_END_SEQ",
    "SEQ_BYTES",
    "SPEC_FULL_ATTENTION",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeLimits",
    "EventBatch",
    "KvEvent",
    "KvEventDecoder",
    "KvEventStats",
    "decode_seq",
    "encode_seq",
    "event_blocks",
    "split_events",
]
