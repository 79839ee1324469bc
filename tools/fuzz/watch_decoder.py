"""atheris harness: the Kubernetes watch decoder (epp.datalayer.discovery.reflector). The
input is a watch answer and where the network cuts it. Contract: the view the reflector
keeps does not depend on the cuts; a line can end the watch only with an error its loop
handles; an object is stored only under its own name."""

from __future__ import annotations

import random
import sys

import atheris
from harness import run

with atheris.instrument_imports():
    from epp.datalayer.discovery.reflector import Reflector, WatchError, WatchSettings, _Gone
    from epp.datalayer.kubernetes_resources import POD

HANDLED = (ValueError, WatchError, _Gone, RecursionError)


class StandInResponse:
    """The API server's stand-in: a response streaming the given chunks."""

    def __init__(self, chunks):
        self.chunks = chunks

    def stream(self, amt=None, decode_content=None):
        yield from self.chunks

    def close(self):
        pass

    def release_conn(self):
        pass


def watch(chunks):
    reflector = Reflector(
        POD,
        lambda **query: StandInResponse(chunks),
        lambda snapshot: None,
        settings=WatchSettings(backoff_initial_s=0.0, backoff_max_s=0.0),
        rng=random.Random(0),
    )
    reflector.stats.resource_version = "1"
    error = None
    try:
        reflector._watch(None, reflector._generation)
    except HANDLED as exc:
        error = type(exc).__name__
    for name, obj in reflector._objects.items():
        if obj["metadata"]["name"] != name:
            raise AssertionError(f"{name!r} stored under another name")
    return dict(reflector._objects), reflector.stats.resource_version, error


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    cuts = sorted(fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 8)))
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    if watch(pieces) != watch([stream]):
        raise AssertionError("the cuts changed the view")


def seeds() -> list[bytes]:
    lines = (
        b'{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"2"}}}\n'
        b'{"type":"MODIFIED","object":{"metadata":{"name":"a","resourceVersion":"3"},"spec":{}}}\r\n'
        b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"4"}}}\n'
        b'{"type":"DELETED","object":{"metadata":{"name":"a","resourceVersion":"5"}}}\n'
        b'{"type":"ERROR","object":{"code":410}}'
    )
    return [b"\x02\x10\x00\x20\x00" + lines]


if __name__ == "__main__":
    sys.exit(run("watch_decoder", test_one_input, seeds()))
