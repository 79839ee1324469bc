"""`translate`: `epp serve`'s argv split into our arguments (for argparse) and the upstream
flags' effect on the configuration (`UpstreamArgs`), read with Go's flag syntax (the
package docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epp.datalayer.metrics_parser import MetricSpecError, parse_metric_spec
from epp.upstream_flags.table import (
    BOOLEANS,
    FLAGS,
    HONOURED,
    IGNORED,
    MAPPED,
    METRIC_SPEC_FLAGS,
    POOL_GROUPS,
)
from epp.upstream_flags.values import (
    FALSE,
    TRUE,
    FlagError,
    kebab,
    parse_bool,
    parse_duration,
    parse_int,
    unquoted,
    verbosity_level,
    zap_level,
)

RawFlag = tuple[str, str, str | bool]  # (spelling, kebab name, value)


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


def translate(argv: list[str], our_flags: frozenset[str]) -> UpstreamArgs:
    """Split `argv` into our arguments (canonical `--name[=value]` spellings, for argparse)
    and the upstream flags' effect. `our_flags` are argparse's long names without dashes.
    Raises FlagError for an upstream flag whose value is missing or malformed."""
    result = UpstreamArgs()
    raw: list[RawFlag] = []
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
        spelling, key, eq, value = _split_flag(token)
        if key in ("h", "help"):
            result.ours.append("--help")
        elif key in our_flags:
            result.ours.append(f"--{key}" + (f"={value}" if eq else ""))
        elif key not in FLAGS:
            result.ours.append(token)  # argparse names it as unrecognized
        else:
            parsed, i = _flag_value(argv, i, spelling, key, value if eq else None)
            raw.append((spelling, key, parsed))
    for spelling, key, parsed in raw:
        _apply(result, spelling, key, parsed)
    _finish(result, raw)
    return result


def _split_flag(token: str) -> tuple[str, str, bool, str]:
    """(spelling, kebab name, whether `=value` was given, value) of `-x`, `--x=v`, `-v4`."""
    dashes = 2 if token.startswith("--") else 1
    name, eq, value = token[dashes:].partition("=")
    shorthand = re.fullmatch(r"v(\d+)", name) if dashes == 1 and not eq else None
    if shorthand is not None:
        name, eq, value = "v", "=", shorthand.group(1)
    return "-" * dashes + name, kebab(name), bool(eq), value


def _flag_value(
    argv: list[str], i: int, spelling: str, key: str, inline: str | None
) -> tuple[str | bool, int]:
    """The flag's value and the index of the next argument: `=value`, else for a boolean
    a bare true/false right after it (else true), else the next argument whatever it is."""
    if key in BOOLEANS:
        if inline is not None:
            return parse_bool(inline, spelling), i
        if i < len(argv) and argv[i] in TRUE | FALSE:
            return argv[i] in TRUE, i + 1  # what Go's strconv.ParseBool reads
        return True, i
    if inline is not None:
        return inline, i
    if i < len(argv):
        return argv[i], i + 1
    raise FlagError(f"{spelling}: the flag needs a value")


def _apply(result: UpstreamArgs, spelling: str, key: str, value: str | bool) -> None:
    """One upstream flag's effect on `result`; mapped flags are listed in `result.mapped`."""
    text = value if isinstance(value, str) else ""
    for apply in (_apply_serving, _apply_logging, _apply_datalayer):
        if apply(result, spelling, key, text, value):
            break
    else:
        if key in HONOURED:
            return
        if key in IGNORED:
            if spelling not in result.ignored:
                result.ignored.append(spelling)
            return
    result.mapped[spelling] = MAPPED[key]


def _apply_serving(
    result: UpstreamArgs, spelling: str, key: str, text: str, value: str | bool
) -> bool:
    """Discovery and the gRPC server; False: not one of these flags."""
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
        ports = [*ports, *(parse_int(p.strip(), spelling) for p in text.split(",") if p.strip())]
        result.set("discovery.target_ports", ports)
    elif key == "cert-path":
        if text:
            result.set(
                "server.tls",
                {"cert_file": str(Path(text) / "tls.crt"), "key_file": str(Path(text) / "tls.key")},
            )
    else:
        return False
    return True


def _apply_logging(
    result: UpstreamArgs, spelling: str, key: str, text: str, value: str | bool
) -> bool:
    """Log level and format, and the configuration source; False: not one of these."""
    if key == "config-file":
        result.config_file = Path(text) if text else None
        result.config_text = None
    elif key == "config-text":
        result.config_text = text or None
        result.config_file = None
    elif key == "v":
        result.verbosity_level = verbosity_level(parse_int(text, spelling))
    elif key == "zap-log-level":
        result.zap_level = zap_level(text, spelling)
    elif key == "zap-encoder":
        if text not in ("json", "console"):
            raise FlagError(f"{spelling}: invalid encoder {text!r} (json or console)")
        result.log_format = text
    else:
        return False
    return True


def _apply_datalayer(
    result: UpstreamArgs, spelling: str, key: str, text: str, value: str | bool
) -> bool:
    """Where and what the scraper reads on each pod; False: not one of these flags."""
    if key in METRIC_SPEC_FLAGS:
        spec = unquoted(text)
        try:
            parse_metric_spec(spec)
        except MetricSpecError as exc:
            raise FlagError(f"{spelling}: {exc}") from None
        result.set(f"datalayer.{METRIC_SPEC_FLAGS[key]}", spec)
    elif key == "model-server-metrics-port":
        port = parse_int(unquoted(text), spelling)
        if not 0 <= port <= 65535:
            raise FlagError(f"{spelling}: {port} is not a port (0: the target port)")
        result.set("datalayer.metrics_port", port)
    elif key == "model-server-metrics-path":
        path = unquoted(text)
        if not path.startswith("/") or any(c.isspace() for c in path):
            raise FlagError(f"{spelling}: {path!r} is not a URL path (e.g. /metrics)")
        result.set("datalayer.metrics_path", path)
    elif key == "model-server-metrics-scheme":
        scheme = unquoted(text)
        if scheme not in ("http", "https"):
            raise FlagError(f"{spelling}: {scheme!r} is not a scheme (http or https)")
        result.set("datalayer.metrics_scheme", scheme)
    elif key == "model-server-metrics-https-insecure-skip-verify":
        result.set("datalayer.scrape_insecure_skip_verify", bool(value))
    else:
        return False
    return True


def _finish(result: UpstreamArgs, raw: list[RawFlag]) -> None:
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
