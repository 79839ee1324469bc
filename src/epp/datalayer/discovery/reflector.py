"""List, then watch, one namespaced collection in a thread; publish every change.

The protocol, as client-go's reflector speaks it:

1. LIST the collection; its `metadata.resourceVersion` (rv) is where the watch starts.
2. WATCH from rv with `allowWatchBookmarks=true` and a server-side `timeoutSeconds`
   (jittered in [t, 2t]). Events arrive as JSON lines: ADDED / MODIFIED / DELETED carry
   the object and advance rv; BOOKMARK only advances rv; ERROR carries a Status.
3. The watch ends normally at the server's timeout: watch again from the last rv (after
   a backoff wait if it ended without a single line, so a proxy that closes watches at
   once is not hammered). A dropped connection or other error: wait (capped exponential
   backoff with jitter, reset by a successful list or by a watch line), then watch again
   from the last rv. A 410 Gone (as an ERROR event or as the answer to
   the watch request) means the history since rv was compacted: LIST again at once.
4. A change of label selector (the pool was edited) aborts the watch and relists.

Every change publishes the whole current set (a shallow copy) through `publish`, from
this thread; the caller moves it onto its event loop. Objects are the API's JSON as
dicts: nothing is deserialized into client models.

Optional resources (CRDs) ask API discovery (`present`) before listing; absent (or a 404
later: the CRD was removed) publishes an empty set and asks again every
`crd_recheck_s`.

`stop()` shuts the open connection's socket down, which wakes a thread blocked in a read
at once, rather than at the watch's timeout.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from kubernetes.client.exceptions import ApiException

from epp.datalayer.discovery.state import Backoff, ResourceStats
from epp.datalayer.kubernetes_resources import WatchedResource

log = structlog.get_logger("epp.discovery")

Obj = Mapping[str, Any]


class Response(Protocol):
    """What the client returns with `_preload_content=False` (a urllib3 HTTPResponse)."""

    def stream(
        self, amt: int | None = ..., decode_content: bool | None = ...
    ) -> Iterator[bytes]: ...

    def read(self) -> bytes: ...

    def close(self) -> None: ...

    def release_conn(self) -> None: ...


# Calls the collection's list endpoint with the given query keywords (label_selector,
# field_selector, watch, resource_version, allow_watch_bookmarks, timeout_seconds,
# _request_timeout) and `_preload_content=False`.
ListCall = Callable[..., Response]


@dataclass(frozen=True, slots=True)
class WatchSettings:
    watch_timeout_s: int = 300  # server-side timeoutSeconds, drawn from [t, 2t]
    request_timeout_s: float = 30.0  # connect timeout, and read timeout of a list
    read_slack_s: float = 30.0  # a silent watch is given up timeout + slack after it began
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    crd_recheck_s: float = 60.0  # an absent CRD: ask API discovery again this often


@dataclass(frozen=True, slots=True)
class Snapshot:
    objects: Mapping[str, Obj]  # name -> object
    label_selector: str | None  # the selector the objects were listed with
    present: bool = True  # False: the CRD is not installed


class _Gone(Exception):
    """410: the resource version is too old; relist."""


class _Absent(Exception):
    """404 on an optional resource: its CRD is not installed (any more)."""


class _Forbidden(Exception):
    """403 on an optional resource: installed, but our Role does not grant it (an
    upstream chart's RBAC lists fewer resources than we read). Treated as absent, so that
    the resources that did sync still make the model table."""


class WatchError(Exception):
    """An ERROR event other than 410."""


def _lines(resp: Response) -> Iterator[bytes]:
    """The stream's non-blank lines, wherever the network cut it. Linear in the stream:
    a line's pieces are joined once, when its newline comes (appending each piece to one
    buffer and splitting it again copied a long line once per piece: 3.7 s for a 3 MiB
    object arriving in 1 KiB pieces)."""
    pending: list[bytes] = []
    for chunk in resp.stream(None, decode_content=False):
        if b"\n" not in chunk:
            pending.append(chunk)
            continue
        first, *lines = chunk.split(b"\n")
        pending.append(first)
        lines[:0] = [b"".join(pending)]
        pending = [lines.pop()]
        for line in lines:
            if line.strip():
                yield line
    rest = b"".join(pending)
    if rest.strip():
        yield rest


def _abort(resp: object) -> None:
    """Wake a thread blocked reading `resp`: closing a socket does not, shutting it down does."""
    conn = getattr(resp, "connection", None)
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _resource_version(obj: Obj) -> str | None:
    metadata = obj.get("metadata")
    if isinstance(metadata, Mapping):
        rv = metadata.get("resourceVersion")
        if isinstance(rv, str) and rv:
            return rv
    return None


def _name(obj: Obj) -> str | None:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) and name else None


class Reflector:
    def __init__(
        self,
        resource: WatchedResource,
        call: ListCall,
        publish: Callable[[Snapshot], None],
        *,
        settings: WatchSettings,
        field_selector: str | None = None,
        needs_label_selector: bool = False,
        present: Callable[[], bool] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.resource = resource
        self.stats = ResourceStats(resource.key)
        self._call = call
        self._publish = publish
        self._settings = settings
        self._field_selector = field_selector
        self._needs_label_selector = needs_label_selector
        self._present = present
        self._rng = rng or random.Random()
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s, rng=self._rng)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._label_selector: str | None = None
        self._generation = 0  # bumped by every selector change
        self._resp: Response | None = None
        self._objects: dict[str, Obj] = {}
        self._absent_logged = False
        self._watched = False  # a watch was opened since the last list
        self._thread = threading.Thread(
            target=self._run, name=f"epp-discovery-{resource.key}", daemon=True
        )

    # --- control, from any thread -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            resp = self._resp
        self._wake.set()
        if resp is not None:
            _abort(resp)

    def join(self, timeout_s: float) -> bool:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def set_label_selector(self, selector: str | None) -> None:
        """Watch the pods of a new selector (None: none); aborts the open watch."""
        with self._lock:
            if selector == self._label_selector:
                return
            self._label_selector = selector
            self._generation += 1
            resp = self._resp
        self._wake.set()
        if resp is not None:
            _abort(resp)

    # --- the thread ---------------------------------------------------------------------

    def _stale(self, generation: int) -> bool:
        with self._lock:
            return self._stopping or generation != self._generation

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _emit(self, selector: str | None, present: bool = True) -> None:
        self.stats.objects = len(self._objects)
        self._publish(Snapshot(dict(self._objects), selector, present))

    def _run(self) -> None:
        listed: int | None = None  # the generation self.stats.resource_version belongs to
        while True:
            with self._lock:
                if self._stopping:
                    return
                generation, selector = self._generation, self._label_selector
            if generation != listed:
                self.stats.resource_version = None
            if self._needs_label_selector and selector is None:
                if self._objects:
                    self._objects = {}
                    self._emit(None)
                self._sleep(3600.0)  # until a selector is set (or stop)
                continue
            try:
                if self.stats.resource_version is None:
                    if self._present is not None and not self._check_present():
                        self._sleep(self._settings.crd_recheck_s)
                        continue
                    self._list(selector, generation)
                    listed = generation
                    self._backoff.reset()
                self._watch(selector, generation)
            except _Gone:
                self.stats.gone += 1
                self.stats.resource_version = None
                log.info("discovery_relist", resource=self.resource.key, reason="410 Gone")
            except _Absent:
                self.stats.resource_version = None
                self._mark_absent()
                self._sleep(self._settings.crd_recheck_s)
            except _Forbidden:
                self.stats.resource_version = None
                self._mark_absent(forbidden=True)
                self._sleep(self._settings.crd_recheck_s)
            except Exception as exc:
                if self._stale(generation):
                    continue  # aborted on purpose: stop, or a new selector
                self.stats.errors += 1
                self.stats.last_sync_ok = False
                self.stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
                delay = self._backoff.next()
                log.warning(
                    "discovery_error",
                    resource=self.resource.key,
                    error=self.stats.last_error,
                    retry_in_s=round(delay, 3),
                    then="watch" if self.stats.resource_version is not None else "list",
                )
                self._sleep(delay)

    def _check_present(self) -> bool:
        assert self._present is not None
        present = self._present()
        if present:
            if self.stats.present is False:
                log.info("discovery_crd_found", resource=self.resource.key)
            self.stats.present = True
            self._absent_logged = False
            return True
        self._mark_absent()
        return False

    def _mark_absent(self, *, forbidden: bool = False) -> None:
        self.stats.present = False
        self.stats.last_sync_ok = True  # absent is a valid answer, not a failure
        if not self._absent_logged:
            self._absent_logged = True
            r = self.resource
            if forbidden:
                log.warning(
                    "discovery_crd_forbidden",
                    resource=r.key,
                    api=f"{r.group}/{r.version}",
                    detail=f"403: the EPP's Role lacks get/list/watch on {r.resource}"
                    f" in {r.group or 'core'}; read as not installed until it is granted",
                )
            else:
                log.info(
                    "discovery_crd_absent",
                    resource=r.key,
                    api=f"{r.group}/{r.version}",
                    detail="not installed; the feature is off until it is",
                )
        if self._objects or not self.stats.synced:
            self._objects = {}
            self.stats.synced = True
            self._emit(None, present=False)

    def _query(self, selector: str | None) -> dict[str, Any]:
        query: dict[str, Any] = {"_preload_content": False}
        if selector is not None:
            query["label_selector"] = selector
        if self._field_selector is not None:
            query["field_selector"] = self._field_selector
        return query

    def _open(self, generation: int, **query: Any) -> Response:
        try:
            resp = self._call(**query)
        except ApiException as exc:
            if exc.status == 410:
                raise _Gone() from exc
            if exc.status == 404 and self.resource.optional:
                raise _Absent() from exc
            if exc.status == 403 and self.resource.optional:
                raise _Forbidden() from exc
            raise
        with self._lock:
            self._resp = resp
            stale = self._stopping or generation != self._generation
        if stale:
            _abort(resp)
        return resp

    def _release(self, resp: Response, reuse: bool) -> None:
        with self._lock:
            self._resp = None
        if reuse:
            resp.release_conn()
        else:
            resp.close()

    def _list(self, selector: str | None, generation: int) -> None:
        timeout = self._settings.request_timeout_s
        resp = self._open(generation, **self._query(selector), _request_timeout=(timeout, timeout))
        try:
            body = resp.read()
        finally:
            self._release(resp, reuse=True)
        doc = json.loads(body)
        rv = _resource_version(doc) if isinstance(doc, Mapping) else None
        items = doc.get("items") if isinstance(doc, Mapping) else None
        if rv is None or not isinstance(items, list):
            raise ValueError(f"list of {self.resource.key}: no resourceVersion or items")
        self._objects = {
            name: item for item in items if isinstance(item, Mapping) and (name := _name(item))
        }
        if self.stats.lists:
            self.stats.relists += 1
        self.stats.lists += 1
        self._watched = False
        self.stats.synced = True
        self.stats.present = True
        self.stats.last_sync_ok = True
        self.stats.resource_version = rv
        self._emit(selector)

    def _watch(self, selector: str | None, generation: int) -> None:
        s = self._settings
        timeout = int(self._rng.uniform(s.watch_timeout_s, 2 * s.watch_timeout_s))
        if self._watched:
            self.stats.watch_restarts += 1  # the last watch ended (timeout, drop, error)
        self._watched = True
        resp = self._open(
            generation,
            **self._query(selector),
            watch=True,
            resource_version=self.stats.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=(s.request_timeout_s, timeout + s.read_slack_s),
        )
        self.stats.last_sync_ok = True
        heard = False
        try:
            for line in _lines(resp):
                if self._stale(generation):
                    return
                if not heard:
                    heard = True
                    self._backoff.reset()  # the connection works: a later drop starts afresh
                self._apply(json.loads(line), selector)
        finally:
            self._release(resp, reuse=False)
        if not heard and not self._stale(generation):
            # Ended without a single event or bookmark: a real server's watch lasts minutes
            # and bookmarks about every minute; one that ends at once (a proxy closing it)
            # must not turn into a busy loop.
            self._sleep(self._backoff.next())

    def _apply(self, event: Any, selector: str | None) -> None:
        if not isinstance(event, Mapping):
            raise WatchError(f"watch of {self.resource.key}: not an event: {event!r}"[:300])
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, Mapping):
            raise WatchError(f"watch of {self.resource.key}: {kind} without an object")
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise WatchError(f"{obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        rv = _resource_version(obj)
        if kind == "BOOKMARK":
            self.stats.resource_version = rv or self.stats.resource_version
            return
        name = _name(obj)
        if name is None:
            raise WatchError(f"watch of {self.resource.key}: {kind} of an unnamed object")
        self.stats.events += 1
        if kind in ("ADDED", "MODIFIED"):
            self._objects[name] = obj
        elif kind == "DELETED":
            self._objects.pop(name, None)
        else:
            raise WatchError(f"watch of {self.resource.key}: unknown event type {kind!r}")
        self.stats.resource_version = rv or self.stats.resource_version
        self._emit(selector)
