"""The event-loop lag monitor: records how late the loop wakes it, as metrics."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, generate_latest

from epp.observability.loop_lag import LoopLagMonitor
from epp.observability.metrics import EppMetrics


def test_recent_max_is_a_sliding_window():
    clock = [0.0]
    monitor = LoopLagMonitor(CollectorRegistry(), window_s=10.0, clock=lambda: clock[0])
    monitor.observe(0.5, now=0.0)
    monitor.observe(0.1, now=1.0)
    monitor.observe(0.2, now=2.0)
    assert monitor.recent_max() == 0.5
    clock[0] = 10.5  # the 0.5 s lag left the window
    assert monitor.recent_max() == 0.2
    clock[0] = 13.0
    assert monitor.recent_max() == 0.0
    assert monitor.worst == 0.5 and monitor.samples == 3


async def test_a_blocked_loop_shows_up_in_the_metrics():
    metrics = EppMetrics()
    monitor = metrics.loop_lag
    monitor.start()
    await asyncio.sleep(0.05)
    time.sleep(0.2)  # holds the loop: the monitor's next wake-up is at least this late
    await asyncio.sleep(0.05)
    await monitor.stop()
    # A lower bound the blocking guarantees (not a timing measurement that could flake).
    assert monitor.worst >= 0.2 - monitor.interval_s
    page = generate_latest(metrics.registry).decode()
    assert "epp_event_loop_lag_seconds_bucket" in page
    assert "epp_event_loop_lag_max_seconds" in page
    assert monitor.recent_max() == monitor.worst
