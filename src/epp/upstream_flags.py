"""The upstream EPP's command-line flags, accepted by `epp serve`.

Our image's ENTRYPOINT is `epp serve`, so the `args:` of an upstream chart or manifest
(GIE's `epplib`/`inferencepool` charts up to v1.5, GIE's conformance manifests, the llm-d
router's `routerlib` chart, the llm-d guides) reach this parser unchanged. `translate`
reads them with Go's flag syntax, which both of upstream's parsers accept:

- one or two dashes (`-poolName`, `--pool-name`); camelCase (GIE up to v0.5) or kebab
  names (GIE v1.x, the llm-d router), one table of kebab names for both;
- `-x v` and `-x=v` for a flag that takes a value: the next argument is the value
  whatever it looks like (`--lora-info-metric ""` included);
- a boolean alone is true, `-x=false` sets it; a bare `true`/`false` right after a
  boolean is taken as its value (GIE v1.5's chart renders its `flags:` map as
  `--key` `"value"`, which Go's parser would read as true plus a stray argument);
- `-v4` as `-v 4` (pflag's shorthand form).

Each upstream flag is either mapped to our configuration (`MAPPED`), already what we do
(`HONOURED`), or accepted and ignored (everything else in `FLAGS`), the ignored ones named
in one warning. Our own flags pass through to argparse under their `--kebab` name; any
other flag stays an error there.

Sources: the flag definitions of llm-d-router v0.10.0 (pkg/epp/server/options.go,
pkg/common/observability/logging), GIE v0.1.0 to v1.5.0 (cmd/epp, pkg/epp/server) and
controller-runtime's zap flags (`zap.Options.BindFlags`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epp.datalayer.metrics_parser import MetricSpecError, parse_metric_spec

# The InferencePool API groups an EPP can be told to watch (--pool-group).
POOL_GROUPS = ("inference.networking.k8s.io", "inference.networking.x-k8s.io")
# An upstream plugins file: kind EndpointPickerConfig in one of these API groups.
UPSTREAM_CONFIG_KIND = "EndpointPickerConfig"
UPSTREAM_CONFIG_GROUPS = ("inference.networking.x-k8s.io", "llm-d.ai")

# Flags that are booleans upstream (a bare `-x` is true). Every other flag takes a value.
_BOOLEANS = frozenset(
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


class FlagError(ValueError):
    """A flag argument that cannot be read; the message is one line for the operator."""


def kebab(name: str) -> str:
    """`grpcHealthPort` -> `grpc-health-port`; kebab names unchanged."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", name).lower()


@dataclass
class UpstreamArgs:
    """What `translate` read: our arguments for argparse, and the upstream flags' effect."""

    ours: list[str] = field(default_factory=list)
    # Nested config overrides: {"server": {"grpc_health_port": 9003}, ...}.
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    log_level: str | None = None  # from zap_level, else verbosity_level
    verbosity_level: str | None = None
    zap_level: str | None = None
    log_format: str | None = None
    config_file: Path | None = None
    config_text: str | None = None
    ignored: list[str] = field(default_factory=list)  # as the operator spelled them
    mapped: dict[str, str] = field(default_factory=dict)  # spelling -> config key
    # Flags accepted but not honoured for a reason other than being ignored everywhere.
    notes: list[str] = field(default_factory=list)
    # Set by epp.app.config_from_args: the upstream plugins file that was not applied.
    unapplied_config: str | None = None

    def set(self, dotted: str, value: Any) -> None:
        section, key = dotted.split(".", 1)
        self.overrides.setdefault(section, {})[key] = value

    def report(self, log: Any) -> None:
        """Say once, after logging is configured, what the upstream flags did: the mapped
        ones (info), the ignored ones in one warning, and what was not applied."""
        if self.mapped:
            log.info("upstream_flags_mapped", flags=self.mapped)
        if self.ignored:
            log.warning(
                "upstream_flags_ignored",
                flags=self.ignored,
                detail="flags of the upstream EPP accepted for compatibility; they change "
                "nothing here",
            )
        for note in self.notes:
            log.warning("upstream_flag_not_applied", detail=note)
        if self.unapplied_config is not None:
            log.warning(
                "upstream_config_not_applied",
                config=self.unapplied_config,
                detail="an upstream EndpointPickerConfig: its plugins and profiles are not "
                "applied, this EPP runs on its own defaults; its own configuration is a YAML "
                "file given with --config (or --config-file), README 'Configuration'",
            )


