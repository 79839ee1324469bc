"""A minimal HTTP/2 client over cleartext (prior knowledge), for one request that ends in
trailers: what HTTP/2 clients can send and HTTP/1.1 clients through Envoy cannot (Envoy's
HTTP/1 codec drops request trailers unless `enable_trailers` is set). No HTTP/2 package is
a dependency here, so the few frames are built by hand (RFC 9113, HPACK RFC 7541 literals
without indexing, no Huffman).

Only the response's `:status` is decoded (Envoy sends it first, as a static-table index or
a literal with the indexed name `:status`); the response body is returned as bytes.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
MAX_FRAME = 16384
# HPACK static table entries 8..14 are ':status' with these values.
_STATIC_STATUS = {8: 200, 9: 204, 10: 206, 11: 304, 12: 400, 13: 404, 14: 500}


@dataclass
class H2Response:
    status: int | None  # None: no response headers before the timeout
    body: bytes
    reset: bool  # RST_STREAM or GOAWAY instead of a complete response
    elapsed_s: float


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, new name, raw strings."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _integer(len(n), 7) + n + _integer(len(v), 7) + v


def _block(headers: list[tuple[str, str]]) -> bytes:
    return b"".join(_literal(k, v) for k, v in headers)


def _status(block: bytes) -> int | None:
    first = block[0]
    if first & 0x80:  # indexed field
        return _STATIC_STATUS.get(first & 0x7F)
    index = first & (0x3F if first & 0x40 else 0x0F)
    if index != 8 or block[1] & 0x80:  # not ':status', or a Huffman string
        return None
    length = block[1] & 0x7F
    return int(block[2 : 2 + length])


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("connection closed")
        out += chunk
    return out


def post_with_trailers(
    host: str,
    port: int,
    path: str,
    body: bytes,
    headers: list[tuple[str, str]],
    trailers: list[tuple[str, str]],
    timeout_s: float,
) -> H2Response:
    """POST `body` on stream 1, then `trailers` (ending the stream); read the response."""
    started = time.monotonic()
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        request = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"{host}:{port}"),
            *headers,
        ]
        out = PREFACE + _frame(SETTINGS, 0, 0)
        out += _frame(HEADERS, END_HEADERS, 1, _block(request))
        for i in range(0, len(body), MAX_FRAME):
            out += _frame(DATA, 0, 1, body[i : i + MAX_FRAME])
        out += _frame(HEADERS, END_HEADERS | END_STREAM, 1, _block(trailers))
        sock.sendall(out)
        status: int | None = None
        received = b""
        deadline = started + timeout_s
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                head = _read_exact(sock, 9)
            except (TimeoutError, ConnectionError):
                return H2Response(status, received, False, time.monotonic() - started)
            length = int.from_bytes(head[:3], "big")
            kind, flags = head[3], head[4]
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            payload = _read_exact(sock, length)
            if kind == SETTINGS and not flags & ACK:
                sock.sendall(_frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                sock.sendall(_frame(PING, ACK, 0, payload))
            elif kind in (RST_STREAM, GOAWAY) and stream in (0, 1):
                return H2Response(status, received, True, time.monotonic() - started)
            elif kind == HEADERS and stream == 1:
                if status is None:
                    status = _status(payload)
                if flags & END_STREAM:
                    return H2Response(status, received, False, time.monotonic() - started)
            elif kind == DATA and stream == 1:
                received += payload
                if flags & END_STREAM:
                    return H2Response(status, received, False, time.monotonic() - started)
    finally:
        sock.close()
