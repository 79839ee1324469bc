"""Precise mode as Prometheus series, read at scrape time: the KV-event counts
(`KvEventStats.counts`, shared by the decoder, the precise index and every subscriber) and
each followed pod's subscriber state (epp.datalayer.kv_subscriber.SubscriberState). Like
the discovery collector, it takes callables and owns nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from epp.datalayer.kv_subscriber import KvEventSubscriber
    from epp.prefix.kv_events import KvEventStats


class KvEventsCollector(Collector):
    def __init__(
        self,
        stats: KvEventStats,
        subscribers: Callable[[], Mapping[str, KvEventSubscriber]],
        predictions_capped: Callable[[], int] = lambda: 0,
    ) -> None:
        self._stats = stats
        self._subscribers = subscribers
        self._capped = predictions_capped

    def describe(self) -> Iterator[Metric]:
        return iter(())  # read at scrape time only

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "epp_kv_events",
            "KV events (vLLM, precise mode) by reason: blocks stored/removed, clears,"
            " resyncs, gaps, restarts, and every problem counted (malformed, unknown pod,"
            " unknown parent...); docs/metrics.md.",
            labels=["reason"],
        )
        for reason, count in sorted(self._stats.counts.items()):
            events.add_metric([reason], float(count))
        yield events
        capped = CounterMetricFamily(
            "epp_predicted_entries_capped",
            "Predicted index entries dropped at kv_events.predicted_max_s while their request"
            " was still open (a completion the EPP never heard of, or a very long request).",
        )
        capped.add_metric([], float(self._capped()))
        yield capped
        subs = sorted(self._subscribers().items())
        gauges = {
            "epp_pod_kv_events_connected": (
                "1 while the pod's KV-event publisher is connected (ZMQ handshake done).",
                lambda s: s.state.connected,
            ),
            "epp_pod_kv_events_attached": (
                "1 while the pod is precise: its KV events decide its index entries.",
                lambda s: s.state.attached,
            ),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["pod"])
            for pod, sub in subs:
                family.add_metric([pod], 1.0 if value(sub) else 0.0)
            yield family
        counters = {
            "epp_pod_kv_events_messages": (
                "Live KV-event batches applied for the pod (this subscriber).",
                lambda s: s.state.messages,
            ),
            "epp_pod_kv_events_gaps": (
                "Sequence gaps in the pod's KV events (batches lost), this subscriber.",
                lambda s: s.state.gaps,
            ),
            "epp_pod_kv_events_resyncs": (
                "Full resyncs of the pod's entries (drop + replay from its buffer).",
                lambda s: s.state.resyncs,
            ),
            "epp_pod_kv_events_restarts": (
                "Publisher restarts detected for the pod (sequence back, counters reset).",
                lambda s: s.state.restarts,
            ),
        }
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(name, doc, labels=["pod"])
            for pod, sub in subs:
                counter.add_metric([pod], float(value(sub)))
            yield counter
