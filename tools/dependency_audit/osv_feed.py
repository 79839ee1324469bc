"""A loopback OSV query endpoint over a saved set of advisories (requirements/advisories.json).

pip-audit asks an OSV service `POST /v1/query {"package": {"name", "ecosystem"}, "version"}`
and expects the advisories that affect that version. When PyPI's vulnerability data cannot
be reached (no network but the package index, as on CI's machines), pip-audit is pointed
here instead (`--vulnerability-service osv --osv-url`), so the same tool still audits, against
the saved advisories. Matching follows the OSV schema: a version is affected when an
advisory lists it in `versions`, or it falls in an ECOSYSTEM range (from an `introduced`
event up to a `fixed` one excluded or a `last_affected` one included, or open-ended); withdrawn advisories are left out, as pip-audit leaves them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def in_range(version: Version, events: Sequence[Mapping[str, str]]) -> bool:
    """Whether `version` falls in one OSV ECOSYSTEM range (its events in order)."""
    start: Version | None = None
    open_ = False
    for event in events:
        if "introduced" in event:
            start = None if event["introduced"] == "0" else _version(event["introduced"])
            open_ = True
        elif open_ and ("fixed" in event or "last_affected" in event):
            end = _version(event.get("fixed") or event["last_affected"])
            above = start is None or version >= start
            inside = end is not None and (
                version < end or ("last_affected" in event and version == end)
            )
            if above and inside:
                return True
            open_ = False
    return open_ and (start is None or version >= start)


def affects(advisory: Mapping[str, Any], name: str, version: Version) -> bool:
    for affected in advisory.get("affected", ()):
        package = affected.get("package", {})
        if package.get("ecosystem") != "PyPI" or canonicalize_name(package.get("name", "")) != name:
            continue
        listed = {_version(v) for v in affected.get("versions", ())}
        if version in listed:
            return True
        for range_ in affected.get("ranges", ()):
            if range_.get("type") == "ECOSYSTEM" and in_range(version, range_.get("events", ())):
                return True
    return False


class Advisories:
    """Package name -> its advisories, as saved by tools/dependency_audit/snapshot.py."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.source = str(data.get("source", "?"))
        self.taken = str(data.get("taken", "?"))
        self.by_package: dict[str, list[dict[str, Any]]] = {
            canonicalize_name(k): list(v) for k, v in data.get("packages", {}).items()
        }

    @classmethod
    def load(cls, path: Path) -> Advisories:
        return cls(json.loads(path.read_text()))

    def query(self, name: str, version_text: str) -> list[dict[str, Any]]:
        version = _version(version_text)
        if version is None:
            return []
        key = canonicalize_name(name)
        return [
            a
            for a in self.by_package.get(key, ())
            if not a.get("withdrawn") and affects(a, key, version)
        ]


def _handler(advisories: Advisories) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            try:
                query = json.loads(self.rfile.read(length))
                package = query["package"]
                vulns = (
                    advisories.query(package["name"], query["version"])
                    if package.get("ecosystem") == "PyPI"
                    else []
                )
            except (ValueError, KeyError, TypeError):
                self.send_error(400, "not an OSV query")
                return
            body = json.dumps({"vulns": vulns} if vulns else {}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def serve(advisories: Advisories) -> Iterator[str]:
    """Serve the advisories on 127.0.0.1 for the block; yields the query URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(advisories))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/query"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
