"""What a request body costs in memory inside the EPP: held once while it waits (what the
admission byte cap counts is what is held), and refused as soon as it is known to pass
`server.max_body_bytes`, never buffered past it.

Driven through the servicer (no network) with the FakeRouter of extproc.fakes, whose gate
stands in for an admission queue. Bytes held are measured with tracemalloc (Python
objects). The protobuf message's own copy lives outside tracemalloc (upb arenas): that the
servicer lets it go while routing waits is checked with gc.get_referrers."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import weakref

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc.fakes import BUFFERED, DUPLEX, FakeRouter, body_msg, headers_msg
from extproc.test_server import Context, Envoy, settle, until

from epp.config import ServerConfig
from epp.extproc.machine import ExtProcStream, Phase
from epp.extproc.server import ExternalProcessor, HealthState, _read_each, build_grpc_server
from epp.observability.metrics import EppMetrics

MIB = 1024 * 1024


def _body(size: int) -> bytes:
    prefix = b'{"model": "m", "prompt": "'
    return prefix + b"x" * (size - len(prefix) - 2) + b'"}'


def _processor(router: FakeRouter, max_body: int) -> ExternalProcessor:
    return ExternalProcessor(router, ServerConfig(max_body_bytes=max_body), EppMetrics())


async def _drive(processor: ExternalProcessor, messages: list) -> tuple[list, asyncio.Task]:
    replies: list = []
    envoy = Envoy(messages)

    async def run() -> None:
        async for reply in processor.Process(envoy, Context()):
            replies.append(reply)

    return replies, asyncio.ensure_future(run())


def test_a_waiting_buffered_body_is_held_once():
    """8 MiB waiting in admission: the Python objects held are one copy of the body (the
    bytes the router reads and admission counts), not the accumulation buffer plus a copy
    of it."""
    body = _body(8 * MIB)

    async def scenario() -> None:
        router = FakeRouter(gate=asyncio.Event())
        processor = _processor(router, 32 * MIB)
        messages = [headers_msg(mode=BUFFERED), body_msg(body, True)]
        tracemalloc.start()
        try:
            replies, task = await _drive(processor, messages)
            await until(lambda: router.calls)
            await settle()
            gc.collect()
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(router.calls[0]["body"]) == len(body)
        assert held < 1.25 * len(body), f"{held / MIB:.1f} MiB held for an 8 MiB body"
        router.gate.set()
        await until(lambda: task.done() or len(replies) >= 2)
        task.cancel()

    asyncio.run(scenario())


def test_a_waiting_duplex_body_is_held_once_and_re_emitted_from_that_copy():
    body = _body(4 * MIB)
    step_size = 64 * 1024
    s = ExtProcStream(max_body_bytes=32 * MIB, chunk_bytes=62 * 1024)
    s.feed(headers_msg(mode=DUPLEX))
    chunks = [body[i : i + step_size] for i in range(0, len(body), step_size)]
    for n, chunk in enumerate(chunks):
        step = s.feed(body_msg(chunk, n == len(chunks) - 1))
    del chunks
    assert s.phase is Phase.ROUTING and step.route is not None
    tracemalloc.start()
    try:
        call_body = step.route.body
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert call_body == body
    # Nothing allocated since the body was complete, and the machine's copy is the call's.
    assert held < 64 * 1024
    assert s._body is call_body


def test_a_buffered_message_is_not_kept_while_routing_waits():
    """The servicer hands the body message to the machine and lets it go: while routing
    waits no frame of the servicer refers to it (its arena holds a second copy)."""

    async def scenario() -> None:
        router = FakeRouter(gate=asyncio.Event())
        processor = _processor(router, 32 * MIB)
        message = body_msg(_body(MIB), True)
        replies, task = await _drive(processor, [headers_msg(mode=BUFFERED), message])
        await until(lambda: router.calls)
        await settle()
        holders = [name for h in gc.get_referrers(message) if (name := _servicer_code(h))]
        assert holders == [], f"the servicer's {holders} still hold the body message"
        router.gate.set()
        await until(lambda: task.done() or len(replies) >= 2)
        task.cancel()

    asyncio.run(scenario())


def _servicer_code(holder: object) -> str | None:
    """The name of the servicer's frame, coroutine or generator `holder` is, else None."""
    for attribute in ("f_code", "cr_code", "ag_code", "gi_code"):
        code = getattr(holder, attribute, None)
        if code is not None and code.co_filename.endswith("extproc/server.py"):
            return code.co_name
    return None


