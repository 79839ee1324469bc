"""`json_logs(level)`: the EPP's real logging pipeline (`configure_logging`) writing to a
buffer; returns a callable giving the JSON lines logged so far.

`configure_logging` caches each module's logger on first use (for speed), and a test that
ran `epp serve`'s logging set-up earlier in this process would have frozen them at its
level. So the fixture also gives the modules under test fresh logger proxies, which read
the configuration made here, and restores structlog's defaults afterwards."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator

import pytest
import structlog

import epp.extproc.server
import epp.observability.answers
import epp.observability.metrics
import epp.routing.accounting
import epp.routing.dispatch
import epp.routing.observation
import epp.routing.preparation
from epp.observability.logs import configure_logging

_MODULES = {
    epp.routing.accounting: "epp.routing",
    epp.routing.dispatch: "epp.routing",
    epp.routing.observation: "epp.routing",
    epp.routing.preparation: "epp.routing",
    epp.extproc.server: "epp.extproc",
    epp.observability.answers: "epp.answers",
    epp.observability.metrics: "epp.datalayer",
}


@pytest.fixture
def json_logs(monkeypatch) -> Iterator[Callable[[str], Callable[[], list[dict]]]]:
    def start(level: str) -> Callable[[], list[dict]]:
        buffer = io.StringIO()
        configure_logging(level, stream=buffer)
        for module, name in _MODULES.items():
            monkeypatch.setattr(module, "log", structlog.get_logger(name))

        def lines() -> list[dict]:
            return [json.loads(line) for line in buffer.getvalue().splitlines() if line]

        lines.raw = buffer.getvalue  # type: ignore[attr-defined]
        return lines

    yield start
    configure_logging("info")  # clears the trace flag
    structlog.reset_defaults()
