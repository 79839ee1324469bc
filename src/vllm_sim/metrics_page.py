"""The simulator's /metrics page, shaped like vLLM 0.33's.

Every series of vLLM 0.33's page the engine can compute is published, with vLLM's
names, help texts, label sets and order (see `tests/fixtures/vllm-0.33-metrics*.txt`,
copied from vLLM 0.33 pages): gauges and counters first, histograms next,
`lora_requests_info` and `cache_config_info` last. `cache_config_info` has the labels
and unset values vLLM 0.32 prints (the real vLLM of docs/benchmarks/sim-vs-vllm.md). Labels are sorted by
name, counters come as `_total` plus a `_created` gauge, values print like
prometheus_client prints them (`7.0`, `1.7959391218106837e+09`, `+Inf`), so a scraper
tuned on real pages parses this one unchanged.

Rendering is a pure function of engine state, latency histograms and the LoRA info
series, which keeps it usable from the HTTP server and from a virtual-time benchmark.

The HTTP server also passes its process's start time, which a real vLLM's page carries
first (prometheus_client's process collector: `process_start_time_seconds`, the unix time
the process started); a router tells a restarted server by it. The fixtures are vLLM's
`vllm:` families only, so a page rendered without it compares with them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client.process_collector import ProcessCollector

from vllm_sim.engine import EngineConfig, FinishReason, SimEngine
from vllm_sim.latency import Histogram, LatencyStats

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


def process_start_time() -> float | None:
    """This process's start time (unix seconds) as vLLM's page reports its own: from
    prometheus_client's process collector (/proc; None where there is no /proc)."""
    for family in ProcessCollector(registry=None).collect():
        if family.name == "process_start_time_seconds" and family.samples:
            return float(family.samples[0].value)
    return None


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

    def gauges(self, name: str, help_: str, series: list[tuple[Mapping[str, str], float]]) -> None:
        self.header(name, "gauge", help_)
        for labels, value in series:
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


# Labels of `cache_config_info` the simulator has no value for, as vLLM prints settings
# that are unset. The set is vLLM 0.32's (the version `tools/vllm_check` ran against, see
# docs/benchmarks/sim-vs-vllm.md): vLLM 0.33 adds `simple_cpu_offload_num_blocks`.
_UNSET_CACHE_CONFIG_LABELS = (
    "_block_size_resolved",
    "cache_hit_alignment_tokens",
    "effective_attention_block_size",
    "enable_mamba_shared_prefix_checkpoint",
    "hash_block_size",
    "is_attention_free",
    "kv_cache_dtype_skip_layers",
    "kv_cache_layout",
    "kv_cache_max_concurrency",
    "kv_cache_memory_bytes",
    "kv_offloading_backend",
    "kv_offloading_size",
    "kv_sharing_fast_prefill",
    "mamba_block_size",
    "mamba_cache_dtype",
    "mamba_cache_mode",
    "mamba_page_size_padded",
    "mamba_ssm_cache_dtype",
    "num_cpu_blocks",
    "num_gpu_blocks_override",
    "prefix_cache_retention_interval",
    "prefix_match_unit",
    "replayssm_buffer_len",
    "skip_page_size_padded",
    "sliding_window",
    "swa_bounded_replay",
    "use_kda_recoverssm",
    "use_replayssm",
    "user_specified_block_size",
)


def cache_config_labels(config: EngineConfig) -> dict[str, str]:
    """`vllm:cache_config_info`'s labels: vLLM 0.32's set, ours where we have a value.

    `hash_block_size` is "None", as vLLM's API server prints it when the engine resolves
    it (so a scraper must read the block size from `block_size`).
    `prefix_caching_hash_algo` is vLLM's default, "sha256": the label names the setting of
    the vLLM imitated. The simulator hashes SHA-256 over msgpack, not pickle (see
    `vllm_sim.hashing`); no pod's hash values can be recomputed from this label anyway,
    vLLM's depend on its encoding and its seed.
    """
    labels = dict.fromkeys(_UNSET_CACHE_CONFIG_LABELS, "None")
    labels.update(
        {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "kv_cache_size_tokens": str(config.max_context_tokens),
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "prefix_caching_hash_algo": "sha256",
        }
    )
    return labels


