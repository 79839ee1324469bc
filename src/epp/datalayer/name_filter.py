"""Asking a pod's /metrics for the series the EPP reads only (prometheus_client's
`name[]` query), and telling whether the server did as asked.

prometheus_client's exposition serves only the samples named; other servers ignore the
query, and some answer it with an error. vLLM registers prometheus-fastapi-
instrumentator's own route at exactly `/metrics` (the whole page, the query ignored)
before it mounts prometheus_client's app, which serves `/metrics/`: there the query is
honoured, and the engine renders 3 KB instead of 53 KB (docs/benchmarks/scrape.md)."""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

_PARAM = "name%5B%5D="


def scrape_url(metrics_url: str, names: tuple[str, ...]) -> str:
    """`metrics_url` asking for the series `names` only (`name[]` query parameters)."""
    if not names:
        return metrics_url
    query = "&".join(f"{_PARAM}{quote(name, safe=':')}" for name in names)
    base, hash_, fragment = metrics_url.partition("#")
    joined = f"{base}{'&' if '?' in base else '?'}{query}"
    return f"{joined}{hash_}{fragment}" if hash_ else joined


def honours(page: bytes, names: tuple[str, ...]) -> bool:
    """Whether `page` holds only the families of `names` (a family's samples carry its
    name, or its name and a suffix such as `_total`), judged by its `# TYPE` lines. A
    page without them cannot tell: taken as honoured (it is parsed either way)."""
    wanted = set(names)
    for line in page.splitlines():
        if not line.startswith(b"# TYPE "):
            continue
        family = line[7:].split(b" ", 1)[0].decode("utf-8", "replace")
        if family in wanted:
            continue
        prefix = family + "_"
        if not any(name.startswith(prefix) for name in wanted):
            return False
    return True


def mount_url(url: str) -> str | None:
    """The same URL with its path ending in `/` (where a mounted app such as vLLM's
    prometheus_client one answers), or None if it already does."""
    parts = urlsplit(url)
    path = parts.path or "/"
    if path.endswith("/"):
        return None
    return urlunsplit(parts._replace(path=path + "/"))


def without_filter(url: str) -> str:
    """`url` without the `name[]` parameters `scrape_url` added."""
    parts = urlsplit(url)
    kept = [p for p in parts.query.split("&") if p and not p.startswith(_PARAM)]
    return urlunsplit(parts._replace(query="&".join(kept)))
