"""Envoy's circuit breakers against many concurrent streaming generations, through the real
Envoy, the real `epp serve` and real simulated pods on loopback.

Envoy's default thresholds (1,024 connections, pending and active requests per cluster)
would need more than 1,024 streams to reach, too many for a test. So the whole fleet is
scaled down by 1,024 / 3: every threshold of the config `epp envoy-config` renders is
divided by that factor, and a threshold it leaves unset counts as Envoy's default 1,024
(scaled to 3, as issue 15 reproduced it). Then 8 streams, all held open at once, stand
for 2,730 at full scale. With the rendered breakers all are served, the EPP is told of
every end and its in-flight counts return to zero; with Envoy's defaults they are not.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import yaml

import epp_harness.stack
from epp.envoy_config import Completions, render
from epp_bench.picker.streams import envoy_stats, hold_streams, slow_pod_args
from epp_harness.stack import LocalStack

pytestmark = pytest.mark.e2e

ENVOY_DEFAULT_THRESHOLD = 1024  # max_connections, max_pending_requests, max_requests
SCALE = ENVOY_DEFAULT_THRESHOLD / 3
STREAMS = 8
TOKENS = 10
THRESHOLDS = ("max_connections", "max_pending_requests", "max_requests")


def scaled(config_yaml: str) -> str:
    """The config with every cluster's thresholds divided by SCALE (unset: Envoy's default)."""
    config = yaml.safe_load(config_yaml)
    for cluster in config["static_resources"]["clusters"]:
        breakers = cluster.setdefault("circuit_breakers", {"thresholds": [{}]})
        [threshold] = breakers["thresholds"]
        for key in THRESHOLDS:
            threshold[key] = max(1, int(threshold.get(key, ENVOY_DEFAULT_THRESHOLD) / SCALE))
    return yaml.safe_dump(config, sort_keys=False)


def without_breakers(config_yaml: str) -> str:
    config = yaml.safe_load(config_yaml)
    for cluster in config["static_resources"]["clusters"]:
        cluster.pop("circuit_breakers", None)
    return yaml.safe_dump(config, sort_keys=False)


async def _run(stack: LocalStack, settle_timeout_s: float = 10.0) -> tuple:
    """STREAMS streams held open together; what Envoy and the EPP counted meanwhile."""
    all_started = asyncio.Event()
    task = asyncio.create_task(
        hold_streams(
            stack,
            STREAMS,
            rate=1000.0,
            max_tokens=TOKENS,
            all_started=all_started,
            settle_timeout_s=settle_timeout_s,
        )
    )
    await all_started.wait()
    async with aiohttp.ClientSession() as session:
        during = await envoy_stats(session, stack.envoy_admin_url)
    return await task, during


def _stack(tmp_path, monkeypatch, edit, completions: Completions = "observer") -> LocalStack:
    monkeypatch.setattr(epp_harness.stack, "render", lambda **kw: edit(render(**kw)))
    # Each stream lasts TOKENS x 250 ms (2.5 s: the snapshot above comes well before any
    # ends); it is held at its first token until all have one.
    per_pod = STREAMS + 4
    return LocalStack(
        pods=1,
        sim_args=slow_pod_args(per_pod, decode_ms=250.0),
        epp_config_yaml=f"scheduling: {{running_slots: {per_pod}}}\n",
        work_dir=tmp_path,
        log_level="warning",
        stop_timeout_s=1.0,  # the streams have ended: nothing to drain
        completions=completions,
    )


@pytest.mark.parametrize("completions", ["observer", "access_log"])
def test_more_streams_than_the_scaled_default_are_all_served_and_counted(
    tmp_path, monkeypatch, completions
):
    with _stack(tmp_path, monkeypatch, scaled, completions) as stack:
        result, during = asyncio.run(_run(stack))
    assert dict(result.statuses) == {200: STREAMS}, result
    assert result.ok == STREAMS and not result.errors
    # All held open at once: each one a pod request, and with the observer filter a stream
    # to the EPP; with the access log the EPP cluster holds no stream per generation (the
    # log's one stream is on its own cluster, epp-completions).
    assert during["cluster.pods.upstream_rq_active"] == STREAMS
    if completions == "observer":
        assert during["cluster.epp.upstream_rq_active"] >= STREAMS
    else:
        assert during["cluster.epp.upstream_rq_active"] == 0
    assert result.peak_client_in_flight == STREAMS
    # Envoy refused nothing, and no stream to the EPP failed: the observer filter fails
    # open silently (the EPP never hears of that request's end), so a failure is only
    # visible in Envoy's ext_proc counters.
    assert not {k: v for k, v in result.envoy_end.items() if "overflow" in k}
    assert "http.llm.ext_proc.streams_failed" not in result.envoy_end
    assert "http.llm.ext_proc.failure_mode_allowed" not in result.envoy_end
    # The EPP's in-flight counts (ours and llm_d_epp_inflight_requests) are back to zero.
    assert result.settle_s is not None, result.end_in_flight
    assert set(result.end_in_flight.values()) == {0.0}


def test_envoys_default_breakers_scaled_down_lose_streams(tmp_path, monkeypatch):
    """The failure mode of issue 15 finding 1, kept visible: with Envoy's defaults (scaled)
    streams past the threshold fail with 5xx or the EPP never hears of their end (with the
    observer filter, as then: its streams fail open past the threshold)."""
    with _stack(tmp_path, monkeypatch, lambda text: scaled(without_breakers(text))) as stack:
        result, _ = asyncio.run(_run(stack, settle_timeout_s=0.0))
    overflow = {k: v for k, v in result.envoy_end.items() if "overflow" in k}
    assert overflow, result.envoy_end
    # Routing streams refused: 500 (fail-closed); observer streams refused: failed open.
    failed_open = result.envoy_end.get("http.llm.ext_proc.failure_mode_allowed", 0)
    assert result.five_xx > 0 and failed_open > 0, result
