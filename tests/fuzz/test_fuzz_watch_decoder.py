"""The Kubernetes watch decoder (epp.datalayer.discovery.reflector), fuzzed.

A watch answer is a stream of JSON lines that the network may cut anywhere. Contract: the
reflector's view after a stream does not depend on where the stream was cut (inside a
line, inside a UTF-8 character, between `\\r` and `\\n`); a stream of well-formed events
leaves exactly the objects Kubernetes' semantics give (ADDED/MODIFIED set, DELETED removes,
BOOKMARK moves only the resource version, ERROR 410 means relist); anything else ends the
watch with an error the reflector's loop handles (it then backs off and watches again),
never with an object stored under a wrong name.

The API server is a stand-in here (a response object streaming the chosen chunks): the
decoder, not a server, is what is fuzzed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping

from fuzz.budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datalayer.discovery.reflector import (
    Reflector,
    Snapshot,
    WatchError,
    WatchSettings,
    _Gone,
)
from epp.datalayer.discovery.watch_stream import watch_lines
from epp.datalayer.kubernetes_resources import POD

# What a broken or hostile line may raise out of a watch: the reflector's loop catches
# every Exception, counts it and watches again; these are the ones a line can cause.
HANDLED = (ValueError, WatchError, _Gone, RecursionError)


class StandInResponse:
    """A urllib3 response streaming the given chunks (the API server's stand-in)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def stream(self, amt=None, decode_content=None) -> Iterator[bytes]:
        yield from self.chunks

    def read(self) -> bytes:
        return b"".join(self.chunks)

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def watch(chunks: list[bytes]) -> tuple[dict, str | None, str | None, int]:
    """(objects, resource version, error, snapshots published) after one watch."""
    published: list[Snapshot] = []
    reflector = Reflector(
        POD,
        lambda **query: StandInResponse(chunks),
        published.append,
        settings=WatchSettings(backoff_initial_s=0.0, backoff_max_s=0.0),
        rng=random.Random(0),
    )
    reflector.stats.resource_version = "1"
    error = None
    try:
        reflector._watch(None, reflector._generation)
    except HANDLED as exc:
        error = type(exc).__name__
    objects = reflector._objects
    for name, obj in objects.items():
        assert isinstance(obj, Mapping) and obj["metadata"]["name"] == name
    rv = reflector.stats.resource_version
    assert rv is None or (isinstance(rv, str) and rv)
    return dict(objects), rv, error, len(published)


def cut(stream: bytes, points: list[int]) -> list[bytes]:
    points = sorted({min(p, len(stream)) for p in points})
    return [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]


# -- lines --------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "ü", "x" * 300])
TEXT = st.text(max_size=10)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def events(draw) -> dict:
    kind = draw(st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]))
    metadata = {"name": draw(NAMES), "resourceVersion": str(draw(st.integers(1, 10**6)))}
    return {"type": kind, "object": {"metadata": metadata, "spec": draw(JSON)}}


@st.composite
def bad_lines(draw) -> bytes:
    return draw(
        st.sampled_from(
            [
                b'{"type": "ERROR", "object": {"code": 410, "reason": "Expired"}}',
                b'{"type": "ERROR", "object": {"code": 500}}',
                b'{"type": "ADDED", "object": {"metadata": {}}}',
                b'{"type": "ADDED", "object": []}',
                b'{"type": "RENAMED", "object": {"metadata": {"name": "a"}}}',
                b'{"type": "ADDED", "object": {"metadata": {"name": 5}}}',
                b"[1, 2",
                b"\xff\xfe",
                b"[" * 100_000,
                b"null",
            ]
        )
        | st.binary(min_size=1, max_size=30).filter(lambda b: b"\n" not in b)
        | JSON.map(lambda v: json.dumps(v).encode())
    )


@st.composite
def streams(draw) -> tuple[bytes, list[dict | None]]:
    """A watch answer and its events (None: a line that is not a well-formed event)."""
    items: list[dict | None] = draw(
        st.lists(events() | st.none() if draw(st.booleans()) else events(), max_size=12)
    )
    lines = []
    for item in items:
        line = (
            json.dumps(item, ensure_ascii=draw(st.booleans())).encode()
            if item
            else draw(bad_lines())
        )
        lines.append(line + draw(st.sampled_from([b"\n", b"\r\n", b"\n\n", b"\n  \n"])))
    stream = b"".join(lines)
    if draw(st.booleans()) and stream.endswith(b"\n"):
        stream = stream.rstrip(b"\n")  # the last line without its newline
    return stream, items


@settings(max_examples=examples(200))
@given(stream=streams(), points=st.lists(st.integers(0, 5000), max_size=20))
def test_where_the_stream_is_cut_changes_nothing(stream, points):
    data, _ = stream
    assert watch(cut(data, points)) == watch([data])


@settings(max_examples=examples(200))
@given(stream=streams(), points=st.lists(st.integers(0, 5000), max_size=20))
def test_lines_are_the_streams_lines_wherever_it_is_cut(stream, points):
    data, _ = stream
    expected = [line for line in data.split(b"\n") if line.strip()]
    assert list(watch_lines(StandInResponse(cut(data, points)))) == expected


@settings(max_examples=examples(150))
@given(
    items=st.lists(events(), max_size=15),
    points=st.lists(st.integers(0, 3000), max_size=10),
)
def test_well_formed_events_leave_what_kubernetes_semantics_give(items, points):
    expected: dict[str, dict] = {}
    rv = "1"
    changes = 0
    for event in items:
        obj = event["object"]
        rv = obj["metadata"]["resourceVersion"]
        if event["type"] in ("ADDED", "MODIFIED"):
            expected[obj["metadata"]["name"]] = obj
        elif event["type"] == "DELETED":
            expected.pop(obj["metadata"]["name"], None)
        changes += event["type"] != "BOOKMARK"
    data = b"".join(json.dumps(e).encode() + b"\n" for e in items)
    assert watch(cut(data, points)) == (expected, rv, None, changes)


@settings(max_examples=examples(100))
@given(payload=st.binary(max_size=400), points=st.lists(st.integers(0, 400), max_size=10))
def test_arbitrary_bytes_end_the_watch_with_a_handled_error_at_worst(payload, points):
    watch(cut(payload, points))
