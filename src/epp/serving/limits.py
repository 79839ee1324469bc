"""The process limits `epp serve` raises at start.

Open files: each followed pod holds about 4 file descriptors (its KV-event connection and
the ZMQ sockets' wake-up descriptors) and each scraped pod one (its keep-alive
connection), on top of the gateway's streams. The soft limit many systems set, 1,024,
would stop the EPP at about 200 precise pods; the hard limit is the operator's (or the
container runtime's) actual ceiling, so the soft one is raised to it.
"""

from __future__ import annotations

import structlog

log = structlog.get_logger("epp.app")


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns (old, new) soft limits, or
    None where the platform has no such limit. Logged once at INFO; never raises: a limit
    the kernel refuses (a hard limit of "unlimited" above the kernel's own ceiling) keeps
    the old one, said in the same line."""
    try:
        import resource
    except ImportError:  # not a POSIX platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = soft
    refused = None
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            new = hard
        except (OSError, ValueError) as exc:
            refused = str(exc)
    log.info(
        "open_files_limit",
        old=_limit(soft),
        new=_limit(new),
        hard=_limit(hard),
        **({"refused": refused} if refused else {}),
    )
    return soft, new


def _limit(value: int) -> int | str:
    import resource

    return "unlimited" if value == resource.RLIM_INFINITY else value