_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def parse_bool(text: str, flag: str) -> bool:
    """Go's strconv.ParseBool."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise FlagError(f"{flag}: invalid boolean {text!r} (true or false)")


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str, flag: str) -> float:
    """Go's time.ParseDuration ("30s", "1m30s", "500ms", "0"), in seconds."""
    body = text.strip()
    if body in ("0", "+0", "-0"):
        return 0.0
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    pos, total = 0, 0.0
    while pos < len(body):
        match = _DURATION_PART.match(body, pos)
        if match is None:
            raise FlagError(f"{flag}: invalid duration {text!r} (e.g. 30s, 1m30s, 500ms)")
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not body:
        raise FlagError(f"{flag}: invalid duration {text!r} (e.g. 30s, 1m30s, 500ms)")
    return sign * total


def verbosity_level(verbosity: int) -> str:
    """Upstream's -v (logging/const.go: DEFAULT 2, VERBOSE 3, DEBUG 4, TRACE 5) as our
    level: the default and below log what our `info` logs; VERBOSE and DEBUG add
    per-request lines, which our `debug` carries; TRACE adds per-pod and per-block
    detail, our `trace`."""
    if verbosity <= 2:
        return "info"
    if verbosity <= 4:
        return "debug"
    return "trace"


_ZAP_LEVELS = {
    "debug": "debug",
    "info": "info",
    "warn": "warning",
    "error": "error",
    "dpanic": "error",
    "panic": "error",
    "fatal": "error",
}


def zap_level(text: str, flag: str) -> str:
    """controller-runtime's --zap-log-level: a level name, or an integer > 0 which is a
    verbosity as -v's."""
    if text.lower() in _ZAP_LEVELS:
        return _ZAP_LEVELS[text.lower()]
    if text.isdigit() and int(text) > 0:
        return verbosity_level(int(text))
    raise FlagError(f"{flag}: invalid level {text!r} (debug, info, warn, error, or an integer > 0)")


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise FlagError(f"{flag}: invalid integer {text!r}") from None


def translate(argv: list[str], our_flags: frozenset[str]) -> UpstreamArgs:
    """Split `argv` into our arguments (canonical `--name[=value]` spellings, for argparse)
    and the upstream flags' effect. `our_flags` are argparse's long names without dashes.
    Raises FlagError for an upstream flag whose value is missing or malformed."""
    result = UpstreamArgs()
    raw: list[tuple[str, str, str | bool]] = []  # (spelling, kebab name, value)
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--" or not token.startswith("-") or token == "-":
            result.ours.append(token)
            if token == "--":
                result.ours.extend(argv[i:])
                break
            continue
        dashes = 2 if token.startswith("--") else 1
        body = token[dashes:]
        name, eq, value = body.partition("=")
        shorthand = re.fullmatch(r"v(\d+)", name) if dashes == 1 and not eq else None
        if shorthand is not None:
            name, eq, value = "v", "=", shorthand.group(1)
        key = kebab(name)
        spelling = "-" * dashes + name
        if key in ("h", "help"):
            result.ours.append("--help")
            continue
        if key in our_flags:
            result.ours.append(f"--{key}" + (f"={value}" if eq else ""))
            continue
        if key not in FLAGS:
            result.ours.append(token)  # argparse names it as unrecognized
            continue
        parsed: str | bool
        if key in _BOOLEANS:
            if eq:
                parsed = parse_bool(value, spelling)
            elif i < len(argv) and argv[i] in _TRUE | _FALSE:
                parsed = argv[i] in _TRUE  # what Go's strconv.ParseBool reads
                i += 1
            else:
                parsed = True
        elif eq:
            parsed = value
        elif i < len(argv):
            parsed = argv[i]
            i += 1
        else:
            raise FlagError(f"{spelling}: the flag needs a value")
        raw.append((spelling, key, parsed))
    for spelling, key, parsed in raw:
        _apply(result, spelling, key, parsed)
    _finish(result, raw)
    return result


