"""Flag values read as Go reads them (strconv.ParseBool, time.ParseDuration, pflag's
ints), controller-runtime's log levels, and flag names in kebab case. Each error is one
line naming the flag."""

from __future__ import annotations

import re


class FlagError(ValueError):
    """A flag argument that cannot be read; the message is one line for the operator."""


def kebab(name: str) -> str:
    """`grpcHealthPort` -> `grpc-health-port`; kebab names unchanged."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", name).lower()


TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def parse_bool(text: str, flag: str) -> bool:
    """Go's strconv.ParseBool."""
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise FlagError(f"{flag}: invalid boolean {text!r} (true or false)")


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str, flag: str) -> float:
    """Go's time.ParseDuration ("30s", "1m30s", "500ms", "0"), in seconds."""
    body = text.strip()
    if body in ("0", "+0", "-0"):
        return 0.0
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    pos, total = 0, 0.0
    while pos < len(body):
        match = _DURATION_PART.match(body, pos)
        if match is None:
            raise FlagError(f"{flag}: invalid duration {text!r} (e.g. 30s, 1m30s, 500ms)")
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if not body:
        raise FlagError(f"{flag}: invalid duration {text!r} (e.g. 30s, 1m30s, 500ms)")
    return sign * total


def verbosity_level(verbosity: int) -> str:
    """Upstream's -v (logging/const.go: DEFAULT 2, VERBOSE 3, DEBUG 4, TRACE 5) as our
    level: the default and below log what our `info` logs; VERBOSE and DEBUG add
    per-request lines, which our `debug` carries; TRACE adds per-pod and per-block
    detail, our `trace`."""
    if verbosity <= 2:
        return "info"
    if verbosity <= 4:
        return "debug"
    return "trace"


_ZAP_LEVELS = {
    "debug": "debug",
    "info": "info",
    "warn": "warning",
    "error": "error",
    "dpanic": "error",
    "panic": "error",
    "fatal": "error",
}


def zap_level(text: str, flag: str) -> str:
    """controller-runtime's --zap-log-level: a level name, or an integer > 0 which is a
    verbosity as -v's."""
    if text.lower() in _ZAP_LEVELS:
        return _ZAP_LEVELS[text.lower()]
    if text.isdigit() and int(text) > 0:
        return verbosity_level(int(text))
    raise FlagError(f"{flag}: invalid level {text!r} (debug, info, warn, error, or an integer > 0)")


def parse_int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise FlagError(f"{flag}: invalid integer {text!r}") from None


def unquoted(text: str) -> str:
    """A value without the double quotes around it: upstream's charts render
    `--total-queued-requests-metric="sglang:num_queue_reqs"` as one YAML plain scalar, so
    the quotes reach the flag as part of its value (Go's flag parser keeps them too)."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text
