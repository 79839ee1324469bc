"""A targeted reader of vLLM's Prometheus page: the handful of series routing uses.

A general Prometheus parser spends most of its time on histogram buckets (most of a vLLM
page). This scanner looks only at lines whose metric name is in `VLLM_METRICS` (so comments,
`_bucket` and `_created` lines never match), sums over the `engine` label (data-parallel
engines of one pod), and treats garbage as absent rather than failing the whole page.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

# metric name -> field of PodMetrics; old names (vLLM <= 0.11) map to the same field, and
# the new name wins when a page has both.
VLLM_METRICS: dict[str, str] = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage_old",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries_old",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits_old",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:generation_tokens_total": "generation_tokens",
    # The requests the pod finished and their prompt tokens (the histogram's count and
    # sum, observed at a request's end): the pod's own token count, which the stale check
    # compares with the EPP's (observability/stale.py).
    "vllm:request_prompt_tokens_count": "finished_requests",
    "vllm:request_prompt_tokens_sum": "finished_prompt_tokens",
}
LORA_INFO = "vllm:lora_requests_info"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# prometheus_client's process collector (vLLM's API server has it): the unix time the
# process started. A new value is a restarted server even if its counters have grown past
# the old ones. Not a vLLM series: alone it does not make a page a vLLM page.
START_TIME = "process_start_time_seconds"


@dataclass(slots=True)
class PodMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    generation_tokens: float = 0.0
    model: str | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_loras: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    finished_requests: float | None = None  # None: the page has no such histogram
    finished_prompt_tokens: float | None = None
    # process_start_time_seconds (None: not on the page); the store keeps the latest seen.
    start_time: float | None = None


class MetricsFormatError(ValueError):
    """The page has none of the series routing needs."""


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _split_labels(text: str) -> dict[str, str]:
    """Labels of one series: `a="x",b="y"` with backslash escapes; junk is skipped."""
    labels = dict(_LABEL.findall(text))
    if "\\" in text:
        for key, value in labels.items():
            labels[key] = re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)
    return labels


def _value(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def _names(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())


_WANTED = (*VLLM_METRICS, LORA_INFO, CACHE_CONFIG_INFO, START_TIME)


def _series(page: str) -> Iterator[tuple[str, str, str]]:
    """(name, label text, value text) of every series line of the wanted metrics."""
    for name in _WANTED:
        needle = "\n" + name
        pos = page.find(needle) if not page.startswith(name) else -1
        while True:
            start = pos + 1  # pos is the newline before the line (or -1: the page start)
            after = start + len(name)
            end = page.find("\n", after)
            if end < 0:
                end = len(page)
            if after < len(page) and page[start:after] == name and page[after] in "{ \t":
                line = page[after:end]
                labels = ""
                if line.startswith("{"):
                    close = line.rfind("}")
                    labels, line = (line[1:close], line[close + 1 :]) if close > 0 else ("", "")
                fields = line.split()
                if fields:
                    yield name, labels, fields[0]
            pos = page.find(needle, end - 1)
            if pos < 0:
                break


def parse_vllm_metrics(page: str) -> PodMetrics:
    """Read the routing signals from one /metrics page (raises MetricsFormatError if none)."""
    sums: dict[str, float] = {}
    result = PodMetrics()
    lora_stamp = -math.inf
    # A C-speed substring search per wanted name: the ~90% of lines that are histogram
    # buckets are never split into Python strings.
    for name, label_text, value_text in _series(page):
        value = _value(value_text)
        if value is None:
            continue
        labels = _split_labels(label_text) if label_text else {}
        target = VLLM_METRICS.get(name)
        if target is not None:
            sums[target] = sums.get(target, 0.0) + value
            if result.model is None and labels.get("model_name"):
                result.model = labels["model_name"]
        elif name == START_TIME:
            result.start_time = value
        elif name == LORA_INFO:
            # Old label sets are never removed; the newest (largest timestamp) is current.
            if value > lora_stamp:
                lora_stamp = value
                result.running_adapters = _names(labels.get("running_lora_adapters", ""))
                result.waiting_adapters = _names(labels.get("waiting_lora_adapters", ""))
                max_lora = labels.get("max_lora", "")
                result.max_loras = int(max_lora) if max_lora.isdigit() else None
        else:
            block_size = labels.get("block_size", "")
            blocks = labels.get("num_gpu_blocks", "")
            if block_size.isdigit():
                result.block_size = int(block_size)
            if blocks.isdigit():
                # Data-parallel engines each hold their own KV blocks.
                result.num_gpu_blocks = (result.num_gpu_blocks or 0) + int(blocks)
    if not sums and result.block_size is None and lora_stamp == -math.inf:
        raise MetricsFormatError("no vLLM metrics found on the page")
    for new, old in (
        ("kv_usage", "kv_usage_old"),
        ("prefix_queries", "prefix_queries_old"),
        ("prefix_hits", "prefix_hits_old"),
    ):
        if new not in sums and old in sums:
            sums[new] = sums[old]
    engines = max(1, _count_engines(page)) if "kv_usage" in sums else 1
    result.waiting = sums.get("waiting", 0.0)
    result.running = sums.get("running", 0.0)
    # Usage is a ratio per engine: the pod's usage is the engines' mean.
    result.kv_usage = min(1.0, max(0.0, sums.get("kv_usage", 0.0) / engines))
    result.prefix_queries = sums.get("prefix_queries", 0.0)
    result.prefix_hits = sums.get("prefix_hits", 0.0)
    result.preemptions = sums.get("preemptions", 0.0)
    result.generation_tokens = sums.get("generation_tokens", 0.0)
    result.finished_requests = sums.get("finished_requests")
    result.finished_prompt_tokens = sums.get("finished_prompt_tokens")
    return result


def _count_engines(page: str) -> int:
    """Number of kv-usage series (one per data-parallel engine)."""
    count = 0
    for prefix in ("vllm:kv_cache_usage_perc{", "vllm:kv_cache_usage_perc "):
        count += page.count("\n" + prefix) + (1 if page.startswith(prefix) else 0)
    if count == 0:
        for prefix in ("vllm:gpu_cache_usage_perc{", "vllm:gpu_cache_usage_perc "):
            count += page.count("\n" + prefix) + (1 if page.startswith(prefix) else 0)
    return count