def _apply(result: UpstreamArgs, spelling: str, key: str, value: str | bool) -> None:
    text = value if isinstance(value, str) else ""
    if key == "pool-group":
        if text not in POOL_GROUPS:
            raise FlagError(
                f"{spelling}: {text!r} is not an InferencePool group ({', '.join(POOL_GROUPS)})"
            )
        result.set("discovery.pool_group", text)
    elif key == "secure-serving":
        result.set("server.secure_serving", bool(value))
    elif key == "ha-enable-leader-election":
        result.set("discovery.leader_election", bool(value))
    elif key == "drain-timeout":
        result.set("server.drain_timeout_s", parse_duration(text, spelling))
    elif key == "endpoint-selector":
        if text:  # the llm-d chart renders "" when no matchLabels are set
            result.set("discovery.endpoint_selector", text)
    elif key == "endpoint-target-ports":
        # pflag's IntSlice: comma-separated; a repeated flag adds to the list.
        ports = result.overrides.get("discovery", {}).get("target_ports", [])
        ports = [*ports, *(_int(p.strip(), spelling) for p in text.split(",") if p.strip())]
        result.set("discovery.target_ports", ports)
    elif key == "config-file":
        result.config_file = Path(text) if text else None
        result.config_text = None
    elif key == "config-text":
        result.config_text = text or None
        result.config_file = None
    elif key == "v":
        result.verbosity_level = verbosity_level(_int(text, spelling))
    elif key == "zap-log-level":
        result.zap_level = zap_level(text, spelling)
    elif key == "zap-encoder":
        if text not in ("json", "console"):
            raise FlagError(f"{spelling}: invalid encoder {text!r} (json or console)")
        result.log_format = text
    elif key == "cert-path":
        if text:
            result.set(
                "server.tls",
                {"cert_file": str(Path(text) / "tls.crt"), "key_file": str(Path(text) / "tls.key")},
            )
    elif key in METRIC_SPEC_FLAGS:
        spec = _unquoted(text)
        try:
            parse_metric_spec(spec)
        except MetricSpecError as exc:
            raise FlagError(f"{spelling}: {exc}") from None
        result.set(f"datalayer.{METRIC_SPEC_FLAGS[key]}", spec)
    elif key == "model-server-metrics-port":
        port = _int(_unquoted(text), spelling)
        if not 0 <= port <= 65535:
            raise FlagError(f"{spelling}: {port} is not a port (0: the target port)")
        result.set("datalayer.metrics_port", port)
    elif key == "model-server-metrics-path":
        path = _unquoted(text)
        if not path.startswith("/") or any(c.isspace() for c in path):
            raise FlagError(f"{spelling}: {path!r} is not a URL path (e.g. /metrics)")
        result.set("datalayer.metrics_path", path)
    elif key == "model-server-metrics-scheme":
        scheme = _unquoted(text)
        if scheme not in ("http", "https"):
            raise FlagError(f"{spelling}: {scheme!r} is not a scheme (http or https)")
        result.set("datalayer.metrics_scheme", scheme)
    elif key == "model-server-metrics-https-insecure-skip-verify":
        result.set("datalayer.scrape_insecure_skip_verify", bool(value))
    elif key in HONOURED:
        return
    elif key in IGNORED:
        if spelling not in result.ignored:
            result.ignored.append(spelling)
        return
    _mapped(result, spelling, key)


