"""The EPP process seen from outside, every few seconds: RSS and open fds from /proc (the
kernel's own count, no cooperation needed), asyncio tasks and the decision-latency
histogram from its /metrics page (read-only)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

DECISION_HISTOGRAM = "epp_scoring_latency_us"


@dataclass(slots=True)
class Sample:
    t_s: float
    rss_mb: float
    open_fds: int
    asyncio_tasks: float
    index_nodes: float  # epp_prefix_tree_nodes: bounded by the index's capacity
    # Cumulative epp_scoring_latency_us buckets: upper bound (us) -> count.
    decision_buckets: dict[float, float] = field(default_factory=dict)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def parse_page(text: str) -> tuple[float, float, dict[float, float]]:
    """(epp_asyncio_tasks, epp_prefix_tree_nodes, epp_scoring_latency_us cumulative buckets)
    from a /metrics page."""
    tasks = nodes = float("nan")
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "epp_asyncio_tasks":
            tasks = family.samples[0].value
        elif family.name == "epp_prefix_tree_nodes":
            nodes = family.samples[0].value
        elif family.name == DECISION_HISTOGRAM:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
    return tasks, nodes, buckets


class ProcessSampler:
    def __init__(self, pid: int, metrics_url: str, clock, interval_s: float = 5.0) -> None:
        self.pid = pid
        self.metrics_url = metrics_url
        self.clock = clock
        self.interval_s = interval_s
        self.samples: list[Sample] = []

    async def sample(self, session: aiohttp.ClientSession) -> Sample:
        async with session.get(self.metrics_url) as response:
            text = await response.text()
        tasks, nodes, buckets = parse_page(text)
        sample = Sample(self.clock(), rss_mb(self.pid), open_fds(self.pid), tasks, nodes, buckets)
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    await self.sample(session)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    print(f"soak: sample failed: {exc}", flush=True)
                await asyncio.sleep(self.interval_s)
