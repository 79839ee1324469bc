"""structlog set up once at start: JSON lines (or console text) to stderr, level from
config/env.

Request logs carry ids, pods, scores and token counts; never prompt text.

Levels, lowest first: `trace` (block-level detail: matched blocks per pod), `debug`,
`info`, `warning`, `error`. structlog has no level below DEBUG, so TRACE lines are DEBUG
calls marked with `trace=True` (`trace(...)` below); a processor renames their level to
"trace" and drops them unless the configured level is trace. Callers decide the level
once per request (`enabled(...)`) and build nothing for a level that is off.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import msgspec
import structlog

TRACE = 5
LEVELS = ("trace", "debug", "info", "warning", "error")
_TRACE_KEY = "_trace"
_trace_on = False
_encoder = msgspec.json.Encoder(enc_hook=repr)


def _dumps(event: Any, **_: Any) -> str:
    """One JSON line: msgspec (about 2x faster than the stdlib for a decision line), the
    stdlib for what msgspec refuses (e.g. a lone surrogate in a header value)."""
    try:
        return _encoder.encode(event).decode()
    except (TypeError, ValueError):
        return json.dumps(event, default=repr)


def _trace_level(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if event_dict.pop(_TRACE_KEY, False):
        if not _trace_on:
            raise structlog.DropEvent
        event_dict["level"] = "trace"
    return event_dict


class _CurrentStderr:
    """`sys.stderr` as it is when a line is written, not when logging was configured:
    loggers cache their stream on first use, and a process that swaps stderr (a test
    runner's capture, closed afterwards) must not leave them writing to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(
    level: str = "info",
    stream: TextIO | None = None,
    fmt: str = "json",
    fields: Mapping[str, Any] | None = None,
) -> None:
    """JSON lines (`fmt` "json") or zap-console-like text lines ("console", for
    --zap-encoder console) to `stream` (default: stderr) at `level` (one of LEVELS).
    `fields` go on every line (a worker's index, so that N workers' lines on one stream
    can be told apart); a line's own field of the same name wins."""
    global _trace_on
    level = level.lower()
    _trace_on = level == "trace"
    numeric = logging.DEBUG if _trace_on else getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            *((_StaticFields(dict(fields)),) if fields else ()),
            structlog.processors.add_log_level,
            _trace_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # The console renderer formats exceptions itself (and warns if they already are).
            *(
                (
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(serializer=_dumps),
                )
                if fmt == "json"
                else (structlog.dev.ConsoleRenderer(colors=False),)
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=stream or _CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


class _StaticFields:
    """A processor adding the same fields to every line, under the line's own."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __call__(self, _logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        for key, value in self.fields.items():
            event.setdefault(key, value)
        return event


def trace_enabled() -> bool:
    """True when `configure_logging("trace")` was the last configuration."""
    return _trace_on


def effective_level(logger: Any) -> int:
    """The numeric level a structlog logger lets through (TRACE when trace is on); one
    call per request, ~1 us. Loggers without the filtering API let everything through."""
    getter = getattr(logger, "get_effective_level", None)
    level = getter() if getter is not None else logging.NOTSET
    if level <= logging.DEBUG:
        return TRACE if _trace_on else logging.DEBUG
    return level


def trace(logger: Any, event: str, **fields: Any) -> None:
    """Log at TRACE: only call it after checking that trace is enabled."""
    logger.debug(event, **{_TRACE_KEY: True}, **fields)
