"""List, then watch, one namespaced collection in a thread; publish every change
(the wire side, `Snapshot` and the settings: `watch_stream.py`).

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

import json
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import structlog
from kubernetes.client.exceptions import ApiException

from epp.datalayer.discovery.state import Backoff, ResourceStats
from epp.datalayer.discovery.watch_stream import (
    ListCall,
    Obj,
    Response,
    Snapshot,
    WatchError,
    WatchSettings,
    _Absent,
    _Forbidden,
    _Gone,
    abort,
    object_name,
    resource_version,
    watch_lines,
)
from epp.datalayer.kubernetes_resources import WatchedResource

log = structlog.get_logger("epp.discovery")

__all__ = [
    "ListCall",
    "Obj",
    "Reflector",
    "Response",
    "Snapshot",
    "WatchError",
    "WatchSettings",
]


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
            abort(resp)

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
            abort(resp)

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
            except (_Absent, _Forbidden) as exc:
                self.stats.resource_version = None
                self._mark_absent(forbidden=isinstance(exc, _Forbidden))
                self._sleep(self._settings.crd_recheck_s)
            except Exception as exc:
                if not self._stale(generation):  # else aborted on purpose: stop, new selector
                    self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """Count, log, and wait out the backoff; then watch again from the last rv (or
        list, when there is none)."""
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
            abort(resp)
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
        rv = resource_version(doc) if isinstance(doc, Mapping) else None
        items = doc.get("items") if isinstance(doc, Mapping) else None
        if rv is None or not isinstance(items, list):
            raise ValueError(f"list of {self.resource.key}: no resourceVersion or items")
        self._objects = {
            name: item
            for item in items
            if isinstance(item, Mapping) and (name := object_name(item))
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
            for line in watch_lines(resp):
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
        rv = resource_version(obj)
        if kind == "BOOKMARK":
            self.stats.resource_version = rv or self.stats.resource_version
            return
        name = object_name(obj)
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
