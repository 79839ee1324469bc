"""Memory of the EPP's ext_proc server for one large request body, measured in its own
process over real gRPC (docs/reliability.md, "Large bodies").

    .venv/bin/python tools/body_rss.py [--size-mib 40] [--src DIR]

A child process serves the real ExternalProcessor (plaintext, a free port) with a stub
router that holds each request for `--hold-s` (an admission wait) and reports the
child's VmRSS while it holds it; this process plays Envoy: request headers, then the body
(BUFFERED: one message, after the headers reply, as Envoy sends it; FULL_DUPLEX_STREAMED:
62 KiB chunks without waiting). Reported per scenario, in MB (10^6 bytes) above the
child's RSS before the request: its RSS while the body waits, and its peak (VmHWM).
`--src` runs the child on another checkout's `src` (e.g. an older commit exported with
`git archive`), to compare before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import asyncio, json, sys, types
from epp.config import ServerConfig
from epp.extproc.server import ExternalProcessor, HealthState, build_grpc_server
from epp.observability.metrics import EppMetrics

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0

class Router:
    def __init__(self, hold_s):
        self.hold_s = hold_s
    async def route(self, request):
        await asyncio.sleep(self.hold_s)
        print(json.dumps({"waiting_rss": status("VmRSS"), "rss": 0, "body": len(request.body)}), flush=True)
        endpoint = types.SimpleNamespace(address="10.0.0.1:8000")
        return types.SimpleNamespace(token="t", request_id=request.request_id, body=None,
                                     decision=types.SimpleNamespace(endpoints=[endpoint]))
    def complete(self, *args, **kwargs):
        pass

async def main():
    max_body, hold_s = int(sys.argv[1]), float(sys.argv[2])
    config = ServerConfig(grpc_port=0, grpc_host="127.0.0.1", secure_serving=False,
                          max_body_bytes=max_body)
    server, port = build_grpc_server(ExternalProcessor(Router(hold_s), config, EppMetrics()),
                                     HealthState(), config)
    await server.start()
    print(json.dumps({"port": port, "rss": status("VmRSS"), "hwm": status("VmHWM")}), flush=True)
    while (await asyncio.to_thread(sys.stdin.readline)).strip() == "stat":
        print(json.dumps({"rss": status("VmRSS"), "hwm": status("VmHWM")}), flush=True)
    await server.stop(None)

asyncio.run(main())
"""


def _report(stream, key: str) -> dict:
    """The child's next JSON line holding `key` (its log lines are skipped)."""
    while True:
        line = stream.readline()
        if not line:
            raise RuntimeError("the child server exited")
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and key in value:
            return value


def _replies(replies, outbox, body: bytes, mode: str, pb) -> list[int | str]:
    for reply in replies:
        kind = reply.WhichOneof("response")
        if kind == "immediate_response":
            return [reply.immediate_response.status.code]
        if kind == "request_headers" and mode == "BUFFERED":
            # Envoy sends a buffered body once the headers are answered.
            outbox.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))  # fmt: skip
        if kind == "request_body":
            return [200]
    return []


def scenario(
    src: Path, size: int, max_body: int, mode: str, declared: bool, hold_s: float
) -> dict[str, float]:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    env = dict(os.environ, PYTHONPATH=str(src))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(max_body), str(hold_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        start = _report(child.stdout, "port")
        body = b'{"model": "m", "prompt": "' + b"x" * (size - 28) + b'"}'
        headers = [(":path", "/v1/completions"), (":method", "POST"), ("x-request-id", "r1")]
        if declared:
            headers.append(("content-length", str(len(body))))
        header_map = base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
        )
        first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map))
        body_mode = getattr(ProcessingMode.BodySendMode, mode)
        first.protocol_config.request_body_mode = body_mode
        limit = 128 * 1024 * 1024
        channel = grpc.insecure_channel(
            f"127.0.0.1:{start['port']}",
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
            ],
        )
        stub = pb_grpc.ExternalProcessorStub(channel)
        import queue

        outbox: queue.Queue = queue.Queue()
        outbox.put(first)
        if mode == "FULL_DUPLEX_STREAMED":
            step = 62 * 1024
            for i in range(0, len(body), step):
                piece = body[i : i + step]
                outbox.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece, end_of_stream=i + step >= len(body))))  # fmt: skip

        def requests():
            while True:
                item = outbox.get()
                if item is None:
                    return
                yield item

        replies = stub.Process(requests())
        codes: list[int | str] = []
        try:
            codes += _replies(replies, outbox, body, mode, pb)
        except grpc.RpcError as error:  # refused by gRPC itself (a message over its limit)
            codes.append(f"gRPC {error.code().name}")
        outbox.put(None)
        channel.close()
        waiting = None
        child.stdin.write("stat\n")
        child.stdin.flush()
        line = _report(child.stdout, "rss")
        while "waiting_rss" in line:
            waiting = line["waiting_rss"]
            line = _report(child.stdout, "rss")
        return {
            "status": codes[0] if codes else -1,
            "waiting_mb": None if waiting is None else (waiting - start["rss"]) / 1e6,
            "peak_mb": (line["hwm"] - start["rss"]) / 1e6,
        }
    finally:
        if child.stdin:
            child.stdin.write("stop\n")
            child.stdin.close()
        child.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=40.0)
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src")
    parser.add_argument("--hold-s", type=float, default=1.0)
    args = parser.parse_args()
    size = int(args.size_mib * 1024 * 1024)
    mib = 1024 * 1024
    rows = [
        ("accepted, waiting", "BUFFERED", True, 64 * mib),
        ("accepted, waiting", "FULL_DUPLEX_STREAMED", True, 64 * mib),
        ("over limit, Content-Length", "BUFFERED", True, 32 * mib),
        ("over limit, Content-Length", "FULL_DUPLEX_STREAMED", True, 32 * mib),
        ("over limit, chunked", "BUFFERED", False, 32 * mib),
        ("over limit, chunked", "FULL_DUPLEX_STREAMED", False, 32 * mib),
    ]
    print(f"body {args.size_mib:g} MiB, child src {args.src}\n")
    print("| case | body mode | limit MiB | status | RSS while waiting MB | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for label, mode, declared, limit in rows:
        result = scenario(args.src, size, limit, mode, declared, args.hold_s)
        waiting = "-" if result["waiting_mb"] is None else f"{result['waiting_mb']:.0f}"
        print(
            f"| {label} | {mode} | {limit // mib} | {result['status']} | {waiting} "
            f"| {result['peak_mb']:.0f} |"
        )
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
