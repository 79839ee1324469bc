"""Suite-wide check that the `e2e` marker means what the README says: a test that starts
a server process (Envoy, Prometheus, `epp serve` / `vllm serve`, a simulated pod, vLLM) is
marked `e2e`, so `-m 'not e2e'` runs none. One-shot tool runs (promtool, `envoy --mode
validate`, openssl, the Go chart renderer, `python -c ...`) are not servers and need no
mark. Every child process is started through `subprocess.Popen` (asyncio's subprocesses
too), so watching its constructor sees them all; a test not marked `e2e` that starts a
server fails with the command line it ran."""

from __future__ import annotations

import os
import shlex
import subprocess
from typing import Any

import pytest

_SERVER_PROGRAMS = {"envoy", "prometheus", "vllm_sim", "vllm-sim"}
_SERVER_MODULES = ("vllm_sim", "vllm.entrypoints")
_ONE_SHOT_FLAGS = {"--mode", "--version", "--help", "-h"}  # envoy --mode validate, ...

_started: list[str] = []  # server command lines started since the current test's setup


def is_server(args: Any) -> bool:
    """True if the command line starts a long-running server process."""
    if isinstance(args, str | bytes | os.PathLike):
        argv = shlex.split(os.fsdecode(args))
    else:
        argv = [os.fsdecode(a) for a in args]
    if not argv or _ONE_SHOT_FLAGS.intersection(argv):
        return False
    if os.path.basename(argv[0]) in _SERVER_PROGRAMS or "serve" in argv:
        return True
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return module.startswith(_SERVER_MODULES)
    return False


_original_init = subprocess.Popen.__init__


def _watched_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
    if is_server(args):
        _started.append(args if isinstance(args, str) else shlex.join(map(os.fsdecode, args)))
    _original_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _watched_init  # type: ignore[method-assign]


def _check(item: pytest.Item) -> None:
    if _started and item.get_closest_marker("e2e") is None:
        started, _started[:] = list(_started), []
        pytest.fail(
            f"{item.nodeid} starts a server process but is not marked e2e "
            f"(`pytestmark = pytest.mark.e2e`): {started[0]}",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _started.clear()  # before this test's fixtures start anything


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    _check(item)  # what its fixtures and the test started
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    result = yield  # the fixtures are torn down first, whatever this finds
    _check(item)
    return result


# ---- kernels_used: once with the compiled kernels, once with their pure-Python twins ---------
def _kernel_users() -> dict[str, tuple[Any, ...]]:
    """The modules that chose an implementation at import (epp.kernels), per extension."""
    from epp.prefix import approximate, hashing, holders
    from epp.scheduling import filters, picker, scheduler
    from epp.scheduling.scorers import prefill, queue
    from epp.tokenization import fast

    return {
        "PREFIX": (approximate, hashing, holders),
        "SCHEDULING": (filters, picker, scheduler, prefill, queue),
        "TOKENIZATION": (fast,),
    }


@pytest.fixture(params=["compiled", "python"])
def kernels_used(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test taking it runs once with the compiled kernels and once with the twins."""
    from epp import kernels

    for extension, users in _kernel_users().items():
        module = getattr(kernels, extension)
        if request.param == "compiled" and module is None:
            pytest.skip(f"the compiled {extension.lower()} kernels are not built (no C compiler)")
        for user in users:
            monkeypatch.setattr(user, "COMPILED", module if request.param == "compiled" else None)
    return str(request.param)
