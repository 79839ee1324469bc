"""The `epp` console script: one entry point, one subcommand per job.

Each subcommand lives in its own module and is imported only when used, so `epp sim`
does not pay for grpc and `epp serve` does not pay for the demo's client code.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("epp.app", "serve the endpoint picker (ext_proc gRPC + Prometheus metrics)"),
    "sim": ("vllm_sim.cli", "serve one simulated vLLM pod"),
    "demo": ("epp_demo.cli", "run the local stack, drive a workload, compare with round robin"),
    "run": ("epp_demo.run", "serve the local stack (pods, EPP, Envoy) until interrupted"),
    "envoy-config": ("epp.envoy_config", "print an Envoy configuration for the EPP"),
    "calibrate": ("epp.calibrate", "measure a pod's prefill cost for the prefill scorer"),
    "bench": ("epp_bench.cli", "benchmarks: virtual time, live with peers, EPP overhead"),
}


def usage() -> str:
    lines = ["usage: epp <command> [options]", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`epp <command> --help` describes each command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        from epp import __version__

        print(__version__)
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"epp: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
