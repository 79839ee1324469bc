"""The compiled kernels (src/epp/{prefix,scheduling,tokenization}/_kernels.c).

Everything else about the package is in pyproject.toml; setuptools reads C extensions only
from here. The extensions are optional: without a C compiler the build goes on and the
router uses the pure-Python twins (epp/kernels.py says which run, and `epp serve` logs
it), so `pip install` never fails for want of gcc. -ffp-contract=off: no fused
multiply-add, so the scheduler's scores are bit-identical to the twins'.
"""

from setuptools import Extension, setup


def kernels(package: str) -> Extension:
    return Extension(
        f"epp.{package}._kernels",
        sources=[f"src/epp/{package}/_kernels.c"],
        extra_compile_args=["-O3", "-ffp-contract=off"],
        optional=True,
    )


setup(ext_modules=[kernels("prefix"), kernels("scheduling"), kernels("tokenization")])