def _unquoted(text: str) -> str:
    """A value without the double quotes around it: upstream's charts render
    `--total-queued-requests-metric="sglang:num_queue_reqs"` as one YAML plain scalar, so
    the quotes reach the flag as part of its value (Go's flag parser keeps them too)."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def _mapped(result: UpstreamArgs, spelling: str, key: str) -> None:
    result.mapped[spelling] = MAPPED[key]


def _finish(result: UpstreamArgs, raw: list[tuple[str, str, str | bool]]) -> None:
    # As upstream's LoggingOptions.Complete: an explicit --zap-log-level wins over -v.
    result.log_level = result.zap_level or result.verbosity_level
    datalayer = result.overrides.get("datalayer", {})
    if (
        datalayer.get("metrics_scheme") == "https"
        and "scrape_insecure_skip_verify" not in datalayer
    ):
        # Upstream's --model-server-metrics-https-insecure-skip-verify defaults to true: a
        # pool scraped over https with its flags is not verified there either.
        datalayer["scrape_insecure_skip_verify"] = True
        result.notes.append(
            "--model-server-metrics-scheme=https without "
            "--model-server-metrics-https-insecure-skip-verify: pods' certificates are not "
            "verified, as upstream's default; pass it =false (or set datalayer.scrape_ca_file "
            "and the flag =false) to verify them"
        )
    server = result.overrides.get("server", {})
    if server.get("secure_serving") is False and "tls" in server:
        # Upstream serves plaintext then and never reads the directory.
        del server["tls"]
        spellings = [s for s, k, _ in raw if k == "cert-path"]
        for spelling in spellings:
            result.mapped.pop(spelling, None)
        result.notes.append(
            f"{spellings[0]} is not used: --secure-serving=false serves plaintext, as upstream"
        )


def read_config_source(upstream: UpstreamArgs) -> tuple[dict[str, Any] | None, str | None]:
    """The --config-file / --config-text content: (our config as a mapping, None), or
    (None, a description of the upstream EndpointPickerConfig that is not applied), or
    (None, None) when neither flag was given."""
    if upstream.config_file is not None:
        where = str(upstream.config_file)
        text = upstream.config_file.read_text()
    elif upstream.config_text is not None:
        where, text = "--config-text", upstream.config_text
    else:
        return None, None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not YAML: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the configuration must be a YAML mapping")
    if is_upstream_config(data):
        refuse_disaggregation(data, where)
        return None, f"{where} ({data.get('apiVersion')} {UPSTREAM_CONFIG_KIND})"
    return data, None


# Plugin types of the upstream EPP's disaggregated serving (prefill/decode, encode): the
# pods of one pool play different roles and one request is scheduled on two or three of
# them. This EPP treats every pod of a pool as a full server, so under such a config it
# would send prompts to prefill-only pods; starting would be worse than refusing.
_DISAGGREGATION_MARKERS = ("prefill", "encode-filter", "disagg", "pd-decider")


def refuse_disaggregation(data: dict[str, Any], where: str) -> None:
    """A ValueError (exit 2, one line) for an EndpointPickerConfig this EPP cannot stand in
    for: more than one scheduling profile, or a disaggregation plugin."""
    plugins = data.get("plugins")
    types = sorted(
        {
            str(p.get("type"))
            for p in (plugins if isinstance(plugins, list) else ())
            if isinstance(p, dict)
            and any(marker in str(p.get("type", "")) for marker in _DISAGGREGATION_MARKERS)
        }
    )
    profiles = data.get("schedulingProfiles")
    several = isinstance(profiles, list) and len(profiles) > 1
    if types or several:
        what = ", ".join(types) if types else f"{len(profiles or ())} scheduling profiles"
        raise ValueError(
            f"{where}: a disaggregated-serving EndpointPickerConfig ({what}): this EPP "
            "schedules every pod of the pool as a full server and cannot stand in for it"
        )


def is_upstream_config(data: dict[str, Any]) -> bool:
    """An upstream plugins file (EndpointPickerConfig), not our configuration."""
    if data.get("kind") != UPSTREAM_CONFIG_KIND:
        return False
    group = str(data.get("apiVersion", "")).split("/", 1)[0]
    return group in UPSTREAM_CONFIG_GROUPS or not group