def test_a_declared_length_over_the_limit_is_refused_before_the_body():
    """Content-Length over the limit: 413 at the headers. In BUFFERED mode Envoy waits for
    that reply, so not one body byte reaches the EPP."""
    s = ExtProcStream(max_body_bytes=4 * MIB, chunk_bytes=62 * 1024, assumed_duplex=False)
    step = s.feed(headers_msg(mode=BUFFERED, extra=[("content-length", str(40 * MIB))]))
    assert step.finish and step.route is None
    reply = step.replies[0].immediate_response
    assert reply.status.code == 413
    assert step.answer is not None and step.answer.reason == "rejected-body-too-large"
    # At the limit exactly, the body is accepted.
    s = ExtProcStream(max_body_bytes=4 * MIB, chunk_bytes=62 * 1024)
    step = s.feed(headers_msg(mode=DUPLEX, extra=[("content-length", str(4 * MIB))]))
    assert not step.finish and s.phase is Phase.BODY


def test_an_undeclared_body_is_refused_at_the_chunk_that_passes_the_limit():
    """Chunked (no Content-Length): the chunk that takes the count past the limit gets the
    413 and what was held is dropped; nothing is kept beyond the limit."""
    limit = 4 * MIB
    s = ExtProcStream(max_body_bytes=limit, chunk_bytes=62 * 1024)
    s.feed(headers_msg(mode=DUPLEX))
    chunk = b"x" * (MIB - 1)
    fed = 0
    while True:
        step = s.feed(body_msg(chunk, False))
        fed += len(chunk)
        if step.finish:
            break
        assert fed <= limit
    assert fed == 5 * (MIB - 1)  # the fifth chunk passes 4 MiB
    assert step.replies[0].immediate_response.status.code == 413
    assert s._chunks == [] and s.phase is Phase.DONE


def test_a_declared_length_over_the_limit_through_the_servicer():
    async def scenario() -> None:
        router = FakeRouter()
        processor = _processor(router, 4 * MIB)
        headers = headers_msg(mode=BUFFERED, extra=[("content-length", str(40 * MIB))])
        replies, task = await _drive(processor, [headers])
        await until(lambda: task.done())
        assert [r.immediate_response.status.code for r in replies] == [413]
        assert router.calls == []

    asyncio.run(scenario())


def test_messages_read_from_grpc_are_not_kept_by_the_reader():
    """grpc's own request iterator keeps the last message while it waits for the next;
    `_read_each` (context.read()) keeps none: a BUFFERED body is not held twice."""

    class Message:
        pass

    class ReadingContext:
        def __init__(self) -> None:
            self.sent = [Message(), Message()]

        async def read(self):
            return self.sent.pop(0) if self.sent else grpc.aio.EOF

    async def scenario() -> None:
        context = ReadingContext()
        reader = _read_each(context)
        first = await anext(reader)
        alive = weakref.ref(first)
        del first
        gc.collect()
        assert alive() is None, "the reader still holds the message it handed on"
        assert isinstance(await anext(reader), Message)
        assert await anext(reader, None) is None

    asyncio.run(scenario())


def test_one_body_message_over_the_limit_is_refused_by_grpc_itself():
    """A BUFFERED body without Content-Length is one message: the real server's receive
    limit is the body limit plus framing, so gRPC refuses it instead of buffering it all
    (tools/body_rss.py: 127 MB peak before, 6 MB after, for 40 MiB over a 32 MiB limit).
    A body at the limit still passes."""

    async def scenario() -> None:
        router = FakeRouter()
        config = ServerConfig(
            grpc_host="127.0.0.1", grpc_port=0, secure_serving=False, max_body_bytes=MIB
        )
        server, port = build_grpc_server(
            ExternalProcessor(router, config, EppMetrics()), HealthState(), config
        )
        await server.start()
        options = [("grpc.max_send_message_length", 64 * MIB)]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                stub = pb_grpc.ExternalProcessorStub(channel)
                for size, refused in ((MIB, False), (4 * MIB, True)):
                    call = stub.Process()
                    await call.write(headers_msg(mode=BUFFERED))
                    assert (await call.read()).HasField("request_headers")
                    await call.write(body_msg(_body(size), True))
                    if refused:
                        with pytest.raises(grpc.aio.AioRpcError) as error:
                            await call.read()
                        assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                    else:
                        assert (await call.read()).HasField("request_body")
                    call.cancel()
        finally:
            await server.stop(None)
        assert [len(c["body"]) for c in router.calls] == [MIB]

    asyncio.run(scenario())
