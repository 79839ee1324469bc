"""A lean keep-alive HTTP/1.1 GET for one pod's metrics page (the scraper's client).

aiohttp's per-request work (headers built and parsed into multidicts, a response object,
stream readers, cookie and redirect handling) costs about 250 us of CPU per page against
~60 us for a plain exchange on one connection (docs/benchmarks/scrape.md), four times the
parse of the page. This client does the one thing a scrape needs: a GET on a kept-alive
connection (http or https), the status, and a body bounded by `max_bytes`, with
Content-Length, chunked, or read-until-close framing.

Invariants:
- One request at a time per client (one scrape loop per pod owns it).
- A connection is reused only after a complete response that did not say `close`; any
  error, timeout or cancellation mid-exchange closes it (its state is unknown).
- A kept-alive connection the server closed meanwhile (no byte of the answer came) is
  retried once on a new connection, as a GET may be.
- `Accept-Encoding: identity`: prometheus_client gzips the page for any client that
  accepts gzip (aiohttp does by default), which costs the engine a compression per scrape
  and the EPP a decompression. A server that compresses anyway is decoded (gzip, deflate).
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from epp.datalayer.metrics_parser import MetricsFormatError

# A vLLM page is 50-70 KB; anything far larger is not a metrics page.
MAX_PAGE_BYTES = 8 * 1024 * 1024
# A response head (status line and headers) longer than this is not a metrics server's.
MAX_HEAD_BYTES = 64 * 1024


class ConnectError(OSError):
    """The pod's address could not be reached (refused, unresolvable, TLS handshake)."""


class ServerDisconnectedError(ConnectionError):
    """The pod closed the connection before the whole answer came."""


def too_large(max_bytes: int) -> MetricsFormatError:
    return MetricsFormatError(f"metrics page larger than {max_bytes // (1024 * 1024)} MiB")


@dataclass(frozen=True, slots=True)
class PageUrl:
    """Where a page is: host and port to connect to, the Host header, the request target."""

    https: bool
    host: str
    port: int
    host_header: str
    target: str

    @classmethod
    def parse(cls, url: str) -> PageUrl:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise MetricsFormatError(f"not an http(s) URL: {url!r}")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise MetricsFormatError(f"bad port in {url!r}") from None
        netloc = parts.netloc.rpartition("@")[2]
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(scheme == "https", parts.hostname, port, netloc, target)

    def request(self) -> bytes:
        return (
            f"GET {self.target} HTTP/1.1\r\nHost: {self.host_header}\r\n"
            "User-Agent: epp-scraper\r\nAccept: */*\r\nAccept-Encoding: identity\r\n\r\n"
        ).encode("latin-1")


@dataclass(slots=True)
class Response:
    status: int
    body: bytes
    keep_alive: bool
    location: str = ""  # a redirect's Location header


