"""atheris harness: the ext_proc stream machine (epp.extproc.machine). Contract: a message
sequence raises nothing but ProtocolViolation, never answers twice (one decision or one
immediate response), never forwards more body bytes than it received, and never hands
the router a body over the limit."""

from __future__ import annotations

import sys

import atheris
from harness import run  # puts tests/ on the path first: extproc.fakes builds messages

with atheris.instrument_imports():
    from epp.extproc.machine import ExtProcStream, ProtocolViolation
    from epp.extproc.messages import DESTINATION_HEADER
    from epp.request import RequestRejected

from extproc.fakes import FakeRouted, _Decision, _Endpoint, body_msg, headers_msg, trailers_msg

MODES = [1, 2, 3, 4, 0, 9, None]  # STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX, NONE, ?


def _answers(reply) -> int:
    if reply.HasField("immediate_response"):
        return 1
    kind = reply.WhichOneof("response")
    if kind in ("request_headers", "request_body"):
        mutation = getattr(reply, kind).response.header_mutation
        return sum(o.header.key == DESTINATION_HEADER for o in mutation.set_headers)
    return 0


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    max_body = fdp.ConsumeIntInRange(0, 512)
    machine = ExtProcStream(
        max_body_bytes=max_body,
        chunk_bytes=fdp.ConsumeIntInRange(1, 64),
        assumed_duplex=fdp.ConsumeBool(),
    )
    answers = received = forwarded = 0
    reject = fdp.ConsumeBool()
    for _ in range(fdp.ConsumeIntInRange(1, 10)):
        kind = fdp.ConsumeIntInRange(0, 2)
        if kind == 0:
            extra = (
                [("content-length", str(fdp.ConsumeIntInRange(0, 1024)))]
                if fdp.ConsumeBool()
                else []
            )
            message = headers_msg(
                mode=MODES[fdp.ConsumeIntInRange(0, len(MODES) - 1)],
                eos=fdp.ConsumeBool(),
                extra=extra,
            )
        elif kind == 1:
            chunk = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300))
            received += len(chunk)
            message = body_msg(chunk, fdp.ConsumeBool())
        else:
            message = trailers_msg()
        try:
            step = machine.feed(message)
        except ProtocolViolation:
            return
        steps = [step]
        if step.route is not None:
            if len(step.route.body) > max_body:
                raise AssertionError("the router got a body over the limit")
            if reject:
                steps.append(machine.rejected(RequestRejected(429, "busy", reason="x")))
            else:
                steps.append(
                    machine.routed(FakeRouted("t", "r", _Decision([_Endpoint("10.0.0.1:80")])))
                )
        finished = False
        for s in steps:
            finished |= s.finish
            for reply in s.replies:
                answers += _answers(reply)
                if reply.HasField("request_body"):
                    forwarded += len(
                        reply.request_body.response.body_mutation.streamed_response.body
                    )
        if answers > 1 or forwarded > received:
            raise AssertionError(f"answers {answers}, forwarded {forwarded} of {received}")
        if finished:
            return


def seeds() -> list[bytes]:
    return [bytes(range(64)), b"\x40\x10\x00\x00\x04\x00\x01\x20" + b"x" * 40 + b"\x01"]


if __name__ == "__main__":
    sys.exit(run("extproc_machine", test_one_input, seeds()))
