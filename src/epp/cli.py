"""The `epp` console script: one entry point, one subcommand per job.

Each subcommand lives in its own module and is imported only when used, so `epp sim`
does not pay for grpc and `epp serve` does not pay for the demo's client code. The router's
own commands live in `epp`; `sim`, `demo`, `run` and `bench` are wired here to the harness
packages beside it (`vllm_sim`, `epp_demo`, `epp_bench`), which need an extra installed.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("epp.app", "serve the endpoint picker (ext_proc gRPC + Prometheus metrics)"),
    "envoy-config": ("epp.envoy_config", "print an Envoy configuration for the EPP"),
    "calibrate": ("epp.calibrate", "measure a pod's prefill cost for the prefill scorer"),
    "sim": ("vllm_sim.cli", "serve one simulated vLLM pod"),
    "demo": ("epp_demo.cli", "run the local stack, drive a workload, compare with round robin"),
    "run": ("epp_demo.run", "serve the local stack (pods, EPP, Envoy) until interrupted"),
    "bench": ("epp_bench.cli", "benchmarks: virtual time, live with peers, EPP overhead"),
}

# The extra that installs a harness command's dependencies (`pip install 'epp[demo]'`).
HARNESS_EXTRA = {"sim": "sim", "demo": "demo", "run": "demo", "bench": "bench"}


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
    try:
        module = importlib.import_module(entry[0])
    except ModuleNotFoundError as exc:
        extra = HARNESS_EXTRA.get(args[0])
        if extra is None or (exc.name or "").split(".")[0] in ("epp",):
            raise
        print(
            f"epp {args[0]}: {exc.name} is not installed. The harness (simulator, demo, "
            f"benchmarks) comes with a source checkout of this repository: "
            f"pip install -e '.[{extra}]'",
            file=sys.stderr,
        )
        return 2
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
