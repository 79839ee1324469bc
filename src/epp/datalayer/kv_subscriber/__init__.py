"""One pod's vLLM KV events over ZMQ, kept in step with the pod (the I/O of precise mode).

Modules: `subscriber` (the receive/replay loop and the rules below), `receiver` (one
pod's live socket as the loop sees it), `hub` (the one thread that reads and decodes
every followed pod's live socket), `sockets` (the ZMQ SUB and replay conversations),
`state` (settings, per-pod state, the sink contract), `pod_endpoints` (config and
labels -> a pod's endpoints and topic).

A `KvEventSubscriber` per followed pod:

- **Live**: a SUB socket connected to the pod's publisher, subscribed to its topic (a ZMQ
  prefix filter). A message is `[topic, seq (8 bytes, big-endian), payload]`; the payload
  is received and decoded (`epp.prefix.kv_events`) in the receiver thread (one for all followed pods), and
  applied to the index (`epp.prefix.precise`) on the loop, in order, in slices of
  bounded work, yielding to the event loop between slices, so that a burst of events
  never holds the loop for long (`slice_ms`). Why a thread: docs/benchmarks/loop.md.
- **Sequence gaps** (a batch lost: the publisher's queue overflowed, the network dropped
  it): the missed batches are asked from the pod's replay socket (DEALER to its ROUTER:
  `[b"", start seq]` -> `[b"", (topic,) seq, payload]` ... then seq ff..ff) and applied
  before the message that revealed the gap. If the replay does not cover the gap, or
  does not answer within `resync_timeout_s`, the pod's entries are dropped rather than
  trusted, and the subscriber goes on from the live message.
- **(Re)connection**: every time the ZMQ handshake with the publisher succeeds (first
  connect, and every reconnect: ZMQ reconnects by itself, with backoff up to
  `reconnect_max_s`), the pod's entries are dropped and rebuilt from a full replay (from
  seq 0: whatever the pod's buffer holds). A disconnect drops the entries at once: the
  publisher's process may be gone with its cache.
- **Duplicates**: a live batch whose sequence number was applied lately with the same
  payload (length and CRC-32 of the last `_RECENT` batches) is a copy (a batch sent
  twice, or a late one a replay already applied): ignored, not taken for a restart.
- **Publisher restart**: the sequence going back (with another payload), a restart seen
  elsewhere (`restarted()`: the store saw the pod's counters go back) or a new start time
  (`observe_start_time`: the pod's `process_start_time_seconds`, fed from every page by
  the wiring) drops the pod's entries and resyncs, even without a replay socket; except
  as follows.
- **A restart the subscriber already caught up with**: the new process's first page is
  often read after the subscriber has reconnected to it and rebuilt the entries from its
  replay (vLLM serves its page only once the engine is up, 20-70 s after the process
  started, while the subscriber reconnects within `reconnect_max_s` of the publisher
  binding). Dropping them again would leave the pod empty for routing until one more
  replay, for nothing. So a new start time S does not drop the entries when the last
  full resync (the entries dropped, then the pod's whole replay buffer applied, or no
  replay to ask: live events from then on) began at least `restart_margin_s` after S by
  the EPP's wall clock, finished without failure, and nothing since has put the entries
  in doubt (a disconnect, an error, a restart drop, a resync under way). Why that is
  enough: the old process was gone before the new one started (same ports), so a resync
  that began after S was answered by the new process, and what came live after it is
  the new process's too. Why the margin (3 s): S is the pod's clock, the resync's time
  ours; they may differ by about a second in a cluster, and `process_start_time_seconds`
  itself reads up to a second early (boot time truncated to whole seconds), both of
  which make the resync look later after S than it was; one more second to spare (a
  real engine's publisher binds 20-70 s after S, far beyond it). Any doubt drops: no
  completed resync since the restart, a resync that began earlier or within the margin,
  a restart the subscriber never saw itself (a forwarder in between keeps its connection
  and the sequence may go on: no resync at all since S), a restart seen from the
  counters only (no start time to compare: `restarted()` without `started_at`). A drop
  for a gap or an unreadable batch keeps the resync's standing: it only removes entries,
  and what follows is live. A skipped drop is counted (`restart_drops_skipped`) and
  logged. For a precise pod this is the only decision: the app's index listener leaves
  the store's `reset` of a followed precise pod to the wiring (`PreciseMode.owns_entries`).
- **Idle probe**: with a replay socket, after `probe_interval_s` without messages the
  subscriber asks for the batches after the last one it applied; a lost last batch is
  found this way instead of at the next message.
- **Mode** `auto`: the pod becomes precise (`sink.attach`) when its publisher completes a
  handshake, and goes back to approximate (`sink.detach`) after `fallback_after_s`
  without a connection. Mode `precise`: precise from the start, never approximate.

Bad input never ends the subscriber: every message is decoded defensively, and an
unexpected error in one cycle is logged, counted, and followed by a resync.
"""

from epp.datalayer.kv_subscriber.pod_endpoints import (
    LABEL_ENDPOINT,
    LABEL_MODE,
    LABEL_REPLAY,
    LABEL_TOPIC,
    PodKvEvents,
    format_endpoint,
    resolve_pod,
    split_address,
    topic_prefix,
)
from epp.datalayer.kv_subscriber.state import (
    KvEventSink,
    Mode,
    SubscriberSettings,
    SubscriberState,
)
from epp.datalayer.kv_subscriber.subscriber import KvEventSubscriber

__all__ = [
    "LABEL_ENDPOINT",
    "LABEL_MODE",
    "LABEL_REPLAY",
    "LABEL_TOPIC",
    "KvEventSink",
    "KvEventSubscriber",
    "Mode",
    "PodKvEvents",
    "SubscriberSettings",
    "SubscriberState",
    "format_endpoint",
    "resolve_pod",
    "split_address",
    "topic_prefix",
]
