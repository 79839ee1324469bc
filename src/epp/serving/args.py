"""`epp serve`'s command line: our flags, the upstream EPP's (epp/upstream_flags/), and
the configuration they make with the config file (flags over the file)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from epp.config import EppConfig, load_config, load_endpoints_file
from epp.scheduling.registry import ScorerRegistry
from epp.upstream_flags import UpstreamArgs, read_config_source, translate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp serve",
        description="Serve the endpoint picker: Envoy ext_proc over gRPC, Prometheus metrics over HTTP.",
        epilog="The upstream EPP's flags (GIE, llm-d router: -poolName, --pool-group, -v 4, "
        "--zap-encoder, --config-file, --secure-serving, --tracing, ...) are accepted in Go's "
        "flag syntax: the supported ones are mapped, the others named in one warning "
        '(README, "epp serve flags").',
        allow_abbrev=False,  # a prefix of a flag is not that flag: upstream's never are
    )
    parser.add_argument("--config", type=Path, help="YAML configuration (see README)")
    parser.add_argument(
        "--endpoints", type=Path, help="static discovery file: endpoints: [...] (watched)"
    )
    parser.add_argument(
        "--pool-name", help="Kubernetes discovery: the InferencePool whose pods to route to"
    )
    parser.add_argument(
        "--pool-namespace", help="the pool's namespace (default: the EPP pod's own)"
    )
    parser.add_argument(
        "--kubeconfig", type=Path, help="outside a cluster: the kubeconfig (default: $KUBECONFIG)"
    )
    parser.add_argument("--grpc-host")
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument(
        "--grpc-health-port", type=int, help="gRPC health, plaintext (default 9003; 0: any free)"
    )
    parser.add_argument("--metrics-host")
    parser.add_argument("--metrics-port", type=int)
    parser.add_argument(
        "--plaintext",
        action="store_true",
        default=None,
        help="serve the gRPC port without TLS (server.secure_serving: false); the default is "
        "TLS, with a self-signed certificate unless server.tls gives one",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="EPP processes on this node behind one port (server.workers, default 1)",
    )
    parser.add_argument(
        "--log-level",
        choices=["trace", "debug", "info", "warning", "error"],
        help="default: info, or EPP_LOG_LEVEL",
    )
    return parser


def our_flag_names(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The parser's long flags without their dashes (what `translate` passes through)."""
    return frozenset(
        opt[2:] for action in parser._actions for opt in action.option_strings if opt[:2] == "--"
    )


def parse_serve_args(argv: list[str]) -> tuple[argparse.Namespace, UpstreamArgs]:
    """`epp serve`'s arguments: ours, and the upstream EPP's (epp/upstream_flags/).
    Raises FlagError for a malformed upstream flag; argparse exits on anything unknown."""
    parser = build_parser()
    upstream = translate(argv, our_flag_names(parser))
    return parser.parse_args(upstream.ours), upstream


def _merged(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section (the config's sections are mappings)."""
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for section, values in top.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


def config_from_args(args: argparse.Namespace, upstream: UpstreamArgs | None = None) -> EppConfig:
    """The configuration: the file (--config, or an upstream --config-file/--config-text in
    our format), then the upstream flags, then ours; EPP_LOG_LEVEL when no flag sets it."""
    upstream = upstream or UpstreamArgs()
    overrides = _merged(upstream.overrides, _our_overrides(args, upstream))
    path: Path | None = args.config
    data, upstream.unapplied_config = read_config_source(upstream)
    if data is not None:
        if args.config is not None:
            raise ValueError(
                "--config and --config-file/--config-text both give a configuration: keep one"
            )
        if upstream.config_file is None:  # --config-text: its content is the base
            overrides = _merged(data, overrides)
        path = upstream.config_file
    config = load_config(path, overrides)
    if config.endpoints_file is not None:
        load_endpoints_file(config.endpoints_file)  # a bad file fails now, with its path
    # `epp serve` has the built-in scorers only: a misspelled weight fails here, in one line.
    ScorerRegistry().check(config.scheduling)
    return config


def _our_overrides(args: argparse.Namespace, upstream: UpstreamArgs) -> dict:
    """What our own flags (and EPP_LOG_LEVEL) set, as config sections."""
    server = _given(args, "grpc_host", "grpc_port", "grpc_health_port", "metrics_host", "metrics_port", "workers")  # fmt: skip
    if args.plaintext:
        server["secure_serving"] = False
    ours: dict = {"server": server} if server else {}
    level = args.log_level or upstream.log_level or os.environ.get("EPP_LOG_LEVEL")
    if level:
        ours["log_level"] = level
    if upstream.log_format:
        ours["log_format"] = upstream.log_format
    discovery = _given(args, "pool_name", "pool_namespace", "kubeconfig")
    if discovery:
        ours["discovery"] = discovery
    if args.endpoints is not None:
        ours["endpoints_file"] = args.endpoints.absolute()
    return ours


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The flags among `names` given on the command line (None: not given)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
