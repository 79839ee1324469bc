"""The EPP side of `epp bench overhead`, run as a child process against one checkout.

`epp bench overhead` runs this file by path with PYTHONPATH naming either a frozen
checkout's `src/` (the "before" column) or the work tree's (the "after"), so one harness
measures both codes side by side; it imports only the `epp` package and the standard
library, and bridges the few calls whose signature changed between the two.

    python overhead_probe.py steps --pods 64 --prompt-tokens 4096 --iterations 2000
        each step of the hot path alone, and the whole decision: one JSON line
    python overhead_probe.py serve --pods 64 [--profile FILE] [--bare]
        the real ext_proc gRPC server (grpc.aio, plaintext) over a wired Router (or the
        bare gRPC floor); prints {"port": N} and serves until stdin closes
    python overhead_probe.py drive --port N --requests 1500
        (the work tree only) sends what Envoy sends for that many routed requests
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BLOCK_SIZE = 16


def _words(rng: random.Random, tokens: int) -> str:
    vocabulary = [f"w{n:03d}" for n in range(1000)]
    return " ".join(rng.choice(vocabulary) for _ in range(tokens * 4 // 5))


def chat_body(prompt_tokens: int) -> bytes:
    system = _words(random.Random(0), prompt_tokens)
    return json.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q?"}],
        }
    ).encode()


@functools.cache
def _takes_incoming_request(router_type: type) -> bool:
    """`Router.route_now` takes an IncomingRequest since the request-arguments change,
    keyword arguments before it (asked once per class: inspect.signature costs ~20 us,
    which the whole-decision step would otherwise be charged on every call)."""
    import inspect

    return "request" in inspect.signature(router_type.route_now).parameters


def _route_call(router: Any, path: str, body: bytes, request_id: str) -> Any:
    if not _takes_incoming_request(type(router)):
        return router.route_now(path=path, body=body, request_id=request_id)
    from epp.request import IncomingRequest

    return router.route_now(IncomingRequest(path=path, body=body, request_id=request_id))


class Setup:
    """A Router wired as `epp serve` wires it, over `pods` scraped pods whose prefix index
    holds `prefixes_per_pod` other prompts each, and this prompt on pod-7."""

    def __init__(self, pods: int, prompt_tokens: int, prefixes_per_pod: int = 20) -> None:
        from epp.app import connect
        from epp.config import EppConfig
        from epp.datalayer.metrics_parser import PodMetrics
        from epp.datalayer.store import EndpointStore
        from epp.observability.metrics import EppMetrics
        from epp.prefix.hashing import block_hashes, chain_seed
        from epp.prefix.index import PrefixIndex
        from epp.request import parse_request
        from epp.routing import Router
        from epp.scheduling.scheduler import Scheduler
        from epp.tokenization.estimate import ByteEstimateTokenizer

        rng = random.Random(0)
        self.config = config = EppConfig.model_validate(
            {
                "endpoints": [
                    {"name": f"pod-{i}", "address": f"10.0.{i // 250}.{i % 250 + 1}:8000"}
                    for i in range(pods)
                ],
                "server": {"secure_serving": False, "grpc_host": "127.0.0.1", "grpc_port": 0},
            }
        )
        self.store = store = EndpointStore(config.datalayer, clock=lambda: 0.0)
        store.sync(config.endpoints)
        for endpoint in store.all():
            waiting = rng.randrange(5)
            store.scraped(
                endpoint, PodMetrics(model="m", kv_usage=rng.random() * 0.8, waiting=waiting)
            )
        self.index = index = PrefixIndex(config.prefix.capacity_per_pod)
        self.tokenizer = tokenizer = ByteEstimateTokenizer()
        self.metrics = EppMetrics()
        self.router = Router(
            config, store, index, Scheduler(config.scheduling), tokenizer, self.metrics
        )
        connect(store, index, self.router, config)
        self.body = chat_body(prompt_tokens)
        self.seed = seed = chain_seed("m")
        for endpoint in store.all():
            for _ in range(prefixes_per_pod):
                other = tokenizer.encode(_words(rng, prompt_tokens // 4))
                index.record(endpoint.name, block_hashes(other, config.prefix.block_size, seed))
        request = parse_request("/v1/chat/completions", self.body, {})
        assert request.prompt.messages is not None
        self.messages = request.prompt.messages
        self.tokens = tokenizer.encode_chat(self.messages)
        self.hashes = block_hashes(self.tokens, config.prefix.block_size, seed)
        self.hot = f"pod-{min(7, pods - 1)}"  # the pod that holds this prompt
        index.record(self.hot, self.hashes)

    def steps(self) -> list[tuple[str, Callable[[], object]]]:
        from epp.prefix.hashing import block_hashes
        from epp.request import parse_request
        from epp.scheduling.types import SchedulingRequest

        router, index, tokenizer, body = self.router, self.index, self.tokenizer, self.body
        hashes, tokens, seed, messages = self.hashes, self.tokens, self.seed, self.messages
        endpoints = self.store.all()
        scheduling_request = SchedulingRequest(
            request_id="bench",
            model="m",
            base_model="m",
            block_hashes=hashes,
            prefix_match=index.match(hashes),
        )
        scheduler = router.scheduler

        def route() -> None:
            routed = _route_call(router, "/v1/chat/completions", body, "bench")
            router.complete(routed.token, 200)

        return [
            *self.edge_steps(),
            ("parse JSON body", lambda: parse_request("/v1/chat/completions", body, {})),
            ("tokenize (byte estimate)", lambda: tokenizer.encode_chat(messages)),
            ("hash blocks (xxh64)", lambda: block_hashes(tokens, BLOCK_SIZE, seed)),
            ("prefix index lookup", lambda: index.match(hashes)),
            ("filter + score + pick", lambda: scheduler.schedule(scheduling_request, endpoints)),
            ("record blocks (approximate)", lambda: index.record(self.hot, hashes)),
            ("whole decision (Router.route)", route),
        ]

    def edge_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """What the ext_proc server does around the decision, without gRPC: the messages
        of one request parsed from and replies serialized to bytes (grpc's (de)serializers
        are these calls), the routing stream's machine, the observer stream, the
        completion, and the decision's metrics and INFO line."""
        from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
        from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
            ProcessingMode,
        )
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
        from google.protobuf.struct_pb2 import Struct

        from epp.extproc.machine import ExtProcStream
        from epp.extproc.observer import ObserverStream

        body = self.body
        headers = envoy_headers(len(body), "bench")
        first = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=HeaderMap(
                    headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
                )
            )
        )
        first.protocol_config.request_body_mode = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
        first.protocol_config.response_body_mode = ProcessingMode.BodySendMode.NONE
        second = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        wire = [first.SerializeToString(), second.SerializeToString()]
        token = "0123456789abcdef"
        seen = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=HeaderMap(
                    headers=[
                        HeaderValue(key=k, raw_value=v.encode())
                        for k, v in [*headers, ("x-epp-route-token", token)]
                    ]
                )
            ),
            observability_mode=True,
        )
        answered = pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=HeaderMap(
                    headers=[
                        HeaderValue(key=":status", raw_value=b"200"),
                        HeaderValue(key="content-length", raw_value=b"512"),
                    ]
                )
            ),
            observability_mode=True,
        )
        attributes = Struct()
        attributes.update({"upstream.address": "10.0.0.8:8000"})
        answered.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
        observer_wire = [seen.SerializeToString(), answered.SerializeToString()]
        pods = self.store.all()
        routed = _Routed(token, "bench", _Decision([pods[-1], pods[0]]))  # a fallback too
        server = self.config.server
        parse = pb.ProcessingRequest.FromString

        def machine() -> list[Any]:
            stream = ExtProcStream(
                max_body_bytes=server.max_body_bytes, chunk_bytes=server.stream_chunk_bytes
            )
            stream.feed(first)
            stream.feed(second)
            return stream.routed(routed).replies

        replies = machine()

        def observe() -> object:
            observer = ObserverStream()
            observer.feed(seen)
            observer.feed(answered)
            return observer.end()

        return [
            ("protobuf: parse 2 + 2 messages", lambda: [parse(m) for m in wire + observer_wire]),
            ("protobuf: serialize the replies", lambda: [r.SerializeToString() for r in replies]),
            ("ext_proc machine (2 messages, replies)", machine),
            ("observer stream (2 messages)", observe),
        ]


