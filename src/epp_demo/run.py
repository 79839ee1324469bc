"""`epp run`: serve the local stack (simulated pods, EPP, Envoy) until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from epp_demo.cli import DEMO_SIM_ARGS
from epp_demo.workload import DEFAULT_MODEL
from epp_harness.stack import LocalStack, StackError, sigterm_as_keyboard_interrupt

_WATCH_INTERVAL_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp run",
        description="Serve the local stack until interrupted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=4, help="simulated vLLM pods")
    parser.add_argument("--port", type=int, default=8080, help="Envoy's listener port")
    parser.add_argument(
        "--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED"
    )
    parser.add_argument(
        "--mode",
        choices=["epp", "round_robin", "least_request"],
        default="epp",
        help="who picks the pod (default: the EPP)",
    )
    parser.add_argument(
        "--sim-args",
        default=shlex.join(DEMO_SIM_ARGS),
        help="arguments for every simulated pod",
    )
    parser.add_argument("--epp-config", type=Path, help="EPP config YAML file")
    parser.add_argument("--work-dir", type=Path, help="keep configs and logs here")
    return parser


def usage_text(stack: LocalStack) -> str:
    body = json.dumps(
        {
            "model": DEFAULT_MODEL,
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
        }
    )
    lines = [
        f"Envoy listening on {stack.envoy_url} ({stack.mode}, {stack.body_mode})",
        "",
        "Try:",
        f"  curl -si {stack.envoy_url}/v1/chat/completions \\",
        "    -H 'content-type: application/json' \\",
        f"    -d '{body}'",
        "  (the x-sim-pod response header names the pod that served it)",
        "",
    ]
    if stack.epp_metrics_url:
        transport = "plaintext" if stack.epp_plaintext else "TLS, self-signed"
        lines.append(
            f"EPP metrics:   {stack.epp_metrics_url}  (gRPC on {stack.epp_grpc_port}, {transport})"
        )
    lines.append(f"Envoy admin:   {stack.envoy_admin_url}")
    lines += [
        f"{pod.name}:         {pod.base_url}  (metrics {pod.metrics_url})" for pod in stack.pods
    ]
    kept = "" if stack.keeps_work_dir else "  (removed on exit; --work-dir keeps them)"
    lines.append(f"logs:          {stack.work_dir}{kept}")
    lines += ["", "Ctrl-C stops everything."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    epp_config = args.epp_config.read_text() if args.epp_config else None
    stack = LocalStack(
        pods=args.pods,
        mode=args.mode,
        body_mode=args.body_mode,
        sim_args=shlex.split(args.sim_args),
        epp_config_yaml=epp_config,
        work_dir=args.work_dir,
        listen_port=args.port,
    )
    with sigterm_as_keyboard_interrupt():
        try:
            print(f"starting {args.pods} pods, {args.mode}, Envoy on port {args.port}...",
                  file=sys.stderr, flush=True)  # fmt: skip
            with stack:
                print(usage_text(stack), flush=True)
                reported: set[str] = set()
                while True:
                    time.sleep(_WATCH_INTERVAL_S)
                    # Say once when a process dies; the rest of the stack keeps serving.
                    gone = set(stack.log_paths) - set(stack.pids) - reported
                    for name in sorted(gone):
                        print(f"{name} exited; see {stack.log_paths[name]}", file=sys.stderr)
                    reported |= gone
        except StackError as exc:
            print(f"epp run: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nstopped", file=sys.stderr)
            return 0
