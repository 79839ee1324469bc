"""`epp envoy-config`: the command line of `render`."""

from __future__ import annotations

import argparse

import epp.envoy_config as package
from epp.addresses import AddressError, parse_host_port
from epp.envoy_config.epp_cluster import EppTls
from epp.envoy_config.listener import render
from epp.envoy_config.names import UPSTREAM_IDLE_TIMEOUT_S


def _address_arg(text: str) -> str:
    """A `host:port` flag, refused by argparse with the parser's one-line reason."""
    try:
        parse_host_port(text)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epp envoy-config", description=description)
    parser.add_argument("--mode", choices=["epp", "round_robin", "least_request"], default="epp")
    parser.add_argument("--listen-port", type=int, default=8080)
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--epp-port", type=int, default=9002)
    parser.add_argument("--epp-host", default="127.0.0.1")
    parser.add_argument("--host", default="127.0.0.1", help="address Envoy listens on")
    parser.add_argument(
        "--pod", action="append", default=[], type=_address_arg, help="ip:port (baselines)"
    )
    parser.add_argument(
        "--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED"
    )
    parser.add_argument(
        "--fail-open",
        action="store_true",
        help="if the EPP cannot be reached, Envoy routes by itself (override_host: round "
        "robin; original_dst: 503). See the README's failure modes.",
    )
    parser.add_argument(
        "--upstream-idle-timeout",
        type=float,
        default=UPSTREAM_IDLE_TIMEOUT_S,
        help="seconds without a byte from the pod before the attempt fails (a hung pod); "
        "must exceed the longest non-streamed generation",
    )
    parser.add_argument(
        "--strip-header",
        action="append",
        default=[],
        help="also remove this client header before the EPP sees it (e.g. the "
        "flow_control.priority_header the EPP trusts)",
    )
    parser.add_argument(
        "--keep-objective-headers",
        action="store_true",
        help="let clients name their InferenceObjective (x-llm-d-inference-objective, "
        "x-gateway-inference-objective), which sets their priority. Default: removed, as "
        "for untrusted traffic",
    )
    parser.add_argument(
        "--pod-cluster",
        choices=["override_host", "original_dst"],
        default="override_host",
        help="override_host: the pods are listed (--pod), fallbacks work; "
        "original_dst: any ip:port the EPP names, primary only",
    )
    parser.add_argument(
        "--epp-address",
        action="append",
        default=[],
        type=_address_arg,
        metavar="HOST:PORT",
        help="an EPP replica (repeat for several; a DNS name stands for every address it "
        "resolves to, e.g. a headless Service): health-checked, least request, retried on "
        "another replica when a stream cannot start. Replaces --epp-host/--epp-port.",
    )
    parser.add_argument(
        "--epp-plaintext",
        action="store_true",
        help="dial the EPP without TLS (an EPP started with --plaintext or "
        "server.secure_serving: false). Default: TLS, the certificate not verified "
        "unless --epp-ca-file is given",
    )
    parser.add_argument(
        "--epp-ca-file",
        "--epp-tls-ca",
        dest="epp_tls_ca",
        metavar="PATH",
        help="verify the EPP's certificate against this CA file (the EPP's server.tls)",
    )
    parser.add_argument(
        "--epp-sni",
        "--epp-tls-server-name",
        dest="epp_tls_server_name",
        metavar="NAME",
        help="with --epp-ca-file: the name the EPP's certificate must carry, sent as SNI "
        "when it is a host name (default: --epp-host)",
    )
    parser.add_argument(
        "--completions",
        choices=["access-log", "observer"],
        default="access-log",
        help="how the EPP learns that a request ended: Envoy's gRPC access log, one message "
        "per finished request on a long-lived stream (default), or the observer ext_proc "
        "filter, one stream per request",
    )
    parser.add_argument("--epp-tls-cert", help="Envoy's client certificate (EPP with mTLS)")
    parser.add_argument("--epp-tls-key", help="the key of --epp-tls-cert")
    return parser


def _epp_tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EppTls | None:
    """The --epp-tls-* / --epp-ca-file / --epp-sni flags, checked together."""
    if (args.epp_tls_cert is None) != (args.epp_tls_key is None):
        parser.error("--epp-tls-cert and --epp-tls-key go together")
    if args.epp_tls_ca is None and (args.epp_tls_cert or args.epp_tls_server_name):
        parser.error("--epp-sni and --epp-tls-cert/--epp-tls-key need --epp-ca-file")
    if args.epp_plaintext and args.epp_tls_ca is not None:
        parser.error("--epp-plaintext and --epp-ca-file exclude each other")
    if args.epp_tls_ca is None:
        return None
    return EppTls(
        args.epp_tls_ca,
        args.epp_tls_server_name or args.epp_host,
        args.epp_tls_cert,
        args.epp_tls_key,
    )


def main(argv: list[str]) -> int:
    parser = _parser(package.__doc__)
    args = parser.parse_args(argv)
    epp_tls = _epp_tls(parser, args)
    print(
        render(
            mode=args.mode,
            listen_port=args.listen_port,
            admin_port=args.admin_port,
            epp_port=args.epp_port if args.mode == "epp" else None,
            pods=args.pod,
            body_mode=args.body_mode,
            host=args.host,
            epp_host=args.epp_host,
            fail_open=args.fail_open,
            upstream_idle_timeout_s=args.upstream_idle_timeout,
            pod_cluster=args.pod_cluster,
            strip_headers=args.strip_header,
            keep_objective_headers=args.keep_objective_headers,
            epp_tls=epp_tls,
            epp_addresses=args.epp_address,
            epp_plaintext=args.epp_plaintext,
            completions="observer" if args.completions == "observer" else "access_log",
        ),
        end="",
    )
    return 0
