"""A stand-in for the Kubernetes API server, for discovery tests.

No API server can run on this machine, so this fakes the part of one that discovery
talks to, over real HTTP on loopback (a threaded `http.server`):

- LIST of a namespaced collection (`/api/v1/namespaces/<ns>/pods`,
  `/apis/<group>/<version>/namespaces/<ns>/<plural>`) with `labelSelector` (k=v, k!=v)
  and `fieldSelector` (metadata.name=x), answering `metadata.resourceVersion`;
- WATCH of the same (`?watch=true&resourceVersion=N`): chunked JSON lines, one event
  each: ADDED / MODIFIED / DELETED (with the selector semantics of a real server: an
  object whose labels stop matching is DELETED from the watch), BOOKMARK (with
  `allowWatchBookmarks=true`) and ERROR with a 410 Status when the history since N was
  compacted; `timeoutSeconds` ends the stream cleanly;
- API discovery, `GET /apis/<group>/<version>`: an APIResourceList of the installed
  resources, 404 when none of the group is installed (the CRD is absent);
- Leases (coordination.k8s.io/v1, always served, for leader election): GET of one
  (`.../namespaces/<ns>/leases/<name>`, 404 if absent), POST to the collection (409
  AlreadyExists if the name is taken), PUT of one (409 Conflict unless the body's
  `metadata.resourceVersion` is the stored one: optimistic concurrency as the API server
  does it; 404 if absent). Every write gets a new resourceVersion.

Faults, on demand: `expire()` (410 Gone to open watches and to watches from older
versions), `drop_watches()` (the connection is cut mid-stream, without the final chunk),
`fail_next()` (the next requests get an error status), `refuse_lease_writes(holder)` (every
Lease write naming that holder gets a 500: a leader cut off from the API server, while
others still reach it). Every request is recorded in
`requests`, so tests can check that the client asked only for what its RBAC allows.

It is not a real API server: no authentication, no admission, no pagination, one global
resourceVersion counter, writes only through its Python methods except for Leases. Schema validation is
the caller's: `admitted(obj)` checks a custom resource against its upstream CRD's
`openAPIV3Schema` (tests/fixtures/upstream/*/crd) and applies the schema's defaults, as
the API server would before storing it; tests serve what it returns.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import jsonschema
import yaml

from epp.datalayer.kubernetes_resources import LEASE, WATCHED_RESOURCES, WatchedResource

Obj = dict[str, Any]
Key = tuple[str, str, str, str]  # group, version, plural, namespace


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: dict[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass
class _Entry:
    rv: int
    type: str  # ADDED / MODIFIED / DELETED; control: BOOKMARK / GONE / DROP / END
    key: Key | None  # None: every watch
    obj: Obj | None = None
    old: Obj | None = None


def _labels_match(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


def _fields_match(selector: str, obj: Obj) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        field, value = term.split("=", 1)
        if field != "metadata.name":
            raise ValueError(f"field selector {field!r} is not supported by the stand-in")
        if obj["metadata"].get("name") != value:
            return False
    return True


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hangs up (stop(), a dropped watch) is routine here


class KubeStandIn:
    def __init__(
        self,
        installed: Iterable[WatchedResource] = WATCHED_RESOURCES,
        *,
        gone_as_status: bool = False,
    ) -> None:
        self._cond = threading.Condition()
        self._installed = {(r.group, r.version, r.resource): r for r in installed}
        self._objects: dict[Key, dict[str, Obj]] = {}
        self._log: list[_Entry] = []
        self._rv = 100
        self._compacted = 0  # watches from a version below this get 410
        self._closing = False
        self._failures: list[tuple[str, int]] = []  # (path substring, status)
        self._refused_holders: set[str] = set()  # Lease writes naming these get a 500
        self._open: dict[Key, int] = {}
        self.gone_as_status = gone_as_status  # 410 as the HTTP status, not an ERROR event
        self.requests: list[Seen] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                standin._handle(self)

            def do_POST(self) -> None:
                standin._handle(self)

            def do_PUT(self) -> None:
                standin._handle(self)

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> KubeStandIn:
        self._thread.start()
        return self

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # --- the store, from tests ----------------------------------------------------------

    def _key(self, resource: WatchedResource, namespace: str) -> Key:
        return resource.group, resource.version, resource.resource, namespace

    def apply(self, resource: WatchedResource, obj: Obj, namespace: str = "default") -> Obj:
        """Create or replace an object (by metadata.name); returns the stored copy."""
        obj = copy.deepcopy(obj)
        metadata = obj.setdefault("metadata", {})
        metadata["namespace"] = namespace
        obj.setdefault("kind", resource.kind)
        group = f"{resource.group}/" if resource.group else ""
        obj.setdefault("apiVersion", f"{group}{resource.version}")
        key = self._key(resource, namespace)
        with self._cond:
            self._rv += 1
            metadata["resourceVersion"] = str(self._rv)
            store = self._objects.setdefault(key, {})
            old = store.get(metadata["name"])
            metadata.setdefault(
                "creationTimestamp",
                (old or {}).get("metadata", {}).get("creationTimestamp")
                or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(1_700_000_000 + self._rv)),
            )
            store[metadata["name"]] = obj
            kind = "MODIFIED" if old is not None else "ADDED"
            self._log.append(_Entry(self._rv, kind, key, copy.deepcopy(obj), old))
            self._cond.notify_all()
        return copy.deepcopy(obj)

    def delete(self, resource: WatchedResource, name: str, namespace: str = "default") -> None:
        key = self._key(resource, namespace)
        with self._cond:
            old = self._objects.get(key, {}).pop(name)
            self._rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._log.append(_Entry(self._rv, "DELETED", key, gone, old))
            self._cond.notify_all()

    def get(self, resource: WatchedResource, name: str, namespace: str = "default") -> Obj:
        with self._cond:
            return copy.deepcopy(self._objects[self._key(resource, namespace)][name])

    def install(self, *resources: WatchedResource) -> None:
        with self._cond:
            for r in resources:
                self._installed[(r.group, r.version, r.resource)] = r

    def uninstall(self, *resources: WatchedResource) -> None:
        with self._cond:
            for r in resources:
                self._installed.pop((r.group, r.version, r.resource), None)
            ended = [[r.group, r.version, r.resource] for r in resources]
            self._log.append(_Entry(self._rv, "END", None, {"resources": ended}))
            self._cond.notify_all()

    # --- faults and events, from tests --------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def bookmark(self) -> int:
        """Send a BOOKMARK at the current version to every watch that allows them."""
        with self._cond:
            self._log.append(_Entry(self._rv, "BOOKMARK", None))
            self._cond.notify_all()
            return self._rv

    def expire(self) -> None:
        """Compact the history: open watches get an ERROR 410 event and end; a watch
        from any version up to now gets 410 too."""
        with self._cond:
            self._compacted = self._rv + 1
            self._log.append(_Entry(self._rv, "GONE", None))
            self._cond.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream."""
        with self._cond:
            self._log.append(_Entry(self._rv, "DROP", None))
            self._cond.notify_all()

    def fail_next(self, count: int, status: int = 500, path_contains: str = "") -> None:
        with self._cond:
            self._failures.extend([(path_contains, status)] * count)

    def refuse_lease_writes(self, holder: str | None) -> None:
        """Lease creates and updates whose holderIdentity is `holder` get a 500 from now
        on; None: accept every write again."""
        with self._cond:
            self._refused_holders = set() if holder is None else {*self._refused_holders, holder}

    def open_watches(self, resource: WatchedResource | None = None) -> int:
        with self._cond:
            return sum(
                n
                for (g, v, p, _), n in self._open.items()
                if resource is None or (p == resource.resource and g == resource.group)
            )

    def seen(self, resource: WatchedResource, *, watch: bool | None = None) -> list[Seen]:
        """Requests for a resource's collection (lists and watches, or one kind)."""
        base = f"/apis/{resource.group}/" if resource.group else "/api/"
        suffix = f"/{resource.resource}"
        return [
            s
            for s in list(self.requests)
            if s.path.startswith(f"{base}{resource.version}/")
            and s.path.endswith(suffix)
            and (watch is None or s.watch == watch)
        ]

    # --- HTTP ---------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        query = dict(parse_qsl(parts.query))
        path = parts.path
        with self._cond:
            self.requests.append(Seen(h.command, path, query))
            failure = next((f for f in self._failures if f[0] in path), None)
            if failure is not None:
                self._failures.remove(failure)
        if failure is not None:
            return self._json(h, failure[1], _status(failure[1], "InternalError", "injected"))
        segments = path.strip("/").split("/")
        if (
            len(segments) in (6, 7)
            and segments[:4] == ["apis", LEASE.group, LEASE.version, "namespaces"]
            and segments[5] == LEASE.resource
        ):
            return self._lease(h, segments[4], segments[6] if len(segments) == 7 else None)
        if h.command != "GET":
            return self._json(h, 405, _status(405, "MethodNotAllowed", f"{h.command} {path}"))
        if segments[:2] == ["api", "v1"] and len(segments) == 5 and segments[2] == "namespaces":
            group, version, namespace, plural = "", "v1", segments[3], segments[4]
        elif segments[0] == "apis" and len(segments) == 6 and segments[3] == "namespaces":
            group, version, namespace, plural = segments[1], segments[2], segments[4], segments[5]
        elif segments[0] == "apis" and len(segments) == 3:
            return self._discovery(h, segments[1], segments[2])
        else:
            return self._json(h, 404, _status(404, "NotFound", f"no route {path}"))
        with self._cond:
            resource = self._installed.get((group, version, plural))
        if resource is None:
            return self._json(h, 404, _status(404, "NotFound", "the server could not find it"))
        key = (group, version, plural, namespace)
        if query.get("watch") in ("true", "1"):
            return self._watch(h, key, query)
        return self._list(h, key, resource, query)

    def _lease(self, h: BaseHTTPRequestHandler, namespace: str, name: str | None) -> None:
        """GET one, POST (create), PUT (update with resourceVersion) of a Lease."""
        body: Obj | None = None
        if h.command in ("POST", "PUT"):
            body = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)))
        key = self._key(LEASE, namespace)
        with self._cond:
            store = self._objects.setdefault(key, {})
            if h.command == "GET" and name is not None:
                if name not in store:
                    return self._json(h, 404, _status(404, "NotFound", f"lease {name} not found"))
                return self._json(h, 200, copy.deepcopy(store[name]))
            if body is None or h.command not in ("POST", "PUT"):
                return self._json(h, 405, _status(405, "MethodNotAllowed", "lease"))
            holder = (body.get("spec") or {}).get("holderIdentity")
            if holder in self._refused_holders:
                return self._json(h, 500, _status(500, "InternalError", "injected: refused"))
            metadata = body.setdefault("metadata", {})
            target = metadata.get("name")
            if h.command == "POST":
                if name is not None or not target:
                    return self._json(h, 400, _status(400, "BadRequest", "POST a named lease"))
                if target in store:
                    return self._json(
                        h, 409, _status(409, "AlreadyExists", f"leases {target!r} already exists")
                    )
                old = None
            else:
                if name is None or target != name:
                    return self._json(h, 400, _status(400, "BadRequest", "PUT needs the name"))
                old = store.get(name)
                if old is None:
                    return self._json(h, 404, _status(404, "NotFound", f"lease {name} not found"))
                if metadata.get("resourceVersion") != old["metadata"]["resourceVersion"]:
                    return self._json(
                        h,
                        409,
                        _status(409, "Conflict", "the object has been modified; please apply "
                                "your changes to the latest version and try again"),
                    )  # fmt: skip
            self._rv += 1
            metadata.update(namespace=namespace, resourceVersion=str(self._rv))
            body.setdefault("apiVersion", f"{LEASE.group}/{LEASE.version}")
            body.setdefault("kind", LEASE.kind)
            store[target] = copy.deepcopy(body)
            kind = "MODIFIED" if old is not None else "ADDED"
            self._log.append(_Entry(self._rv, kind, key, copy.deepcopy(body), old))
            self._cond.notify_all()
        self._json(h, 201 if h.command == "POST" else 200, body)

    def _json(self, h: BaseHTTPRequestHandler, code: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _discovery(self, h: BaseHTTPRequestHandler, group: str, version: str) -> None:
        with self._cond:
            resources = [
                r for (g, v, _), r in self._installed.items() if (g, v) == (group, version)
            ]
        if not resources:
            return self._json(h, 404, _status(404, "NotFound", "the server could not find it"))
        self._json(
            h,
            200,
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{group}/{version}",
                "resources": [
                    {
                        "name": r.resource,
                        "singularName": r.kind.lower(),
                        "namespaced": True,
                        "kind": r.kind,
                        "verbs": ["delete", "get", "list", "patch", "create", "update", "watch"],
                    }
                    for r in resources
                ],
            },
        )

    @staticmethod
    def _matches(obj: Obj | None, query: dict[str, str]) -> bool:
        if obj is None:
            return False
        labels = obj["metadata"].get("labels") or {}
        return _labels_match(query.get("labelSelector", ""), labels) and _fields_match(
            query.get("fieldSelector", ""), obj
        )

    def _list(
        self, h: BaseHTTPRequestHandler, key: Key, resource: WatchedResource, query: dict[str, str]
    ) -> None:
        with self._cond:
            items = [
                copy.deepcopy(o)
                for o in self._objects.get(key, {}).values()
                if self._matches(o, query)
            ]
            rv = self._rv
        self._json(
            h,
            200,
            {
                "kind": f"{resource.kind}List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(rv)},
                "items": items,
            },
        )

    def _event(self, entry: _Entry, query: dict[str, str]) -> Obj | None:
        was, now = self._matches(entry.old, query), self._matches(entry.obj, query)
        if entry.type == "DELETED":
            kind = "DELETED" if was else None
        elif now:
            kind = "MODIFIED" if was else "ADDED"
        else:
            kind = "DELETED" if was else None
        return None if kind is None else {"type": kind, "object": entry.obj}

    def _watch(self, h: BaseHTTPRequestHandler, key: Key, query: dict[str, str]) -> None:
        since = int(query.get("resourceVersion") or 0)
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        with self._cond:
            too_old = since < self._compacted
            start = len(self._log)
            backlog = [e for e in self._log[:start] if e.key == key and e.rv > since and e.obj]
            if not too_old:
                self._open[key] = self._open.get(key, 0) + 1
        gone = _status(410, "Expired", f"too old resource version: {since}")
        if too_old and self.gone_as_status:
            return self._json(h, 410, gone)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(event: Obj) -> None:
            data = json.dumps(event).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        def end() -> None:
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()

        if too_old:
            send({"type": "ERROR", "object": gone})
            return end()
        try:
            for entry in backlog:
                if (event := self._event(entry, query)) is not None:
                    send(event)
            deadline = time.monotonic() + timeout
            position = start
            while True:
                with self._cond:
                    while (
                        position >= len(self._log)
                        and not self._closing
                        and time.monotonic() < deadline
                    ):
                        self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                    if self._closing or time.monotonic() >= deadline:
                        break
                    entries = self._log[position:]
                    position = len(self._log)
                for entry in entries:
                    if entry.type == "DROP":
                        h.close_connection = True
                        h.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if (
                        entry.type == "END"
                        and entry.obj
                        and list(key[:3]) in entry.obj["resources"]
                    ):
                        return end()  # the CRD was removed: its watches end
                    if entry.type == "GONE":
                        send({"type": "ERROR", "object": gone})
                        return end()
                    if entry.type == "BOOKMARK":
                        if bookmarks:
                            obj = {
                                "kind": "Bookmark",
                                "metadata": {"resourceVersion": str(entry.rv)},
                            }
                            send({"type": "BOOKMARK", "object": obj})
                        continue
                    if entry.key == key and (event := self._event(entry, query)) is not None:
                        send(event)
            end()
        except OSError:
            h.close_connection = True  # the client went away
        finally:
            with self._cond:
                self._open[key] -= 1


