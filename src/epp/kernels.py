"""Which implementation of the hot loops runs: compiled or pure Python.

Three C extensions are built by `pip install` when a C compiler is there (setup.py:
optional): `epp.prefix._kernels` (the block-hash chain, the lookup walk, approximate
record and eviction), `epp.scheduling._kernels` (the weighted sum, the picker's ties, the prefill
pass) and `epp.tokenization._kernels` (the fast tokenizer path's split and piece
cache). Each of their functions has a pure-Python twin next to its caller, which stays the
reference: tests/{prefix,scheduling,tokenization}/test_kernels.py compare the two on
random inputs. `EPP_KERNELS=python` in the environment makes the router use the
twins even when the extensions are installed (to compare them, or to rule them out). The
choice is made once, at import; `epp serve` logs it.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load(name: str) -> ModuleType | None:
    if os.environ.get("EPP_KERNELS", "").strip().lower() == "python":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


PREFIX: ModuleType | None = _load("epp.prefix._kernels")
SCHEDULING: ModuleType | None = _load("epp.scheduling._kernels")
TOKENIZATION: ModuleType | None = _load("epp.tokenization._kernels")
# "compiled", "python", or "partial" (an extension failed to build or import).
KERNELS = {3: "compiled", 0: "python"}.get(
    sum(module is not None for module in (PREFIX, SCHEDULING, TOKENIZATION)), "partial"
)