class _Exchange(asyncio.Protocol):
    """One connection: reads the answer to the request in flight from the bytes that come.

    The head is parsed once it is complete; the body is framed by Content-Length, by
    chunks, or by the end of the connection. A non-200 status ends the exchange at its
    head (the connection is then closed, its body unread)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.lost = False
        self.waiter: asyncio.Future[Response] | None = None
        self.got_bytes = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.head_done = False
        self.keep_alive = True
        self.length: int | None = None  # Content-Length framing
        self.chunked = False
        self.encoding = ""
        self.location = ""
        self.body = bytearray()
        self.chunk_left = -1  # chunked: bytes left of the current chunk (-1: a size line)
        self.trailers = False

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports (`epp serve` runs on uvloop)
        # do not derive from asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            # Bytes nobody asked for: the connection is out of step, never reuse it.
            self.buffer.clear()
            self.close()
            return
        self.got_bytes = True
        self.buffer += data
        try:
            if self._advance():
                self._finish()
        except MetricsFormatError as exc:
            self.waiter.set_exception(exc)
            self.close()

    def eof_received(self) -> bool | None:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.head_done and self.length is None and not self.chunked:
            self.keep_alive = False
            self._finish()  # read-until-close framing: the end is the answer's end
        elif self.got_bytes:
            waiter.set_exception(ServerDisconnectedError("server disconnected mid-answer"))
        else:
            waiter.set_exception(ServerDisconnectedError("server disconnected"))

    # -- the exchange ------------------------------------------------------------------
    def begin(self, request: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._reset()
        self.got_bytes = False
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.lost = True

    def _finish(self) -> None:
        assert self.waiter is not None
        if self.buffer:
            self.keep_alive = False  # bytes past the answer: out of step, never reused
        body = bytes(self.body)
        if self.encoding:
            body = _decoded(body, self.encoding, self.max_bytes)
        self.waiter.set_result(Response(self.status, body, self.keep_alive, self.location))
        if not self.keep_alive:
            self.close()

    def _advance(self) -> bool:
        """Consume what the buffer holds; True once the answer is complete."""
        if not self.head_done:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    raise MetricsFormatError("bad HTTP response: head too long")
                return False
            head = bytes(self.buffer[:end])
            del self.buffer[: end + 4]
            if not self._head(head):
                return self._advance()  # a 1xx answer: the real one follows
            self.head_done = True
            if self.status != 200:
                self.keep_alive = False
                return True
            if self.length is not None and self.length > self.max_bytes:
                raise too_large(self.max_bytes)
        if self.chunked:
            return self._chunks()
        if self.length is None:  # until the connection closes
            self.body += self.buffer
            self.buffer.clear()
            if len(self.body) > self.max_bytes:
                raise too_large(self.max_bytes)
            return False
        if len(self.buffer) < self.length:
            return False
        self.body = self.buffer[: self.length]
        del self.buffer[: self.length]
        return True

    def _head(self, head: bytes) -> bool:
        """Parse a response head; False for an informational (1xx) one."""
        lines = head.split(b"\r\n")
        status_line = lines[0].split(None, 2)
        if (
            len(status_line) < 2
            or not status_line[0].startswith(b"HTTP/1.")
            or not status_line[1].isdigit()
            or len(status_line[1]) != 3
        ):
            raise MetricsFormatError(f"bad HTTP response: {lines[0][:80]!r}")
        self.status = int(status_line[1])
        if 100 <= self.status < 200:
            return False
        connection = b""
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                raise MetricsFormatError(f"bad HTTP header: {line[:80]!r}")
            key = name.strip().lower()
            value = value.strip()
            if key == b"content-length":
                if not value.isdigit():
                    raise MetricsFormatError(f"bad Content-Length: {value[:40]!r}")
                self.length = int(value)
            elif key == b"transfer-encoding":
                self.chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif key == b"connection":
                connection = value.lower()
            elif key == b"content-encoding":
                self.encoding = value.decode("latin-1").strip().lower()
            elif key == b"location":
                self.location = value.decode("latin-1")
        if self.chunked:
            self.length = None
        if status_line[0] == b"HTTP/1.0":
            self.keep_alive = b"keep-alive" in connection
        else:
            self.keep_alive = b"close" not in connection
        if self.status in (204, 304):
            self.length = 0
        elif self.length is None and not self.chunked:
            self.keep_alive = False  # framed by the end of the connection
        return True

    def _chunks(self) -> bool:
        buffer = self.buffer
        while True:
            if self.trailers:
                if buffer.startswith(b"\r\n"):
                    del buffer[:2]
                    return True
                end = buffer.find(b"\r\n")
                if end < 0:
                    return False
                del buffer[: end + 2]  # a trailer field: ignored
                continue
            if self.chunk_left < 0:
                end = buffer.find(b"\r\n")
                if end < 0:
                    if len(buffer) > 1024:
                        raise MetricsFormatError("bad HTTP response: chunk size line too long")
                    return False
                size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise MetricsFormatError(f"bad chunk size: {size_text[:20]!r}") from None
                if size < 0:
                    raise MetricsFormatError(f"bad chunk size: {size_text[:20]!r}")
                del buffer[: end + 2]
                if size == 0:
                    self.trailers = True
                    continue
                if len(self.body) + size > self.max_bytes:
                    raise too_large(self.max_bytes)
                self.chunk_left = size
            if len(buffer) < self.chunk_left + 2:
                return False
            if buffer[self.chunk_left : self.chunk_left + 2] != b"\r\n":
                raise MetricsFormatError("bad HTTP response: a chunk does not end with CRLF")
            self.body += buffer[: self.chunk_left]
            del buffer[: self.chunk_left + 2]
            self.chunk_left = -1


def _decoded(body: bytes, encoding: str, max_bytes: int) -> bytes:
    if encoding in ("identity", ""):
        return body
    if encoding not in ("gzip", "x-gzip", "deflate"):
        raise MetricsFormatError(f"unsupported Content-Encoding {encoding!r}")
    # 47: a gzip or zlib header, detected.
    inflater = zlib.decompressobj(47)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise MetricsFormatError(f"bad {encoding} body: {exc}") from None
    if len(out) > max_bytes:
        raise too_large(max_bytes)
    return out


class PageClient:
    """GETs one URL over one kept-alive connection (module docstring)."""

    __slots__ = ("_conn", "_context", "_request", "max_bytes", "origin", "url", "where")

    def __init__(self, url: str, *, max_bytes: int = MAX_PAGE_BYTES, origin: str = "") -> None:
        self.url = url
        # What the owner built `url` from (the scraper: the pod's metrics URL).
        self.origin = origin or url
        self.where = PageUrl.parse(url)
        self._request = self.where.request()
        self.max_bytes = max_bytes
        self._conn: _Exchange | None = None
        self._context: ssl.SSLContext | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.lost

    async def get(self, timeout_s: float, tls: ssl.SSLContext | None = None) -> Response:
        """The answer (status, body) within `timeout_s` (TimeoutError past it). `tls`: the
        context for an https URL; a new context (rotated files) takes a new connection."""
        async with asyncio.timeout(timeout_s):
            try:
                return await self._get(tls)
            except BaseException:
                self.close()
                raise

    async def _get(self, tls: ssl.SSLContext | None) -> Response:
        for _attempt in range(2):
            reused = self.connected and tls is self._context
            if not reused:
                self.close()
                self._conn = await self._connect(tls)
            conn = self._conn
            assert conn is not None
            try:
                response = await conn.begin(self._request)
            except ServerDisconnectedError:
                self.close()
                if reused and not conn.got_bytes:
                    continue  # the server closed the idle connection: once more, new
                raise
            if not response.keep_alive:
                self.close()
            return response
        raise AssertionError("unreachable: the second attempt is on a new connection")

    async def _connect(self, tls: ssl.SSLContext | None) -> _Exchange:
        where = self.where
        context = (tls or ssl.create_default_context()) if where.https else None
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: _Exchange(self.max_bytes),
                where.host,
                where.port,
                ssl=context,
                server_hostname=where.host if context is not None else None,
            )
        except OSError as exc:
            raise ConnectError(
                f"cannot connect to {where.host}:{where.port}: {type(exc).__name__}: {exc}"
            ) from exc
        self._context = tls
        return conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
