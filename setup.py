"""The compiled kernels of the prefix index (src/epp/prefix/_kernels.c).

Everything else about the package is in pyproject.toml; setuptools reads C extensions only
from here. The extension is optional: without a C compiler the build goes on and the
router uses the pure-Python kernels (epp/prefix/kernels.py says which one runs, and
`epp serve` logs it), so `pip install` never fails for want of gcc.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "epp.prefix._kernels",
            sources=["src/epp/prefix/_kernels.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
