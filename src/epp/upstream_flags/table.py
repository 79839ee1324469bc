"""Every upstream flag `epp serve` accepts, and what each becomes here: mapped to our
configuration (`MAPPED`), already what this EPP does (`HONOURED`), accepted and ignored
(`IGNORED`), or one of argparse's own (`SHARED`)."""

from __future__ import annotations

# The InferencePool API groups an EPP can be told to watch (--pool-group).
POOL_GROUPS = ("inference.networking.k8s.io", "inference.networking.x-k8s.io")
# An upstream plugins file: kind EndpointPickerConfig in one of these API groups.
UPSTREAM_CONFIG_KIND = "EndpointPickerConfig"
UPSTREAM_CONFIG_GROUPS = ("inference.networking.x-k8s.io", "llm-d.ai")

# Flags that are booleans upstream (a bare `-x` is true). Every other flag takes a value.
BOOLEANS = frozenset(
    {
        "allow-experimental-plugins",
        "disable-endpoint-subset-filter",
        "emit-endpoint-scores",
        "enable-cert-reload",
        "enable-grpc-stream-metrics",
        "enable-pprof",
        "ha-enable-leader-election",
        "health-checking",
        "metrics-endpoint-auth",
        "model-server-metrics-https-insecure-skip-verify",
        "secure-serving",
        "tracing",
        "zap-devel",
    }
)

# Flag -> what it becomes here. `ours` flags are argparse's (epp.app.build_parser).
MAPPED: dict[str, str] = {
    "pool-group": "discovery.pool_group",
    "grpc-health-port": "server.grpc_health_port",
    "secure-serving": "server.secure_serving",
    "cert-path": "server.tls (DIR/tls.crt, DIR/tls.key)",
    "drain-timeout": "server.drain_timeout_s",
    "endpoint-selector": "discovery.endpoint_selector (pods by label, no InferencePool)",
    "endpoint-target-ports": "discovery.target_ports",
    "config-file": "--config when it is our format; an EndpointPickerConfig is not applied",
    "config-text": "as config-file, inline",
    "v": "log_level (<=2 info, 3-4 debug, >=5 trace)",
    "zap-log-level": "log_level (debug, info, warn, error; an integer as -v)",
    "zap-encoder": "log_format (json, console)",
    "ha-enable-leader-election": "discovery.leader_election (one Ready replica: the Lease holder)",
    "total-queued-requests-metric": "datalayer.waiting_metric",
    "total-running-requests-metric": "datalayer.running_metric",
    "kv-cache-usage-percentage-metric": "datalayer.kv_usage_metric",
    "lora-info-metric": "datalayer.lora_info_metric",
    "cache-info-metric": "datalayer.cache_info_metric",
    "model-server-metrics-port": "datalayer.metrics_port (0: the target port)",
    "model-server-metrics-path": "datalayer.metrics_path",
    "model-server-metrics-scheme": "datalayer.metrics_scheme",
    "model-server-metrics-https-insecure-skip-verify": "datalayer.scrape_insecure_skip_verify",
}
# The metric spec flags -> their DataLayerConfig key.
METRIC_SPEC_FLAGS = {
    "total-queued-requests-metric": "waiting_metric",
    "total-running-requests-metric": "running_metric",
    "kv-cache-usage-percentage-metric": "kv_usage_metric",
    "lora-info-metric": "lora_info_metric",
    "cache-info-metric": "cache_info_metric",
}
# Upstream switches for what this EPP always does: no warning.
HONOURED: dict[str, str] = {
    "enable-cert-reload": "server.tls files are re-read when they change",
    "health-checking": "gRPC health is always served",
}
# Accepted, change nothing here, named in one warning.
IGNORED = frozenset(
    {
        "allow-experimental-plugins",
        "destination-endpoint-hint-key",
        "destination-endpoint-hint-metadata-namespace",
        "disable-endpoint-subset-filter",
        "emit-endpoint-scores",
        "enable-grpc-stream-metrics",
        "enable-pprof",
        "grpc-max-recv-msg-size",
        "grpc-max-send-msg-size",
        "metrics-cert-dir",
        "metrics-client-ca-file",
        "metrics-endpoint-auth",
        "metrics-staleness-threshold",
        "refresh-metrics-interval",
        "refresh-pods-interval",
        "refresh-prometheus-metrics-interval",
        "target-endpoint-key",
        "tls-cipher-suites",
        "tls-min-version",
        "tracing",
        "zap-devel",
        "zap-stacktrace-level",
        "zap-time-encoding",
    }
)
# Flags upstream has that argparse owns here (same meaning): pool-name, pool-namespace,
# grpc-port, metrics-port, kubeconfig, grpc-health-port; listed for `known_upstream`.
SHARED = frozenset(
    {"pool-name", "pool-namespace", "grpc-port", "metrics-port", "kubeconfig", "grpc-health-port"}
)
FLAGS = frozenset(MAPPED) | frozenset(HONOURED) | IGNORED | SHARED
