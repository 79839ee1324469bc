"""The router package stands alone: it imports nothing from the harness beside it, and
every third-party module it imports is one of its declared runtime dependencies."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUTER = ROOT / "src" / "epp"
HARNESS = {"vllm_sim", "epp_demo", "epp_harness", "epp_bench"}

# Import name -> distribution name, where they differ.
DISTRIBUTION = {
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "envoy": "xds-protos",
    "google": "protobuf",
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "zmq": "pyzmq",
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def router_imports() -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported_top_levels(p) for p in ROUTER.rglob("*.py")}


def declared_dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for requirement in project["dependencies"]:
        name = requirement.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower())
    return names


def test_the_router_imports_nothing_from_the_harness() -> None:
    offenders = {path: sorted(names & HARNESS) for path, names in router_imports().items()}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_cli_wires_harness_commands_lazily_by_name() -> None:
    from epp.cli import SUBCOMMANDS

    modules = {module.split(".")[0] for module, _ in SUBCOMMANDS.values()}
    assert HARNESS - {"epp_harness"} <= modules  # wired, as strings
    assert not imported_top_levels(ROUTER / "cli.py") & HARNESS  # not imported


def test_every_third_party_import_of_the_router_is_a_runtime_dependency() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    third_party = set().union(*router_imports().values()) - stdlib - {"epp"}
    distributions = {DISTRIBUTION.get(name, name).replace("_", "-") for name in third_party}
    assert distributions - declared_dependencies() == set()
