"""The EPP's configuration: one validated tree from a YAML file and command-line flags.

Every section forbids unknown keys, so a typo fails at start-up with the offending path
instead of silently running on a default.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from epp.addresses import AddressError, parse_host_port

# The five-factor score the EPP was first specified with (no `prefill`). With these weights
# a cache-hot pod at 80% load scores 0.64 on cache + load against 0.20 for an idle cold
# one, each queued request costs 0.05 (at max_queue 20), and a pod of health 0.29 is
# excluded (tests/scheduling/test_scorers.py).
SPEC_WEIGHTS = {"cache": 0.60, "load": 0.20, "queue": 0.10, "health": 0.05, "adapter": 0.05}
# The default: these five factors at half weight, and half on `prefill`, which prices a
# cache match and the work queued on each pod in seconds of expected time to first token.
# Chosen on benchmark evidence (docs/benchmarks/virtual.md, "Default weights"): at round
# robin's saturation rate TTFT p90 21x lower than round robin vs 10x with SPEC_WEIGHTS,
# and no worse than round robin on prompts with nothing to reuse, where SPEC_WEIGHTS
# trails least-outstanding. Set `weights: SPEC_WEIGHTS` for the five-factor score alone.
DEFAULT_WEIGHTS = {name: weight * 0.5 for name, weight in SPEC_WEIGHTS.items()} | {"prefill": 0.5}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillEstimateConfig(Strict):
    """Per-pod prefill cost, for the optional `prefill` scorer (expected time to first
    token): a prompt's own prefill is estimated as

        overhead_s + uncached tokens x per_token_s + cached tokens x per_cached_token_s

    The defaults are Llama-3.1-8B on one A100 (the `llama-8b-a100` simulator
    preset): a cold 4,096-token prompt prefills in 0.9 s (10 ms + 4,096 x 217 us), and a
    fully cached one in 45 ms (the last block is recomputed; the rest costs ~7.7 us per
    token to look up). They are only right for that model on that GPU: set them per
    model/GPU, e.g. from the TTFT of single cold and fully cached requests on an idle pod.
    Unused unless `prefill` has a weight in `scheduling.weights`.
    """

    overhead_s: float = Field(0.010, ge=0.0, allow_inf_nan=False)
    per_token_s: float = Field(0.000217, ge=0.0, allow_inf_nan=False)
    per_cached_token_s: float = Field(0.0000077, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _cached_not_dearer(self) -> PrefillEstimateConfig:
        # A cached token dearer than a computed one would make the scorer avoid cache hits.
        if self.per_cached_token_s > self.per_token_s:
            raise ValueError(
                f"per_cached_token_s ({self.per_cached_token_s}) must not exceed "
                f"per_token_s ({self.per_token_s})"
            )
        return self


class BalanceConfig(Strict):
    """The imbalance guard: a pod far busier than the least busy candidate leaves the
    candidate set, whatever its cache match. "Far busier" means both more than `abs_requests`
    more requests in flight and more than `ratio` times as many. Without it a popular
    prefix funnels every new conversation to the pod that holds it (cache 0.60 outweighs
    any load signal), and a fleet splits 3:1 while one pod idles. 0 disables a bound.

    Off by default: the `prefill` factor's slot wait and the tie-break by work given so
    far now do that job, and the guard moved conversations off their cache (the demo's
    TTFT p90 72 -> 280 ms, hit rate 91.6% -> 89.9%; virtual multi-turn +30 ms p90).
    """

    abs_requests: float = Field(4.0, ge=0.0)
    ratio: float = Field(3.0, ge=1.0)
    enabled: bool = False


class SchedulingConfig(Strict):
    # Keys are scorer names in the registry (built-ins or registered custom scorers).
    weights: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    max_queue: int = Field(20, ge=1, description="queue depth at which a pod is saturated")
    health_threshold: float = Field(0.3, ge=0.0, le=1.0, description="pods below are excluded")
    # The floor under exclusion (datalayer/health.py "Floor and panic"). Response errors
    # exclude at most this share of a model's pods (rounded down), counting the pods already
    # out for failed scrapes or stale metrics: one client whose requests the pods answer 500
    # can take half a model's pods, never all (Envoy's max_ejection_percent; 10% there,
    # which with 2-8 pods a model would mean never).
    max_error_exclusion_share: float = Field(0.5, ge=0.0, le=1.0)
    # Panic: a model with no routable pod, or fewer than this share of its pods routable,
    # is routed to all its pods as if none were excluded (Envoy's healthy_panic_threshold,
    # 50% there). 0: only when none is left, since a pod out for failed scrapes while its
    # peers answer is most likely down. `health_panic: false`: 503 instead.
    healthy_panic_share: float = Field(0.0, ge=0.0, le=1.0)
    health_panic: bool = True
    fallbacks: int = Field(0, ge=0, le=16, description="fallback endpoints after the primary")
    # Scores closer than this are equal, and the EPP's own load counts decide between them.
    # Real gauges never tie exactly: a 0.2-weighted KV usage differing by 2% is 0.004,
    # noise that must not outvote "this pod has three more requests in flight".
    tie_epsilon: float = Field(0.005, ge=0.0, le=0.1, description="scores closer are equal")
    # Requests a pod runs at once (vLLM's max_num_seqs). Dispatched requests count as
    # waiting only beyond it. None: learned per pod from its metrics (the running count
    # seen while requests wait); until then only the pod's reported waiting counts.
    running_slots: int | None = Field(None, ge=1)
    balance: BalanceConfig = Field(default_factory=lambda: BalanceConfig())
    # Here rather than top level: scorer factories receive this section (see registry.py).
    prefill_estimate: PrefillEstimateConfig = Field(default_factory=PrefillEstimateConfig)

    @field_validator("weights")
    @classmethod
    def _weights_sum_to_one(cls, weights: dict[str, float]) -> dict[str, float]:
        if not weights:
            raise ValueError("at least one scorer weight is required")
        for name, weight in weights.items():
            if not (0.0 <= weight <= 1.0) or math.isnan(weight):
                raise ValueError(f"weight of {name!r} must be in [0, 1], got {weight}")
        total = math.fsum(weights.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"scorer weights must sum to 1.0, got {total:.6f} "
                f"({', '.join(f'{k}={v}' for k, v in weights.items())})"
            )
        return weights


class PrefixConfig(Strict):
    block_size: int = Field(16, ge=1, le=4096, description="tokens per hashed block")
    capacity_per_pod: int = Field(31_250, ge=1, description="blocks remembered per pod (LRU)")
    # When a pod reports its KV capacity (vllm:cache_config_info num_gpu_blocks), remember
    # no more blocks for it than it can hold: beyond that the memory is certainly stale.
    use_reported_capacity: bool = True
    # Bounded work per request: at most this many blocks of a prompt (its head) are
    # tokenized, hashed and looked up; the rest of the prompt is only counted (estimated).
    # 8,192 blocks of 16 tokens cover a 128k-token prompt.
    max_blocks_per_request: int = Field(8192, ge=1, le=1_000_000)
    # One request records at most this fraction of a pod's capacity (its prompt's head),
    # so a huge prompt cannot push everything else out of the index for that pod. Not
    # lower: on pods with a small KV cache an ordinary conversation takes a third of it,
    # and a cut record loses the conversation's history (measured: the demo's 300-block
    # pods at 0.25 matched only the system prompt, hit rate 91.6% -> 86%).
    max_record_fraction: float = Field(0.5, gt=0.0, le=1.0, allow_inf_nan=False)


class DataLayerConfig(Strict):
    scrape_interval_s: float = Field(0.05, gt=0.0, le=60.0)
    scrape_timeout_s: float = Field(1.0, gt=0.0, le=60.0)
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


class FlowControlConfig(Strict):
    """Admission when every candidate pod is saturated (queue at max_queue).

    Sheddable requests (priority < 0) get 429 at once; the others wait here, ordered by
    priority then arrival, fair across models within a priority, until a pod has room,
    their TTL passes (429 rejected-ttl-expired) or the queue is full (429)."""

    enabled: bool = True
    max_requests: int = Field(1000, ge=0)
    max_bytes: int = Field(256 * 1024 * 1024, ge=0)
    ttl_s: float = Field(60.0, gt=0.0)
    retry_after_s: float = Field(1.0, gt=0.0)
    # Priority per model name (the name clients send); others get default_priority.
    priorities: dict[str, int] = Field(default_factory=dict)
    default_priority: int = 0
    # A request header carrying an integer priority, honoured only when set here: clients
    # can send any header, so the gateway must strip it from untrusted traffic.
    priority_header: str | None = None
    # An InferenceObjective the client names (x-llm-d-inference-objective) may lower its
    # model's own priority (InferenceModel criticality, `priorities`) but not raise it,
    # unless this is true (every client trusted). Models without one take the objective's.
    objective_may_raise: bool = False


class TlsConfig(Strict):
    """TLS on the gRPC port. The files are re-read when they change (a rotated Secret), so
    new connections get the new certificate without a restart."""

    cert_file: Path
    key_file: Path
    # Set: clients must present a certificate signed by this CA (mutual TLS).
    client_ca_file: Path | None = None
    reload_check_s: float = Field(5.0, gt=0.0)


class ServerConfig(Strict):
    grpc_host: str = "0.0.0.0"
    grpc_port: int = Field(9002, ge=0, le=65535)
    # gRPC health (plaintext, on grpc_host) as the upstream EPP serves it: GKE and the
    # upstream charts' probes ask it for `inference-extension`. Health stays on grpc_port
    # too. 0: a free port chosen at start (EppService.grpc_health_port, logged).
    grpc_health_port: int = Field(9003, ge=0, le=65535)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(9090, ge=0, le=65535)
    # The debug pages (/debug/endpoints, /debug/index) show which pod holds which prefix
    # and cost routing-loop time: served on this loopback address only (kubectl
    # port-forward reaches it), or on the metrics port when metrics_host is loopback.
    # 0: a free port chosen at start (EppService.debug_address, logged); null: not served.
    debug_host: str = "127.0.0.1"
    debug_port: int | None = Field(9091, ge=0, le=65535)
    max_grpc_message_bytes: int = Field(64 * 1024 * 1024, ge=4 * 1024 * 1024)
    # Larger bodies get 413 (at the headers when Content-Length says so). 32 MiB: vision
    # requests with base64 images fit (vLLM and the reference EPP set no cap). Work per
    # body is bounded (images are hashed, not decoded or tokenized; a long conversation is
    # cut from a window of its head), but decoding still grows with the bytes: one body at
    # the limit pauses the event loop 50-75 ms on 2 cores for the costliest shapes (one
    # text turn, ~800k tiny turns, token ids), ~40 ms for an image, plus ~1 ms/MiB to
    # re-emit it in FULL_DUPLEX_STREAMED mode (docs/reliability.md "Large bodies").
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    # Used only when Envoy does not announce its body mode (protocol_config, Envoy < 1.34).
    assumed_body_mode: Literal["FULL_DUPLEX_STREAMED", "BUFFERED"] = "FULL_DUPLEX_STREAMED"
    stream_chunk_bytes: int = Field(62 * 1024, ge=1024, le=62 * 1024)
    # SIGTERM: readiness and gRPC health go NOT_SERVING at once, routing goes on for up to
    # drain_timeout_s, or until no routing stream has opened or been open for drain_quiet_s.
    drain_timeout_s: float = Field(15.0, ge=0.0)
    drain_quiet_s: float = Field(1.0, ge=0.0)
    # A request waiting in admission longer than keepalive_s gets one message to Envoy that
    # re-arms its ext_proc message timer (BUFFERED mode) for keepalive_extension_s: by
    # default flow_control.ttl_s + 5 s. It must not exceed the filter's
    # max_message_timeout (the generated configs allow 300 s), or Envoy ignores it.
    keepalive_s: float = Field(2.0, gt=0.0)
    keepalive_extension_s: float = Field(65.0, gt=0.0, le=300.0)
    # TLS on the ext_proc port, as the upstream EPP serves it (--secure-serving, default
    # on): gateways that dial the EPP over TLS without verifying it (Envoy AI Gateway,
    # kgateway) fail every handshake against a plaintext port. Without `tls` files the
    # EPP generates a self-signed certificate in memory at start. False: plaintext.
    secure_serving: bool = True
    tls: TlsConfig | None = None

    @model_validator(mode="after")
    def _tls_needs_secure_serving(self) -> ServerConfig:
        if not self.secure_serving and self.tls is not None:
            raise ValueError(
                "server.secure_serving: false (plaintext) contradicts server.tls "
                "(certificate files): remove one of them"
            )
        return self


class EndpointConfig(Strict):
    name: str = Field(min_length=1)
    address: str = Field(description="ip:port Envoy connects to ([fd00::1]:8000 for IPv6)")
    metrics_url: str | None = None
    model: str | None = Field(None, description="base model served; learned from metrics if unset")
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("address")
    @classmethod
    def _ip_port(cls, address: str) -> str:
        try:
            parse_host_port(address)
        except AddressError as exc:
            raise ValueError(f"address must be host:port ({exc})") from None
        return address

    def resolved_metrics_url(self) -> str:
        return self.metrics_url or f"http://{self.address}/metrics"


class DiscoveryConfig(Strict):
    """Where the endpoints come from: an InferencePool (`pool_name`), or the pods of a
    label selector (`endpoint_selector` + `target_ports`, no InferencePool), or else the
    static `endpoints` / `endpoints_file` (watched and reloaded)."""

    pool_name: str | None = Field(None, min_length=1)
    # Default: the EPP pod's own namespace (its service account's), else "default".
    pool_namespace: str | None = Field(None, min_length=1)
    # The pool's API group (--pool-group): v1 `inference.networking.k8s.io`, or the older
    # v1alpha2 `inference.networking.x-k8s.io`.
    pool_group: Literal["inference.networking.k8s.io", "inference.networking.x-k8s.io"] = (
        "inference.networking.k8s.io"
    )
    # Outside a cluster: the kubeconfig to use (default: $KUBECONFIG or ~/.kube/config).
    kubeconfig: Path | None = None
    # Read InferenceModel / InferenceObjective / InferenceModelRewrite objects of the pool
    # when their CRDs exist.
    read_models: bool = True
    file_poll_s: float = Field(1.0, gt=0.0)
    # Standalone, without an InferencePool (upstream's --endpoint-selector and
    # --endpoint-target-ports): the Ready pods matching this label selector (`k=v,k2=v2`,
    # equality terms only) in pool_namespace, one endpoint per target port (1 to 8). No
    # model CRD is read then, as upstream.
    endpoint_selector: str | None = Field(None, min_length=1)
    target_ports: list[int] = Field(default_factory=list)
    # One active replica among several (upstream's --ha-enable-leader-election): the
    # replica holding a coordination.k8s.io/v1 Lease in pool_namespace answers the health
    # names readiness, "" and the ext_proc service's; the others stand by (epp/leader.py).
    # Needs Kubernetes discovery and a Role granting get/create/update on leases.
    leader_election: bool = False
    # The Lease; default upstream's `epp-<pool_namespace>-<pool_name>.llm-d.ai` (standalone:
    # the EPP Deployment's name, from $POD_NAME, in place of the pool's).
    leader_election_lease: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _leader_election_needs_kubernetes(self) -> DiscoveryConfig:
        if self.leader_election and not (self.pool_name or self.endpoint_selector):
            raise ValueError(
                "discovery.leader_election needs Kubernetes discovery (discovery.pool_name "
                "or endpoint_selector): its Lease lives in the API server"
            )
        return self

    @model_validator(mode="after")
    def _standalone(self) -> DiscoveryConfig:
        if self.endpoint_selector is None:
            if self.target_ports:
                raise ValueError("discovery.target_ports needs discovery.endpoint_selector")
            return self
        if self.pool_name:
            raise ValueError(
                "discovery.pool_name and discovery.endpoint_selector are exclusive: an "
                "InferencePool, or the pods of a label selector"
            )
        # Imported here: the discovery package imports this module.
        from epp.datalayer.discovery.pool import InvalidPool, standalone_pool

        try:
            standalone_pool("standalone", self.endpoint_selector, self.target_ports)
        except InvalidPool as exc:
            raise ValueError(f"discovery.endpoint_selector/target_ports: {exc}") from None
        return self


class ReplicasConfig(Strict):
    """Several EPP replicas behind one Envoy share their routing decisions, so each one's
    prefix index and load count include the others' traffic. Off with no peers."""

    # Peers as host:port of their `listen_port`; a name resolving to several addresses (a
    # headless Service) stands for all of them, re-resolved every `resolve_s`.
    peers: list[str] = Field(default_factory=list)
    listen_host: str = "0.0.0.0"
    # Not 9003: the upstream EPP's gRPC health port (server.grpc_health_port).
    listen_port: int = Field(9010, ge=0, le=65535)
    resolve_s: float = Field(5.0, gt=0.0)
    # Frames waiting per peer (a slow or absent peer loses the oldest, routing never waits).
    queue_size: int = Field(4096, ge=1)
    # The last decisions sent to a replica the first time it connects (a restarted or new
    # replica starts with this much of the fleet's prefix index); 0: none.
    history: int = Field(4096, ge=0)
    # A peer's decision older than this on arrival (a backlog after a reconnect) only
    # feeds the prefix index: the pod's page already shows its load.
    max_age_s: float = Field(1.0, gt=0.0)
    # A peer's dispatch counts in a pod's load until a page fetched after it shows it, or
    # for at most this long while no page comes.
    load_ttl_s: float = Field(5.0, gt=0.0)
    # Reconnect delay after a failure doubles from 0.05 s up to this.
    backoff_max_s: float = Field(2.0, gt=0.0)
    # A peer's decision for a longer prompt is dropped and counted (no real request carries
    # one: 2**20 covers the longest context windows served, 1M tokens). Also what one
    # decision can add to a pod's prefill lane; what all peers' decisions add ends within
    # load_ttl_s of the last one (epp/replicas/inbox.py).
    max_prompt_tokens: int = Field(1_048_576, ge=1, le=2**31)
    # The listener closes a connection that has not completed its Hello (and, with a
    # secret, its proof) within handshake_timeout_s, and one that sent no frame for
    # idle_timeout_s (peers ping within it). At most max_connections are open; beyond, the
    # oldest still in its handshake (from the address holding the most) makes room, and
    # without a secret the longest silent too (epp/replicas/server.py).
    handshake_timeout_s: float = Field(5.0, gt=0.0, le=60.0)
    idle_timeout_s: float = Field(30.0, ge=1.0, le=3600.0)
    max_connections: int = Field(64, ge=2, le=65536)
    # A file holding a secret shared by every replica (at least 16 bytes once whitespace is
    # stripped; e.g. a mounted Kubernetes Secret). Set: a peer connection carries decisions
    # only after both replicas proved they hold it (epp/replicas/auth.py); the file is
    # re-read when it changes. Unset: the peers port takes anything that reaches it. A
    # relative path is taken from the working directory, as server.tls's files are.
    # Read when the replicas start, not here: a config is also validated where the file
    # does not exist (the chart's rendered config in tests/deploy, `epp bench --epp-config`).
    secret_file: Path | None = None

    @field_validator("peers")
    @classmethod
    def _host_port(cls, peers: list[str]) -> list[str]:
        for peer in peers:
            try:
                parse_host_port(peer)
            except AddressError as exc:
                raise ValueError(f"a peer must be host:port ({exc})") from None
        return peers


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
    """Precise mode: follow each pod's vLLM KV events over ZMQ (epp/datalayer/kv_subscriber.py).

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
    # Apply at most about this long before yielding to the event loop.
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


class EppConfig(Strict):
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    datalayer: DataLayerConfig = Field(default_factory=DataLayerConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    # A model name clients send that is a LoRA adapter of a base model: adapter -> base.
    adapters: dict[str, str] = Field(default_factory=dict)
    # A base model name (as the pods serve it) -> its tokenizer files; adapters use their
    # base model's; other models: the byte estimate.
    tokenizers: dict[str, TokenizerConfig] = Field(default_factory=dict)
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    endpoints_file: Path | None = None
    log_level: Literal["trace", "debug", "info", "warning", "error"] = "info"
    # Log lines as JSON (default) or as zap's `console` text (--zap-encoder console).
    log_format: Literal["json", "console"] = "json"

    @model_validator(mode="after")
    def _keepalive_covers_the_wait(self) -> EppConfig:
        if self.server.keepalive_extension_s < self.flow_control.ttl_s:
            raise ValueError(
                f"server.keepalive_extension_s ({self.server.keepalive_extension_s}) must be at "
                f"least flow_control.ttl_s ({self.flow_control.ttl_s}): a waiting request "
                "would hit Envoy's message timeout first"
            )
        return self

    @model_validator(mode="after")
    def _one_source_of_endpoints(self) -> EppConfig:
        kubernetes = self.discovery.pool_name or self.discovery.endpoint_selector
        if kubernetes and (self.endpoints or self.endpoints_file):
            raise ValueError(
                "discovery.pool_name or endpoint_selector (Kubernetes) and "
                "endpoints/endpoints_file (static) are "
                "exclusive: choose one source of endpoints"
            )
        return self

    @model_validator(mode="after")
    def _unique_endpoints(self) -> EppConfig:
        names = [e.name for e in self.endpoints]
        addresses = [e.address for e in self.endpoints]
        for what, values in (("name", names), ("address", addresses)):
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ValueError(f"duplicate endpoint {what}: {', '.join(dupes)}")
        return self


def load_endpoints_file(path: Path) -> list[EndpointConfig]:
    """Static discovery: a YAML file with `endpoints: [{name, address, metrics_url, labels}]`."""
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("endpoints", []), list):
        raise ValueError(f"{path}: expected a mapping with an 'endpoints' list")
    return [EndpointConfig.model_validate(item) for item in data.get("endpoints", [])]


def load_config(path: Path | None = None, overrides: dict | None = None) -> EppConfig:
    """Read the YAML file (if any), apply overrides (nested dict), resolve the endpoints file."""
    data: dict = {}
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the configuration must be a YAML mapping")
        data = loaded
    for section, values in (overrides or {}).items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    config = EppConfig.model_validate(data)
    if config.endpoints_file is not None and not config.endpoints_file.is_absolute():
        # Relative to the configuration file: the app watches it (discovery/file.py).
        base = path.parent if path is not None else Path.cwd()
        config = EppConfig.model_validate(
            {**config.model_dump(), "endpoints_file": (base / config.endpoints_file).absolute()}
        )
    return config
