"""The simulator shares no code with the router it is used to measure."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import vllm_sim

PACKAGE = Path(vllm_sim.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
    return modules


def test_no_module_of_vllm_sim_imports_the_router_or_its_tools() -> None:
    offenders = {
        f"{path.name}: {module}"
        for path in sorted(PACKAGE.glob("*.py"))
        for module in _imported_modules(path)
        if module.split(".")[0] == "epp" or module.startswith("epp_")
    }
    assert not offenders


def test_importing_the_whole_simulator_loads_no_router_module() -> None:
    code = (
        "import sys, vllm_sim.cli, vllm_sim.server; "
        "print(sorted(m for m in sys.modules if m == 'epp' or m.startswith(('epp.', 'epp_'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