def render_metrics_page(
    engine: SimEngine,
    *,
    model_name: str,
    created_unix: float,
    latency: LatencyStats,
    lora_info: LoraInfoSeries | None = None,
    now: float | None = None,
    process_start_unix: float | None = None,
) -> str:
    """The whole /metrics page for one engine (`engine="0"`) serving `model_name`.

    Every family of vLLM 0.33's page that the simulator can compute honestly, in the
    page's order; `tests/sim/test_metrics_page.py` lists the ones left out and why.
    Series about features the simulator does not have (a KV connector, multimodal
    inputs, sleep mode) are printed as a vLLM without those features prints them: zero,
    or "awake".

    With `now` (engine seconds), requests that hold a slot but whose prefill has not
    begun (queued behind other prefills on the pod's compute) count as waiting, as vLLM
    counts a request no step has scheduled yet; without it, every started request runs.
    """
    base = {"engine": "0", "model_name": model_name}
    queued = 0 if now is None else engine.num_prefill_queued(now)
    waiting = engine.num_waiting + queued
    counters = engine.counters
    tokens = engine.request_stats
    config = engine.config
    page = _Page(created_unix)
    if process_start_unix is not None:
        page.header(
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
        )
        page.lines.append(f"process_start_time_seconds {format_value(process_start_unix)}")
    page.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        base,
        engine.num_running - queued,
    )
    page.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        base,
        waiting,
    )
    deferred = engine.num_waiting_deferred
    page.gauges(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason.",
        [
            ({**base, "reason": "capacity"}, waiting - deferred),
            ({**base, "reason": "deferred"}, deferred),
        ],
    )
    page.gauges(
        "vllm:engine_sleep_state",
        "Engine sleep state",
        [
            ({**base, "sleep_state": "awake"}, 1),
            ({**base, "sleep_state": "weights_offloaded"}, 0),
            ({**base, "sleep_state": "discard_all"}, 0),
        ],
    )
    page.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        base,
        engine.kv_cache_usage,
    )
    hits = counters.prefix_cache_hits
    page.counter("vllm:prefix_cache_queries", "doc", [(base, counters.prefix_cache_queries)])
    page.counter("vllm:prefix_cache_hits", "doc", [(base, hits)])
    # No KV connector and no multimodal inputs: these stay at zero, as on such a vLLM.
    page.counter("vllm:external_prefix_cache_queries", "doc", [(base, 0)])
    page.counter("vllm:external_prefix_cache_hits", "doc", [(base, 0)])
    page.counter("vllm:mm_cache_queries", "doc", [(base, 0)])
    page.counter("vllm:mm_cache_hits", "doc", [(base, 0)])
    page.counter("vllm:num_preemptions", "doc", [(base, counters.preemptions)])
    page.counter("vllm:prompt_tokens", "doc", [(base, counters.prompt_tokens)])
    page.counter("vllm:prompt_tokens_cached", "doc", [(base, hits)])
    page.counter("vllm:generation_tokens", "doc", [(base, counters.generation_tokens)])
    page.counter(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        [
            ({**base, "source": "local_compute"}, counters.prompt_tokens - hits),
            ({**base, "source": "local_cache_hit"}, hits),
            ({**base, "source": "external_kv_transfer"}, 0),
        ],
    )
    page.counter(
        "vllm:prompt_tokens_cached_by_source",
        "doc",
        [
            ({**base, "source": "device"}, hits),
            ({**base, "source": "host"}, 0),
            ({**base, "source": "p2p"}, 0),
            ({**base, "source": "disk"}, 0),
            ({**base, "source": "external_unspecified"}, 0),
        ],
    )
    page.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [
            ({**base, "finished_reason": reason.value}, counters.finished[reason])
            for reason in FinishReason
        ],
    )
    # vLLM counts these per API server, without the engine label.
    page.counter(
        "vllm:admission_rejections",
        "doc",
        [
            (
                {"model_name": model_name, "reason": "max_num_queued_reqs"},
                counters.queue_full_rejections,
            ),
            ({"model_name": model_name, "reason": "max_num_queued_tokens"}, 0),
        ],
    )
    page.histogram("vllm:request_prompt_tokens", base, tokens.prompt_tokens)
    page.histogram("vllm:request_generation_tokens", base, tokens.generation_tokens)
    page.histogram("vllm:request_max_num_generation_tokens", base, tokens.max_num_generation_tokens)
    page.histogram("vllm:request_params_n", base, tokens.params_n)
    page.histogram("vllm:request_params_max_tokens", base, tokens.params_max_tokens)
    page.histogram("vllm:time_to_first_token_seconds", base, latency.ttft)
    page.histogram("vllm:inter_token_latency_seconds", base, latency.inter_token)
    page.histogram(
        "vllm:request_time_per_output_token_seconds", base, latency.time_per_output_token
    )
    page.histogram("vllm:e2e_request_latency_seconds", base, latency.e2e)
    page.histogram("vllm:request_queue_time_seconds", base, latency.queue)
    page.histogram("vllm:request_inference_time_seconds", base, latency.inference)
    page.histogram("vllm:request_prefill_time_seconds", base, latency.prefill)
    page.histogram("vllm:request_decode_time_seconds", base, latency.decode)
    page.histogram("vllm:request_num_preemptions", base, tokens.num_preemptions)
    page.histogram(
        "vllm:request_prefill_kv_computed_tokens", base, tokens.prefill_kv_computed_tokens
    )
    if lora_info is not None:
        page.header("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
        for labels, seen in lora_info.series():
            page.sample("vllm:lora_requests_info", labels, seen)
    page.gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        cache_config_labels(config),
        1.0,
    )
    return page.text()


def only_families(page: bytes, names: frozenset[str]) -> bytes:
    """What prometheus_client serves for a `name[]` query (vLLM's app mounted at
    /metrics/; its /metrics route ignores the query): the samples named in `names`, each
    under its family's `# HELP` and `# TYPE` lines; families with none are left out."""
    kept: list[bytes] = []
    head: list[bytes] = []  # the current family's comment lines, until a sample is kept
    for line in page.splitlines(keepends=True):
        if line.startswith(b"# HELP "):
            head = [line]
        elif line.startswith(b"#"):
            head.append(line)
        elif line.strip():
            end = min((i for i in (line.find(b"{"), line.find(b" ")) if i >= 0), default=-1)
            if end > 0 and line[:end].decode("utf-8", "replace") in names:
                kept.extend(head)
                head = []
                kept.append(line)
    return b"".join(kept)
