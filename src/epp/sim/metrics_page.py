"""The simulator's /metrics page, shaped like vLLM 0.33's.

Only the series a router reads are published, in the order and layout vLLM prints them
(see `tests/fixtures/vllm-0.33-metrics*.txt`, copied from vLLM 0.33 pages): gauges and prefix-cache counters first,
histograms next, `lora_requests_info` and `cache_config_info` last. Labels are sorted by
name, counters come as `_total` plus a `_created` gauge, values print like
prometheus_client prints them (`7.0`, `1.7959391218106837e+09`, `+Inf`), so a scraper
tuned on real pages parses this one unchanged.

Rendering is a pure function of engine state, latency histograms and the LoRA info
series, which keeps it usable from the HTTP server and from a virtual-time benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from epp.sim.engine import FinishReason, SimEngine
from epp.sim.latency import Histogram, LatencyStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM keeps every label set `lora_requests_info` ever had, each with the time it was last
# current; a scraper must take the newest. The simulator keeps the same behaviour, bounded.
MAX_LORA_INFO_SERIES = 32


class LoraInfoSeries:
    """`vllm:lora_requests_info` label sets, each with the unix time it was last current."""

    __slots__ = ("_last_seen", "max_loras")

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._last_seen: dict[tuple[str, str], float] = {}

    def observe(self, running: Iterable[str], waiting: Iterable[str], now_unix: float) -> None:
        key = (",".join(running), ",".join(waiting))
        # Re-insert so that dict order is oldest-first and trimming drops the stalest.
        self._last_seen.pop(key, None)
        self._last_seen[key] = now_unix
        while len(self._last_seen) > MAX_LORA_INFO_SERIES:
            del self._last_seen[next(iter(self._last_seen))]

    def series(self) -> list[tuple[dict[str, str], float]]:
        max_lora = str(self.max_loras)
        return [
            (
                {
                    "max_lora": max_lora,
                    "running_lora_adapters": running,
                    "waiting_lora_adapters": waiting,
                },
                seen,
            )
            for (running, waiting), seen in self._last_seen.items()
        ]


def format_value(value: float) -> str:
    """A sample value as prometheus_client (and so vLLM) prints it."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    dot = text.find(".")
    # Go, whose format Prometheus clients copy, switches to an exponent past 6 digits.
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0").rstrip(".")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    return ",".join(f'{key}="{_escape(labels[key])}"' for key in sorted(labels))


class _Page:
    """Accumulates exposition lines; one method per metric shape."""

    __slots__ = ("created", "lines")

    def __init__(self, created_unix: float) -> None:
        self.lines: list[str] = []
        self.created = format_value(created_unix)

    def header(self, name: str, kind: str, help_: str) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        self.lines.append(f"{name}{{{_labels(labels)}}} {format_value(value)}")

    def gauge(self, name: str, help_: str, labels: Mapping[str, str], value: float) -> None:
        self.header(name, "gauge", help_)
        self.sample(name, labels, value)

    def counter(self, name: str, help_: str, series: list[tuple[Mapping[str, str], float]]) -> None:
        self.header(f"{name}_total", "counter", help_)
        for labels, value in series:
            self.sample(f"{name}_total", labels, value)
        self.header(f"{name}_created", "gauge", help_)
        for labels, _ in series:
            self.lines.append(f"{name}_created{{{_labels(labels)}}} {self.created}")

    def histogram(self, name: str, labels: Mapping[str, str], histogram: Histogram) -> None:
        self.header(name, "histogram", "doc")
        bounds = [format_value(b) for b in histogram.bounds] + ["+Inf"]
        for bound, count in zip(bounds, histogram.cumulative(), strict=True):
            self.sample(f"{name}_bucket", {**labels, "le": bound}, count)
        self.sample(f"{name}_count", labels, histogram.count)
        self.sample(f"{name}_sum", labels, histogram.total)
        self.header(f"{name}_created", "gauge", "doc")
        self.lines.append(f"{name}_created{{{_labels(labels)}}} {self.created}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics_page(
    engine: SimEngine,
    *,
    model_name: str,
    created_unix: float,
    latency: LatencyStats,
    lora_info: LoraInfoSeries | None = None,
) -> str:
    """The whole /metrics page for one engine (`engine="0"`) serving `model_name`."""
    base = {"engine": "0", "model_name": model_name}
    counters = engine.counters
    config = engine.config
    page = _Page(created_unix)
    page.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        base,
        engine.num_running,
    )
    page.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        base,
        engine.num_waiting,
    )
    page.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        base,
        engine.kv_cache_usage,
    )
    page.counter("vllm:prefix_cache_queries", "doc", [(base, counters.prefix_cache_queries)])
    page.counter("vllm:prefix_cache_hits", "doc", [(base, counters.prefix_cache_hits)])
    page.counter("vllm:num_preemptions", "doc", [(base, counters.preemptions)])
    page.counter("vllm:prompt_tokens", "doc", [(base, counters.prompt_tokens)])
    page.counter("vllm:generation_tokens", "doc", [(base, counters.generation_tokens)])
    page.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [
            ({**base, "finished_reason": reason.value}, counters.finished[reason])
            for reason in FinishReason
        ],
    )
    page.histogram("vllm:time_to_first_token_seconds", base, latency.ttft)
    page.histogram("vllm:e2e_request_latency_seconds", base, latency.e2e)
    if lora_info is not None:
        page.header("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
        for labels, seen in lora_info.series():
            page.sample("vllm:lora_requests_info", labels, seen)
    page.gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": "0.9",
            "hash_block_size": str(config.block_size),
            "kv_cache_size_tokens": str(config.max_context_tokens),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "prefix_caching_hash_algo": "xxhash",
            "sliding_window": "None",
        },
        1.0,
    )
    return page.text()
