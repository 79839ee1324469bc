"""Which implementation of the prefix index's hot loops runs: compiled or pure Python.

`epp.prefix._kernels` (C, src/epp/prefix/_kernels.c) is built by `pip install` when a C
compiler is there (setup.py: optional). Each of its functions has a pure-Python twin next
to its caller, which stays the reference: tests/prefix/test_kernels.py compares the two on
random inputs. `EPP_KERNELS=python` in the environment makes the router use the pure-Python
twins even when the compiled module is installed (to compare them, or to rule them out).
The choice is made once, at import; `epp serve` logs it.
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("EPP_KERNELS", "").strip().lower() == "python":
        return None
    try:
        from epp.prefix import _kernels
    except ImportError:
        return None
    return _kernels


COMPILED: ModuleType | None = _load()
KERNELS = "compiled" if COMPILED is not None else "python"
