"""What the pods themselves say during a run: prefix-cache counters and occupancy gauges.

The hit rate is the pods' own: the increase of `vllm:prefix_cache_hits_total` over that of
`vllm:prefix_cache_queries_total`, summed over the pods, between a scrape before the run
and one after. The occupancy samples (running and waiting requests, every `interval_s`)
tell whether the simulated GPUs were the bottleneck: a queue that builds up on the pods
means the engines were full, whatever the CPU did.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer.metrics_parser import PodMetrics, parse_vllm_metrics
from epp_harness.stack import PodInfo
from epp_harness.stats import prefix_hit_rate

_SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class PodPage:
    """One scrape of one pod: the routing gauges and counters, plus its TTFT histogram's
    total and count (engine seconds), which tell how much of the client's TTFT the pod
    itself accounts for."""

    metrics: PodMetrics
    ttft_sum_s: float
    ttft_count: float


_TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
_TTFT_COUNT = "vllm:time_to_first_token_seconds_count"


def parse_pod_page(text: str) -> PodPage:
    totals = {_TTFT_SUM: 0.0, _TTFT_COUNT: 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:time_to_first_token_seconds_"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, rest = line.partition(" ")
        if name in totals:
            try:
                totals[name] += float(rest.rsplit(None, 1)[-1])
            except (ValueError, IndexError):
                continue
    return PodPage(parse_vllm_metrics(text), totals[_TTFT_SUM], totals[_TTFT_COUNT])


async def scrape_pods(
    session: aiohttp.ClientSession, pods: Sequence[PodInfo]
) -> dict[str, PodPage]:
    """Each pod's page by name; a pod that does not answer is left out."""

    async def one(pod: PodInfo) -> PodPage | None:
        try:
            async with session.get(pod.metrics_url) as response:
                if response.status != 200:
                    return None
                return parse_pod_page(await response.text(errors="replace"))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    pages = await asyncio.gather(*(one(pod) for pod in pods))
    return {pod.name: page for pod, page in zip(pods, pages, strict=True) if page is not None}


def hit_rate(before: dict[str, PodPage], after: dict[str, PodPage]) -> float | None:
    """The pods' own prefix-cache hit rate between two scrapes (`prefix_hit_rate`)."""
    return prefix_hit_rate(
        {name: page.metrics for name, page in before.items()},
        {name: page.metrics for name, page in after.items()},
    )


def pod_ttft_mean_s(before: dict[str, PodPage], after: dict[str, PodPage]) -> float | None:
    """Mean TTFT the pods measured themselves over the run (engine seconds)."""
    total = count = 0.0
    for name, end in after.items():
        start = before.get(name)
        if start is not None:
            total += end.ttft_sum_s - start.ttft_sum_s
            count += end.ttft_count - start.ttft_count
    return total / count if count > 0 else None


@dataclass(slots=True)
class Occupancy:
    """Sums over the pods at each sample."""

    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)

    def summary(self, slots_total: int) -> dict[str, float | None]:
        if not self.running:
            return {"samples": 0}
        count = len(self.running)
        return {
            "samples": count,
            "running_mean": sum(self.running) / count,
            "running_max": max(self.running),
            "slots_busy_mean": sum(self.running) / count / slots_total if slots_total else None,
            "waiting_mean": sum(self.waiting) / count,
            "waiting_max": max(self.waiting),
            "samples_with_queue": sum(1 for w in self.waiting if w > 0) / count,
        }


@contextlib.asynccontextmanager
async def sample_occupancy(
    session: aiohttp.ClientSession, pods: Sequence[PodInfo], interval_s: float = 1.0
) -> AsyncIterator[Occupancy]:
    """Sample the pods' running/waiting gauges in the background while the block runs.

    Once a second is cheap next to the EPP's own 20 scrapes a second, so it does not
    change what it measures.
    """
    occupancy = Occupancy()

    async def loop() -> None:
        while True:
            await asyncio.sleep(interval_s)
            pages = await scrape_pods(session, pods)
            if pages:
                occupancy.running.append(sum(p.metrics.running for p in pages.values()))
                occupancy.waiting.append(sum(p.metrics.waiting for p in pages.values()))

    task = asyncio.create_task(loop())
    try:
        yield occupancy
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_S))


# The EPP's own account of a run (its /metrics page): how many decisions it made and what
# they cost in its scheduler, as opposed to the process CPU measured from /proc.
_EPP_SUMS = {
    "decisions": "epp_routing_decisions_total",
    "scoring_latency_us_sum": "epp_scoring_latency_us_sum",
    "scoring_latency_us_count": "epp_scoring_latency_us_count",
    "cache_match_sum": "epp_cache_match_ratio_sum",
    "cache_match_count": "epp_cache_match_ratio_count",
    "best_match_sum": "epp_best_cache_match_ratio_sum",
    "best_match_count": "epp_best_cache_match_ratio_count",
    # Stale routing as the EPP itself counts it: from the pods' hit counters for an
    # approximate pod, from its KV events for a precise one (epp.observability.stale).
    "stale": "epp_stale_cache_routing_total",
    "stale_checked": "epp_stale_cache_checked_total",
    "kv_events": "epp_kv_events_total",  # every reason: stored, removed, cleared, gaps...
}


def parse_epp_stats(page: str) -> dict[str, float]:
    """Totals from an EPP metrics page, plus the means they imply (absent ones omitted)."""
    wanted = {metric: key for key, metric in _EPP_SUMS.items()}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                totals[key] = totals.get(key, 0.0) + sample.value
    for mean, (total, count) in {
        "scoring_latency_us_mean": ("scoring_latency_us_sum", "scoring_latency_us_count"),
        "cache_match_mean": ("cache_match_sum", "cache_match_count"),
        "best_match_mean": ("best_match_sum", "best_match_count"),
    }.items():
        if totals.get(count):
            totals[mean] = totals[total] / totals[count]
    return totals


async def scrape_epp_stats(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return {}
            return parse_epp_stats(await response.text(errors="replace"))
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return {}
