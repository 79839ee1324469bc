"""Discovery's state as Prometheus series, read at scrape time from a `DiscoveryState`
(epp.datalayer.discovery.state). The collector takes a callable so that it neither owns
nor imports the discovery source; it yields nothing while the callable returns None (no
discovery running, e.g. endpoints given in the configuration only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from epp.datalayer.discovery.state import DiscoveryState


class DiscoveryCollector(Collector):
    def __init__(self, state: Callable[[], DiscoveryState | None]) -> None:
        self._state = state

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the state; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        if state is None:
            return
        info = GaugeMetricFamily(
            "epp_discovery_info", "Discovery source in use (value 1).", labels=["mode"]
        )
        info.add_metric([state.mode], 1.0)
        yield info
        yield GaugeMetricFamily(
            "epp_discovery_endpoints",
            "Endpoints the discovery source delivers now.",
            value=state.endpoints,
        )
        yield GaugeMetricFamily(
            "epp_discovery_last_sync_ok",
            "1 when every watched resource's latest list/watch (or file read) succeeded.",
            value=1.0 if state.last_sync_ok else 0.0,
        )
        if state.last_sync_unix is not None:
            yield GaugeMetricFamily(
                "epp_discovery_last_sync_timestamp_seconds",
                "Unix time of the last endpoint list discovery delivered.",
                value=state.last_sync_unix,
            )
        for name, doc, value in (
            ("epp_discovery_relists", "Lists after the first (410 Gone, errors).", state.relists),
            (
                "epp_discovery_watch_restarts",
                "Watches opened again (server timeout, dropped connection).",
                state.watch_restarts,
            ),
            ("epp_discovery_errors", "Failed list/watch requests or file reads.", state.errors),
            ("epp_discovery_reloads", "Good reloads of the endpoints file.", state.reloads),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if state.pool_found is not None:
            yield GaugeMetricFamily(
                "epp_discovery_pool_found",
                "1 when the InferencePool exists and is valid (kubernetes discovery).",
                value=1.0 if state.pool_found else 0.0,
            )
        if state.resources:
            up = GaugeMetricFamily(
                "epp_discovery_resource_up",
                "1 when the resource's latest list/watch succeeded.",
                labels=["resource"],
            )
            present = GaugeMetricFamily(
                "epp_discovery_resource_present",
                "1 when the resource's API (an optional CRD) is installed; absent until known.",
                labels=["resource"],
            )
            for resource in state.resources:
                up.add_metric([resource.resource], 1.0 if resource.last_sync_ok else 0.0)
                if resource.present is not None:
                    present.add_metric([resource.resource], 1.0 if resource.present else 0.0)
            yield up
            yield present