@contextmanager
def running(*args: Any, **kwargs: Any) -> Iterator[KubeStandIn]:
    standin = KubeStandIn(*args, **kwargs).start()
    try:
        yield standin
    finally:
        standin.close()


# --- object builders ------------------------------------------------------------------


def pool(name: str, selector: dict[str, str], ports: Iterable[int], **spec: Any) -> Obj:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": p} for p in ports],
            **spec,
        },
    }


def pod(
    name: str,
    labels: dict[str, str],
    ip: str | None = None,
    *,
    ready: bool = True,
    terminating: bool = False,
) -> Obj:
    status: Obj = {
        "phase": "Running" if ready else "Pending",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    metadata: Obj = {"name": name, "labels": dict(labels)}
    if terminating:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "spec": {"containers": [{"name": "vllm"}]}, "status": status}


# --- custom resources as the API server admits them -----------------------------------

UPSTREAM = Path(__file__).resolve().parent / "fixtures" / "upstream"

# The CEL rules (`x-kubernetes-validations`) of the inference CRDs, as Python on the
# defaulted value; jsonschema ignores `x-kubernetes-*` keywords, so these run besides it.
# A rule without a translation fails `admitted` (a new CRD version is not checked blind).
CEL_RULES: dict[str, Any] = {
    "self.kind != 'Service' || has(self.port)": lambda v: v.get("kind") != "Service" or "port" in v,
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": lambda v: (
        len([p.get("number") for p in v]) == len({p.get("number") for p in v})
    ),
    "self.all(model, has(model.weight)) || self.all(model, !has(model.weight))": lambda v: (
        all("weight" in m for m in v) or not any("weight" in m for m in v)
    ),
    "self == oldSelf": lambda v: True,  # a transition rule: a create has no old object
}


