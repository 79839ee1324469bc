"""Data-layer sections: pod metrics scraping, KV events, tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from epp.config.base import Strict


class DataLayerConfig(Strict):
    scrape_interval_s: float = Field(0.05, gt=0.0, le=60.0)
    scrape_timeout_s: float = Field(1.0, gt=0.0, le=60.0)
    # Slower scrapes where a fresh page does not pay (datalayer/scraper.py): an idle pod
    # (its page shows nothing running or waiting, and nothing is in flight from the EPP or
    # its peers) every `scrape_idle_interval_s`, a pod whose KV state comes as KV events
    # every `scrape_kv_events_interval_s`. A request dispatched to an idle pod brings it
    # back to `scrape_interval_s` at the next tick of that interval; a failed scrape too.
    # Each is at most stale_after_s / 2 (a slower pod would go stale between scrapes).
    scrape_idle_interval_s: float = Field(0.5, gt=0.0, le=60.0)
    scrape_kv_events_interval_s: float = Field(0.2, gt=0.0, le=60.0)
    # Ask each page for the series read only (`?name[]=...`, prometheus_client's filter,
    # which vLLM's and SGLang's /metrics honour: a ~3 KB page instead of ~50 KB, rendered
    # from a few collectors). Servers that ignore the query answer the whole page.
    scrape_name_filter: bool = True
    # Metrics older than this make a pod unhealthy: a frozen pod must not look idle.
    stale_after_s: float = Field(1.0, gt=0.0)
    # Each consecutive failed scrape costs this much health (3 failures: below 0.3).
    failure_health_step: float = Field(0.25, gt=0.0, le=1.0)
    # Weight of each new response in the moving 5xx error rate seen on the response path.
    error_rate_alpha: float = Field(0.2, gt=0.0, le=1.0)
    # The error rate decays towards 0 with this time constant, so a pod excluded for
    # errors is tried again (an excluded pod gets no requests that could lower it).
    error_decay_s: float = Field(10.0, gt=0.0)
    # Hysteresis: a pod excluded below scheduling.health_threshold comes back only once its
    # health reaches this, so a flapping pod does not oscillate on every scrape.
    readmit_health: float = Field(0.5, ge=0.0, le=1.0)
    # vLLM stops refreshing its gauges when every request was cancelled: gauges that show
    # work while the pod generates nothing and the EPP has nothing in flight for this long
    # are treated as frozen and ignored.
    frozen_gauges_after_s: float = Field(5.0, gt=0.0)
    # A dispatch that no completion ever settles (no response observer configured, a lost
    # stream) is dropped after this long; the pod's own counts reconcile it sooner.
    in_flight_ttl_s: float = Field(900.0, gt=0.0)
    # Adapters a pod reported (vllm:lora_requests_info lists only adapters with requests)
    # are remembered as resident for this long.
    adapter_memory_s: float = Field(300.0, ge=0.0)
    # HTTPS metrics endpoints (metrics_url https://...): the CA bundle that signs them (the
    # system's when unset), and an optional client certificate for mutual TLS.
    scrape_ca_file: Path | None = None
    scrape_client_cert_file: Path | None = None
    scrape_client_key_file: Path | None = None
    scrape_insecure_skip_verify: bool = False
    # Where a discovered pod's page is (upstream's --model-server-metrics-port/-path/-scheme):
    # <scheme>://<pod IP>:<port><path>, port 0 being the pod's target port. Static
    # endpoints give their own metrics_url.
    metrics_scheme: Literal["http", "https"] = "http"
    metrics_port: int = Field(0, ge=0, le=65535)
    metrics_path: str = Field("/metrics", pattern=r"^/\S*$")
    # The series read from each page (upstream's --total-queued-requests-metric, ...): a
    # Prometheus metric spec, `name` or `name{label="v",...}`; the series that match are
    # summed (data-parallel engines), KV usage averaged; "" reads none. vLLM's names by
    # default (datalayer/metrics_parser.py; vLLM's older vllm:gpu_* names as fallbacks).
    waiting_metric: str = "vllm:num_requests_waiting"
    running_metric: str = "vllm:num_requests_running"
    kv_usage_metric: str = "vllm:kv_cache_usage_perc"
    lora_info_metric: str = "vllm:lora_requests_info"
    # Labels block_size / num_gpu_blocks (vLLM), or page_size / num_pages (SGLang).
    cache_info_metric: str = "vllm:cache_config_info"

    @model_validator(mode="after")
    def _client_pair(self) -> DataLayerConfig:
        if (self.scrape_client_cert_file is None) != (self.scrape_client_key_file is None):
            raise ValueError("scrape_client_cert_file and scrape_client_key_file go together")
        return self

    @model_validator(mode="after")
    def _metric_specs(self) -> DataLayerConfig:
        # Imported here: the datalayer package imports this module.
        from epp.datalayer.metrics_parser import MetricSpecError, parse_metric_spec

        for key in METRIC_SPEC_KEYS:
            try:
                parse_metric_spec(getattr(self, key))
            except MetricSpecError as exc:
                raise ValueError(f"datalayer.{key}: {exc}") from None
        if not any(getattr(self, key).strip() for key in METRIC_SPEC_KEYS[:3]):
            raise ValueError(
                "datalayer.waiting_metric, running_metric and kv_usage_metric are all empty: "
                "no page would be read"
            )
        return self


# The DataLayerConfig keys of the series read, in PageReader's order.
METRIC_SPEC_KEYS = (
    "waiting_metric",
    "running_metric",
    "kv_usage_metric",
    "lora_info_metric",
    "cache_info_metric",
)


class TokenizerConfig(Strict):
    """A model's own tokenizer (epp/tokenization/registry.py): the directory holding its
    tokenizer.json and tokenizer_config.json (special tokens, chat template).

    `source: engine` asks a pod serving the model for the prompt's ids instead (vLLM's
    POST /tokenize, epp/tokenization/engine.py), within `timeout_ms`; on a timeout, an
    error or a bad answer the request falls back to `path`'s tokenizer when one is set,
    else to the byte estimate. `path` is then optional."""

    path: Path | None = None
    source: Literal["local", "engine"] = "local"
    # The engine's answer must arrive within this (it is added to the decision's latency).
    timeout_ms: float = Field(75.0, gt=0.0, le=10_000.0)
    # A longer answer is a bad answer (a 128k-token prompt's ids are about 1 MB of JSON).
    max_response_mb: float = Field(8.0, gt=0.0, le=1024.0)
    # vLLM's --chat-template: a template file used instead of the directory's.
    chat_template_file: Path | None = None
    # vLLM's --chat-template-content-format: "auto" detects it from the template.
    content_format: Literal["auto", "string", "openai"] = "auto"
    # vLLM's --default-chat-template-kwargs.
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Token ids of rendered conversation prefixes kept for the next turn (0: off).
    cache_mb: float = Field(64.0, ge=0.0, le=65536.0)

    @model_validator(mode="after")
    def _source_needs(self) -> TokenizerConfig:
        if self.source == "local" and self.path is None:
            raise ValueError("path is required (or source: engine, which asks the pods)")
        return self


KvEventsMode = Literal["auto", "approximate", "precise"]
_TEMPLATE_FIELDS = ("host", "port", "model", "name")


class KvEventsConfig(Strict):
    """Precise mode: follow each pod's vLLM KV events over ZMQ (epp/datalayer/kv_subscriber/).

    Per pod, `pod_modes[name]` or else `mode`: `auto` subscribes and makes the pod precise
    once its publisher completes a handshake (approximate again after `fallback_after_s`
    without a connection); `precise` is precise from the start; `approximate` never
    subscribes. Templates take {host} and {port} (the pod's ip:port; an IPv6 host comes
    bracketed, `tcp://[fd00::1]:5557`, unless the template brackets `[{host}]` itself),
    {model} and {name};
    `topic` is a ZMQ prefix filter ("" takes every message of the pod's publisher, which
    is right when each pod has its own publisher, as here; vLLM's default topic is "").
    """

    mode: KvEventsMode = "auto"
    pod_modes: dict[str, KvEventsMode] = Field(default_factory=dict)
    endpoint: str = "tcp://{host}:5557"
    replay_endpoint: str | None = "tcp://{host}:5558"
    topic: str = ""
    # A predicted entry (the pod just chosen) lives while its request is in flight, then
    # this long for the engine's events to arrive, unless an event confirms it.
    predicted_ttl_s: float = Field(2.0, gt=0.0, le=60.0)
    # ...and never longer than this from dispatch (a completion lost, a request that runs
    # for minutes).
    predicted_max_s: float = Field(120.0, gt=0.0, le=3600.0)
    # A replay that sends nothing for this long failed: the pod's entries are dropped.
    resync_timeout_s: float = Field(2.0, gt=0.0, le=60.0)
    # A pod's new start time (a restart seen on its page) keeps its entries only if the
    # subscriber's last full resync began at least this long after it (EPP clock against
    # the pod's): raise it where clocks differ by more than about a second.
    restart_margin_s: float = Field(3.0, ge=0.0, le=600.0)
    probe_interval_s: float = Field(5.0, gt=0.0)
    fallback_after_s: float = Field(10.0, gt=0.0)
    reconnect_max_s: float = Field(2.0, gt=0.0, le=60.0)
    # Apply at most about this long, then yield to the event loop.
    slice_ms: float = Field(2.0, gt=0.0, le=1000.0)
    max_payload_bytes: int = Field(1024 * 1024, ge=1024, le=1024 * 1024 * 1024)

    @field_validator("endpoint", "replay_endpoint", "topic")
    @classmethod
    def _known_fields(cls, template: str | None) -> str | None:
        if template is not None:
            try:
                template.format(**dict.fromkeys(_TEMPLATE_FIELDS, "x"))
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"{template!r}: only {{host}}, {{port}}, {{model}}, {{name}} may be used"
                    f" ({exc})"
                ) from None
        return template

    @model_validator(mode="after")
    def _max_covers_the_ttl(self) -> KvEventsConfig:
        if self.predicted_max_s < self.predicted_ttl_s:
            raise ValueError("kv_events.predicted_max_s must be >= predicted_ttl_s")
        return self

    def mode_of(self, pod: str) -> KvEventsMode:
        return self.pod_modes.get(pod, self.mode)