@dataclass(frozen=True, slots=True)
class _Pod:
    address: str


@dataclass(frozen=True, slots=True)
class _Decision:
    endpoints: list[Any]


@dataclass(frozen=True, slots=True)
class _Routed:
    token: str
    request_id: str
    decision: _Decision
    body: bytes | None = None


def envoy_headers(length: int, request_id: str) -> list[tuple[str, str]]:
    """The request headers Envoy sends the routing filter for a chat request."""
    return [
        (":authority", "gateway.example"),
        (":path", "/v1/chat/completions"),
        (":method", "POST"),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("content-length", str(length)),
        ("user-agent", "bench/1.0"),
        ("accept", "*/*"),
        ("x-forwarded-proto", "http"),
        ("x-request-id", request_id),
    ]


def _logging(level: str) -> None:
    """Routing at INFO writes a line per decision (here to /dev/null): the steps measure
    the picker at WARNING, as `--log-level warning` does; `parts` at INFO prices the line.
    Set before the Router exists: loggers are cached on first use."""
    import os

    from epp.observability.logs import configure_logging

    sink = open(os.devnull, "w") if level == "info" else sys.stderr  # noqa: SIM115
    configure_logging(level, stream=sink)


def time_steps(setup: Setup, iterations: int) -> list[dict[str, float | str]]:
    """Each step's CPU time (this thread's), not its wall time: on a shared, busy machine
    a step that is preempted waits, and wall time would charge the wait to the longest
    steps most."""
    clock = time.thread_time_ns
    out: list[dict[str, float | str]] = []
    for name, fn in setup.steps():
        for _ in range(min(200, iterations)):
            fn()
        samples = []
        for _ in range(iterations):
            start = clock()
            fn()
            samples.append((clock() - start) / 1000)
        samples.sort()
        out.append(
            {
                "step": name,
                "p50_us": samples[len(samples) // 2],
                "p99_us": samples[min(len(samples) - 1, len(samples) * 99 // 100)],
                "mean_us": sum(samples) / len(samples),
            }
        )
    return out


def bare_processor() -> Any:
    """The gRPC floor: the same messages as a routed request (the routing stream reads
    request headers and body and answers each, the observer stream reads until Envoy ends
    it, or the access-log stream takes an entry) with no work between them: replies
    prebuilt, nothing decided."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    headers_reply = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    body_reply = pb.ProcessingResponse(request_body=pb.BodyResponse())

    class Bare(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: Any, context: Any) -> Any:
            observer = any(k == "x-epp-stream" for k, _ in context.invocation_metadata() or ())
            if observer:
                while await context.read() is not grpc.aio.EOF:
                    pass
                return
            first = await context.read()
            if first is grpc.aio.EOF:
                return
            body = await context.read()
            if body is grpc.aio.EOF:
                return
            yield headers_reply
            yield body_reply

        def complete(self, completion: Any) -> None:
            """An access-log entry's end (the server parses it): nothing to settle."""

    return Bare()


class GcTime:
    """The collector's CPU time by generation (gc.callbacks), while serving."""

    def __init__(self) -> None:
        import gc

        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            generation = info["generation"]
            self.seconds[generation] += time.thread_time() - self._start
            self.count[generation] += 1

    def totals(self) -> dict[str, list[float] | list[int]]:
        return {"gc_seconds": self.seconds, "gc_count": self.count}


def time_parts(setup: Setup, iterations: int) -> list[dict[str, float | str]]:
    """Parts of the whole decision timed inside it (thread CPU, mean per decision): the
    decision's metrics and log lines (`Dispatcher._observe`, at the level the process was
    started with) and the completion (`Router.complete`)."""
    router = setup.router
    clock = time.thread_time_ns
    spent = {"observe": 0, "complete": 0}
    dispatcher = router.dispatcher
    observe = dispatcher._observe

    def timed_observe(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return observe(*args, **kwargs)
        finally:
            spent["observe"] += clock() - start

    dispatcher._observe = timed_observe  # type: ignore[method-assign]

    def run(count: int) -> None:
        for _ in range(count):
            routed = _route_call(router, "/v1/chat/completions", setup.body, "bench")
            start = clock()
            router.complete(routed.token, 200)
            spent["complete"] += clock() - start

    try:
        run(min(200, iterations))
        spent.update(observe=0, complete=0)
        run(iterations)
    finally:
        dispatcher._observe = observe  # type: ignore[method-assign]
    rows = [
        ("decision's metrics and log lines (inside it)", spent["observe"] / iterations / 1000),
        ("completion (Router.complete)", spent["complete"] / iterations / 1000),
    ]
    return [{"step": n, "p50_us": v, "p99_us": v, "mean_us": v} for n, v in rows]


async def serve(setup: Setup, profile: str | None, bare: bool = False) -> None:
    from epp.extproc.server import ExternalProcessor, HealthState, build_grpc_server

    processor = (
        bare_processor()
        if bare
        else ExternalProcessor(setup.router, setup.config.server, setup.metrics)
    )
    server, port = build_grpc_server(processor, HealthState(), setup.config.server)
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    loop = asyncio.get_running_loop()
    collector = GcTime() if os.environ.get("EPP_PROBE_GC") else None
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    # stdin closing (the parent's end) stops the server.
    await loop.run_in_executor(None, sys.stdin.read)
    if collector is not None:
        print(json.dumps(collector.totals()), file=sys.stderr, flush=True)
    if profiler is not None and profile:
        profiler.disable()
        profiler.dump_stats(profile)
    await server.stop(None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="overhead_probe.py")
    parser.add_argument("mode", choices=["steps", "parts", "serve", "drive"])
    parser.add_argument("--port", type=int, help="drive: the server's port")
    parser.add_argument("--requests", type=int, default=1500, help="drive: how many")
    parser.add_argument("--log-level", default="warning", choices=["warning", "info"])
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--profile", help="serve: write cProfile stats here at the end")
    parser.add_argument("--bare", action="store_true", help="serve: the gRPC floor alone")
    args = parser.parse_args(argv)
    if args.mode == "drive":
        from epp_bench.picker.overhead import drive_ext_proc

        routed = asyncio.run(
            drive_ext_proc(args.port, args.requests, chat_body(args.prompt_tokens))
        )
        print(json.dumps({"routed": routed}), flush=True)
        return 0
    _logging(args.log_level)
    setup = Setup(args.pods, args.prompt_tokens)
    if args.mode == "steps":
        timings = time_steps(setup, args.iterations) + time_parts(setup, args.iterations)
        print(json.dumps(timings), flush=True)
    elif args.mode == "parts":
        print(json.dumps(time_parts(setup, args.iterations)), flush=True)
    else:
        asyncio.run(serve(setup, args.profile, args.bare))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main(sys.argv[1:]))