@cache
def crd_schemas() -> dict[tuple[str, str], tuple[str, Obj]]:
    """(apiVersion, kind) -> (fixture path, openAPIV3Schema) of every served version."""
    schemas: dict[tuple[str, str], tuple[str, Obj]] = {}
    for path in sorted(UPSTREAM.glob("*/crd/*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("served"):
                    key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                    schema = version["schema"]["openAPIV3Schema"]
                    schemas[key] = (str(path.relative_to(UPSTREAM)), schema)
    return schemas


def _strict(schema: Obj) -> Obj:
    """The schema with unknown fields refused (kubectl's strict field validation)."""
    out = {k: _strict(v) if isinstance(v, dict) else v for k, v in schema.items()}
    if "items" in out and isinstance(out["items"], dict):
        out["items"] = _strict(out["items"])
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    return out


def _defaulted(schema: Obj, value: Any) -> Any:
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _defaulted(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                if name not in (schema.get("properties") or {}):
                    value[name] = _defaulted(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_defaulted(schema["items"], item) for item in value]
    return value


def _cel(schema: Obj, value: Any, where: str) -> None:
    for rule in schema.get("x-kubernetes-validations") or ():
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            raise AssertionError(f"{where}: CEL rule without a translation: {rule['rule']!r}")
        if not check(value):
            raise jsonschema.ValidationError(f"{where}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                _cel(sub, value[name], f"{where}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _cel(schema["items"], item, f"{where}[{i}]")


def admitted(obj: Obj) -> Obj:
    """`obj` (apiVersion, kind, metadata.name, spec) checked against its upstream CRD and
    defaulted, as the API server stores it; jsonschema.ValidationError if it would be
    refused, KeyError if no fixture CRD serves its apiVersion and kind."""
    source, schema = crd_schemas()[(obj["apiVersion"], obj["kind"])]
    value = _defaulted(schema, copy.deepcopy(obj))
    where = f"{obj['kind']}/{obj.get('metadata', {}).get('name')} ({source})"
    try:
        jsonschema.validate(value, _strict(schema))
    except jsonschema.ValidationError as exc:
        raise jsonschema.ValidationError(f"{where}: {exc.message}") from None
    _cel(schema, value, where)
    return value


def upstream_objects(path: str, kind: str | None = None) -> list[Obj]:
    """The Kubernetes objects in an upstream fixture (YAML, or the ```yaml blocks of a
    Markdown page), optionally of one kind."""
    text = (UPSTREAM / path).read_text()
    if path.endswith(".md"):
        blocks = text.split("```yaml")[1:]
        text = "\n---\n".join(block.split("```")[0] for block in blocks)
    docs = [d for d in yaml.safe_load_all(text) if isinstance(d, dict) and "kind" in d]
    return [d for d in docs if kind is None or d["kind"] == kind]
