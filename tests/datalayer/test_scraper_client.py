"""The scraper's HTTP client (epp.datalayer.page_client) against real servers on loopback:
raw asyncio servers that frame the page each way HTTP/1.1 allows (Content-Length, chunked,
until close), close kept-alive connections, or lie about sizes; and prometheus_client's
own exposition (its WSGI app, served by wsgiref: the `_bake_output` vLLM's ASGI app calls)
holding vLLM's families, which honours the scraper's `name[]` filter."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest, make_wsgi_app

from epp.config import DataLayerConfig, EndpointConfig
from epp.datalayer.endpoint import Endpoint
from epp.datalayer.metrics_parser import MetricsFormatError
from epp.datalayer.name_filter import honours, mount_url, without_filter
from epp.datalayer.page_client import PageClient, ServerDisconnectedError
from epp.datalayer.scraper import MOUNT_TRIES, MetricsScraper, page_reader, scrape_url
from epp.datalayer.store import EndpointStore
from epp_bench.picker.scrape_engine import vllm_registry

PAGE = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.33-metrics.txt").read_bytes()
READER = page_reader(DataLayerConfig())
EXPECTED = READER.parse(PAGE)


class RawPod:
    """An HTTP server written by hand: `answer(request head)` returns the bytes to write
    and whether to close the connection after them. Counts connections and requests."""

    def __init__(self, answer: Callable[[bytes], tuple[bytes, bool]]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> RawPod:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    self.requests.append(head)
                    data, close = self.answer(head)
                    writer.write(data)
                    await writer.drain()
                    if close:
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/metrics"
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.close()


def with_length(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


def chunked(body: bytes, size: int = 7000) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    return (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\nX-Trailer: t\r\n\r\n"
    )


async def scraped(url: str, times: int) -> Endpoint:
    """One pod at `url` scraped `times` times in a row by the scraper; the pod as stored."""
    config = DataLayerConfig(scrape_interval_s=0.02)
    store = EndpointStore(config)
    store.sync([EndpointConfig(name="pod", address="127.0.0.1:1", metrics_url=url)])
    scraper = MetricsScraper(store, config)
    for _ in range(times):
        await scraper.scrape_once(store.get("pod"))
    await scraper.stop()
    return store.get("pod")


async def test_a_page_with_a_length_comes_over_one_kept_alive_connection():
    async with RawPod(lambda _: (with_length(PAGE), False)) as pod:
        client = PageClient(pod.url)
        for _ in range(5):
            response = await client.get(2.0)
            assert (response.status, response.body) == (200, PAGE)
        client.close()
    assert pod.connections == 1 and len(pod.requests) == 5
    head = pod.requests[0].decode()
    assert head.startswith("GET /metrics HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{pod.url.split(':')[2].split('/')[0]}\r\n" in head
    # prometheus_client gzips for clients that accept gzip: the scraper does not.
    assert "Accept-Encoding: identity\r\n" in head


def test_the_scraper_reads_pages_on_uvloop_as_epp_serve_runs_it():
    """`epp serve` runs on uvloop, whose transports are not asyncio.Transport instances:
    pages are read there too, over one kept-alive connection."""
    uvloop = pytest.importorskip("uvloop", reason="uvloop is a dependency on this platform")

    async def scrape() -> tuple[list[bytes], int]:
        async with RawPod(lambda _: (with_length(PAGE), False)) as pod:
            client = PageClient(pod.url)
            bodies = [(await client.get(2.0)).body for _ in range(3)]
            client.close()
        return bodies, pod.connections

    bodies, connections = uvloop.run(scrape())
    assert bodies == [PAGE] * 3 and connections == 1


async def test_a_chunked_page_with_extensions_and_trailers_is_the_page():
    async with RawPod(lambda _: (chunked(PAGE), False)) as pod:
        client = PageClient(pod.url)
        assert (await client.get(2.0)).body == PAGE
        assert (await client.get(2.0)).body == PAGE
        client.close()
    assert pod.connections == 1


async def test_a_page_framed_by_the_end_of_the_connection():
    async with RawPod(lambda _: (b"HTTP/1.0 200 OK\r\n\r\n" + PAGE, True)) as pod:
        client = PageClient(pod.url)
        assert (await client.get(2.0)).body == PAGE
        assert (await client.get(2.0)).body == PAGE
    assert pod.connections == 2


async def test_a_connection_the_server_closed_is_replaced():
    """Closed after each answer without a word (an idle timeout on the server): the next
    GET goes over a new connection, whether the close arrived before it or while sending."""
    async with RawPod(lambda _: (with_length(PAGE), True)) as pod:
        client = PageClient(pod.url)
        for _ in range(4):
            assert (await client.get(2.0)).body == PAGE
        client.close()
    assert pod.connections == 4


async def test_a_gzipped_page_sent_anyway_is_decoded():
    body = gzip.compress(PAGE)
    async with RawPod(lambda _: (with_length(body, b"Content-Encoding: gzip\r\n"), False)) as pod:
        client = PageClient(pod.url)
        assert (await client.get(2.0)).body == PAGE
        client.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 9437184\r\n\r\n",  # 9 MiB announced
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"100000\r\n" + b"x" * 1024,
    ],
    ids=["content-length", "chunked"],
)
async def test_a_page_past_the_cap_is_refused_before_it_is_read(answer):
    async with RawPod(lambda _: (answer, False)) as pod:
        client = PageClient(pod.url, max_bytes=512 * 1024)
        if b"9437184" in answer:
            client = PageClient(pod.url)  # the 8 MiB cap itself
        with pytest.raises(MetricsFormatError, match=r"^metrics page larger than \d+ MiB$"):
            await client.get(2.0)
        assert not client.connected


@pytest.mark.parametrize(
    "answer",
    [
        b"<html>oops</html>\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Encoding: br\r\n\r\nabcd",
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Encoding: gzip\r\n\r\nabcd",
    ],
    ids=repr,
)
async def test_a_broken_answer_is_a_format_error_and_the_connection_is_dropped(answer):
    async with RawPod(lambda _: (answer, False)) as pod:
        client = PageClient(pod.url)
        with pytest.raises(MetricsFormatError, match=r"^(bad|unsupported) "):
            await client.get(2.0)
        assert not client.connected


async def test_a_server_gone_mid_answer_and_a_hung_one():
    async with RawPod(lambda _: (with_length(PAGE)[:5000], True)) as pod:
        with pytest.raises(ServerDisconnectedError, match="mid-answer"):
            await PageClient(pod.url).get(2.0)
    async with RawPod(lambda _: (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", False)) as pod:
        client = PageClient(pod.url)
        with pytest.raises(TimeoutError):
            await client.get(0.2)
        assert not client.connected


async def test_a_non_200_answer_is_its_status_and_the_next_get_reconnects():
    statuses = iter([b"503 Service Unavailable", b"200 OK"])

    def answer(_: bytes) -> tuple[bytes, bool]:
        status = next(statuses)
        body = PAGE if status == b"200 OK" else b"busy" * 1000
        return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body), False

    async with RawPod(answer) as pod:
        client = PageClient(pod.url)
        assert (await client.get(2.0)).status == 503
        assert (await client.get(2.0)).body == PAGE
        client.close()
    assert pod.connections == 2


def test_the_name_filter_is_added_to_the_url_as_prometheus_client_reads_it():
    names = ("vllm:num_requests_waiting", "process_start_time_seconds")
    assert scrape_url("http://p:8000/metrics", names) == (
        "http://p:8000/metrics?name%5B%5D=vllm:num_requests_waiting"
        "&name%5B%5D=process_start_time_seconds"
    )
    assert scrape_url("http://p/m?x=1#f", names[:1]) == (
        "http://p/m?x=1&name%5B%5D=vllm:num_requests_waiting#f"
    )
    assert scrape_url("http://p/m", ()) == "http://p/m"


class _Quiet(WSGIRequestHandler):
    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def prometheus_pod():
    """vLLM's families in a real prometheus_client registry, served by prometheus_client's
    WSGI app (the same `_bake_output` as vLLM's ASGI app): honours `name[]` and gzip."""
    registry = vllm_registry(PAGE.decode())
    bodies: list[bytes] = []
    app = make_wsgi_app(registry)

    def recording(environ, start_response):  # type: ignore[no-untyped-def]
        body = b"".join(app(environ, start_response))
        bodies.append(body)
        return [body]

    server = make_server("127.0.0.1", 0, recording, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics", bodies
    server.shutdown()
    thread.join()


@pytest.mark.parametrize("name_filter", [True, False])
async def test_the_scraper_reads_a_prometheus_client_page_whole_or_filtered(
    prometheus_pod, name_filter
):
    """With the filter the engine renders only the series read (a page ~20x smaller) and
    the pod's fields are those of the whole page."""
    url, bodies = prometheus_pod
    config = DataLayerConfig(scrape_interval_s=0.02, scrape_name_filter=name_filter)
    store = EndpointStore(config)
    store.sync([EndpointConfig(name="pod", address="127.0.0.1:1", metrics_url=url)])
    scraper = MetricsScraper(store, config)
    bodies.clear()
    await scraper.start()
    try:
        await asyncio.wait_for(scraper.first_round.wait(), 5)
    finally:
        await scraper.stop()
    metrics = store.get("pod").metrics
    assert metrics is not None and metrics.start_time is not None  # its process collector
    metrics.start_time = None  # the fixture page has none
    assert metrics == EXPECTED
    size = len(bodies[0])
    if name_filter:
        assert size < len(PAGE) / 10
        assert b"_bucket" not in bodies[0] and b"vllm:num_requests_waiting" in bodies[0]
    else:
        assert size > len(PAGE)  # the whole page and the process collectors, uncompressed


@pytest.fixture(scope="module")
def vllm_routes_pod():
    """vLLM's routes (vllm/entrypoints/serve/instrumentator/metrics.py, 0.32): exactly
    `/metrics` is prometheus-fastapi-instrumentator's route (the whole registry, the query
    ignored), registered before prometheus_client's app mounted at `/metrics`, which
    answers `/metrics/` and honours `name[]`. `mounted` (a flag): whether the mount
    answers (a server without it 404s there)."""
    registry = vllm_registry(PAGE.decode())
    client_app = make_wsgi_app(registry)
    state = {"mounted": True}
    paths: list[str] = []
    bodies: list[bytes] = []

    def routes(environ, start_response):  # type: ignore[no-untyped-def]
        path = environ["PATH_INFO"]
        paths.append(path + ("?" + environ["QUERY_STRING"] if environ["QUERY_STRING"] else ""))
        if path == "/metrics":
            body = generate_latest(registry)  # the instrumentator's: no query, no gzip
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
        elif path.startswith("/metrics/") and state["mounted"]:
            body = b"".join(client_app(environ, start_response))
        else:
            body = b"not found"
            start_response("404 Not Found", [("Content-Type", "text/plain")])
        bodies.append(body)
        return [body]

    server = make_server("127.0.0.1", 0, routes, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics", state, paths, bodies
    server.shutdown()
    thread.join()


@pytest.mark.parametrize("mounted", [True, False])
async def test_a_server_that_ignores_the_filter_is_asked_on_its_mount_or_whole(
    vllm_routes_pod, mounted
):
    """vLLM's /metrics ignores `name[]` (its engine renders all 53 KB each scrape): the
    first page shows it, the mount (/metrics/) is asked, and kept where it honours the
    query; without a mount the pod is asked for its whole page, without the query."""
    url, state, paths, bodies = vllm_routes_pod
    state["mounted"] = mounted
    paths.clear()
    bodies.clear()
    endpoint = await scraped(url, 3)
    metrics = endpoint.metrics
    assert metrics is not None and endpoint.consecutive_failures == 0
    metrics.start_time = None  # the fixture page has none
    assert metrics == EXPECTED
    routes = [p.split("?")[0] + ("?name" if "name%5B%5D=" in p else "") for p in paths]
    if mounted:
        assert routes == ["/metrics?name", "/metrics/?name", "/metrics/?name", "/metrics/?name"]
        assert all(len(body) < len(PAGE) / 10 for body in bodies[1:])
    else:
        assert routes == ["/metrics?name", "/metrics/?name", "/metrics", "/metrics"]


async def test_a_mount_that_fails_to_answer_is_asked_again_before_the_filter_goes():
    """A passing fault on the mount check (here: the connection closed unanswered, twice)
    must not leave the pod unfiltered for good; a mount that never answers does, after
    MOUNT_TRIES scrapes."""
    # What prometheus_client serves for the query: vLLM's families, only those asked for.
    only_asked = generate_latest(vllm_registry(PAGE.decode()).restricted_registry(READER.names))
    failures = {"left": 2}

    def answer(head: bytes) -> tuple[bytes, bool]:
        target = head.split(b"\r\n", 1)[0].split(b" ")[1]
        if not target.startswith(b"/metrics/"):
            return with_length(PAGE), False  # the query ignored
        if failures["left"] > 0:
            failures["left"] -= 1
            return b"", True  # closed unanswered
        return with_length(only_asked), False

    for fail, settles_on in ((2, b"/metrics/"), (10, b"/metrics")):
        failures["left"] = fail
        async with RawPod(answer) as pod:
            endpoint = await scraped(pod.url, MOUNT_TRIES + 1)
        assert endpoint.consecutive_failures == 0
        last = pod.requests[-1].split(b"\r\n", 1)[0].split(b" ")[1]
        assert last.split(b"?")[0] == settles_on, (fail, pod.requests)


def test_a_page_honours_the_filter_when_it_holds_only_the_families_asked_for():
    names = ("vllm:num_requests_waiting", "vllm:prompt_tokens_total")
    only = b"# TYPE vllm:num_requests_waiting gauge\n# TYPE vllm:prompt_tokens counter\n"
    assert honours(only, names) and honours(b"x 1\n", names)  # no TYPE lines: no telling
    assert not honours(only + b"# TYPE vllm:other gauge\n", names)
    assert mount_url("http://p/metrics?a=1") == "http://p/metrics/?a=1"
    assert mount_url("http://p/metrics/") is None
    filtered = scrape_url("http://p/m?x=1", names)
    assert without_filter(filtered) == "http://p/m?x=1"


async def test_a_server_that_refuses_the_name_filter_is_asked_for_its_whole_page():
    """Not every /metrics server is prometheus_client's: one that answers the `name[]`
    query with an error gets the plain URL from then on, and its page is read."""

    def answer(head: bytes) -> tuple[bytes, bool]:
        if b"?name%5B%5D=" in head.split(b"\r\n", 1)[0]:
            return b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", False
        return with_length(PAGE), False

    async with RawPod(answer) as pod:
        endpoint = await scraped(pod.url, 2)
    assert endpoint.metrics == EXPECTED and endpoint.consecutive_failures == 0
    filtered = [h for h in pod.requests if b"name%5B%5D" in h.split(b"\r\n", 1)[0]]
    assert len(filtered) == 1 and len(pod.requests) == 3  # asked once, then the plain URL


async def test_a_redirect_on_the_pods_server_is_followed_and_kept():
    """A mounted ASGI metrics app answers /metrics with 307 -> /metrics/: the page is
    read there, and the next scrape asks there at once. A redirect to another server
    is a failed scrape."""

    def answer(head: bytes) -> tuple[bytes, bool]:
        target = head.split(b"\r\n", 1)[0].split(b" ")[1]
        if target.startswith(b"/metrics/"):
            return with_length(PAGE), False
        moved = b"/metrics/" + target[len(b"/metrics") :]
        return b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s\r\n\r\n" % moved, False

    async with RawPod(answer) as pod:
        endpoint = await scraped(pod.url, 2)
    assert endpoint.metrics == EXPECTED and endpoint.consecutive_failures == 0
    targets = [h.split(b"\r\n", 1)[0].split(b" ")[1] for h in pod.requests]
    assert [t.split(b"?")[0] for t in targets] == [b"/metrics", b"/metrics/", b"/metrics/"]
    # The query goes along; this server ignores it (the whole page comes back), so the
    # kept target is asked without it from then on.
    assert [b"name%5B%5D=" in t for t in targets] == [True, True, False]

    def elsewhere(head: bytes) -> tuple[bytes, bool]:
        return b"HTTP/1.1 302 Found\r\nLocation: http://192.0.2.1/metrics\r\n\r\n", False

    async with RawPod(elsewhere) as pod:
        endpoint = await scraped(pod.url, 1)
    assert endpoint.metrics is None and "another server" in (endpoint.last_error or "")
