"""A targeted reader of a model server's Prometheus page: the handful of series routing uses.

A general Prometheus parser spends most of its time on histogram buckets (most of a vLLM
page). This scanner looks only at lines whose metric name is wanted (so comments,
`_bucket` and `_created` lines never match), sums the series that match a spec (the
`engine` label of vLLM's data-parallel engines, SGLang's data-parallel ranks), and treats
garbage as absent rather than failing the whole page.

What is wanted is a `PageReader`, built once per configuration: the waiting, running, KV
usage, LoRA info and cache info series as Prometheus metric specs (`name` or
`name{label="v",...}`, upstream's --total-queued-requests-metric syntax), vLLM's names by
default, plus vLLM's own counters (prefix cache, preemptions, tokens, finished requests) and
`process_start_time_seconds`, which other servers simply do not have.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# vLLM's names: the defaults of the five specs.
DEFAULT_WAITING = "vllm:num_requests_waiting"
DEFAULT_RUNNING = "vllm:num_requests_running"
DEFAULT_KV_USAGE = "vllm:kv_cache_usage_perc"
DEFAULT_LORA_INFO = "vllm:lora_requests_info"
DEFAULT_CACHE_INFO = "vllm:cache_config_info"
# vLLM <= 0.11's name for KV usage, read when the KV spec is the default and the page has
# no series of the new name.
OLD_KV_USAGE = "vllm:gpu_cache_usage_perc"
# vLLM's counters, read by name whatever the specs (old names map to `<field>_old`; the new
# name wins when a page has both).
VLLM_COUNTERS: dict[str, str] = {
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries_old",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits_old",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:generation_tokens_total": "generation_tokens",
    # The requests the pod finished and their prompt tokens (the histogram's count and
    # sum, observed at a request's end): the pod's own token count, which the stale check
    # compares with the EPP's (observability/stale.py).
    "vllm:request_prompt_tokens_count": "finished_requests",
    "vllm:request_prompt_tokens_sum": "finished_prompt_tokens",
}
# prometheus_client's process collector (vLLM's and SGLang's API servers have it): the unix
# time the process started. A new value is a restarted server even if its counters have
# grown past the old ones. Alone it does not make a page a model server's page.
START_TIME = "process_start_time_seconds"
# Cache info labels: vLLM's (and trtllm-serve's) names, then SGLang's.
BLOCK_SIZE_LABELS = ("block_size", "page_size")
NUM_BLOCKS_LABELS = ("num_gpu_blocks", "num_pages")


@dataclass(slots=True)
class PodMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    # False: the page has no vLLM prefix-cache counters (another model server), so the
    # stale-cache check cannot tell a hit on this pod from a miss.
    prefix_counters: bool = True
    preemptions: float = 0.0
    # vLLM's generation counter; None: the page has none (another server), so whether its
    # gauges froze cannot be told (store.py's frozen-gauge check then never applies).
    generation_tokens: float | None = 0.0
    model: str | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_loras: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    finished_requests: float | None = None  # None: the page has no such histogram
    finished_prompt_tokens: float | None = None
    # process_start_time_seconds (None: not on the page); the store keeps the latest seen.
    start_time: float | None = None


class MetricsFormatError(ValueError):
    """The page has none of the series routing needs."""


class MetricSpecError(ValueError):
    """A metric spec that cannot be read; the message is one line for the operator."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric name and the label values a series must have (all of them) to be read."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{key}="{_escape(value)}"' for key, value in self.labels)
        return f"{self.name}{{{inner}}}"


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_MATCHER = re.compile(
    r"""\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*"""
    r"""(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)'|([^"',}\s]+))\s*(,|$)"""
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)


def parse_metric_spec(text: str) -> MetricSpec | None:
    """Upstream's metric spec, a PromQL instant vector selector with equality matchers:
    `name`, `name{a="x",b="y"}`, label values quoted or not (`{request_type=waiting}`, as
    GIE's chart passes them). "" (or blanks) is None: the series is not read. Raises
    MetricSpecError for anything else (another matcher than `=` included: upstream drops
    those silently, which would read series the operator meant to exclude)."""
    spec = text.strip()
    if not spec:
        return None
    brace = spec.find("{")
    name = (spec if brace < 0 else spec[:brace]).strip()
    if not _METRIC_NAME.fullmatch(name):
        raise MetricSpecError(f"{text!r}: not a metric name (e.g. vllm:num_requests_waiting)")
    if brace < 0:
        return MetricSpec(name)
    if not spec.endswith("}"):
        raise MetricSpecError(f"{text!r}: the label block must close with '}}' at the end")
    body = spec[brace + 1 : -1]
    labels: dict[str, str] = {}
    pos = 0
    while body[pos:].strip():
        match = _MATCHER.match(body, pos)
        if match is None:
            raise MetricSpecError(f'{text!r}: expected label="value" at {body[pos:]!r}')
        key, op = match[1], match[2]
        if op != "=":
            raise MetricSpecError(f"{text!r}: only '=' label matchers are supported, not {op!r}")
        raw = match[3] if match[3] is not None else match[4] if match[4] is not None else match[5]
        if key in labels:
            raise MetricSpecError(f"{text!r}: label {key!r} is given twice")
        labels[key] = _unescape(raw)
        # A match ends after a comma or at the end of the body (`\s*` takes a last newline
        # before `$` can match ahead of it), so what is left is more matchers, or blank: the
        # end, or a trailing comma, which PromQL allows.
        pos = match.end()
    return MetricSpec(name, tuple(sorted(labels.items())))


_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _split_labels(text: str) -> dict[str, str]:
    """Labels of one series: `a="x",b="y"` with backslash escapes; junk is skipped."""
    labels = dict(_LABEL.findall(text))
    if "\\" in text:
        for key, value in labels.items():
            labels[key] = _unescape(value)
    return labels


# Label texts parsed are kept per reader (a page repeats them every scrape: vLLM's cache
# info alone is ~40 labels); bounded in number and in the length of a text kept.
_LABEL_CACHE_SIZE = 512
_LABEL_CACHE_TEXT = 4096

# Every series read is a count, a ratio, a time or an info gauge's 1: none is negative.
# A sum of engines' values stops at the largest float instead of becoming infinite.
_MAX_VALUE = sys.float_info.max
# Integer labels (block size, blocks, max LoRAs): ASCII digits, at most this many (int()
# refuses "²", which isdigit() accepts, and strings past 4,300 digits).
_MAX_DIGITS = 18


def _value(text: str) -> float | None:
    """A sample value: finite and >= 0 (-0 is 0), else None (garbage, read as absent)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value + 0.0 if 0.0 <= value <= _MAX_VALUE else None


def _count(text: str) -> int | None:
    return int(text) if len(text) <= _MAX_DIGITS and text.isascii() and text.isdigit() else None


def _names(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def _series(
    page: bytes, wanted: tuple[tuple[str, bytes], ...], errors: str
) -> Iterator[tuple[str, str, str]]:
    """(name, label text, value text) of every series line of the wanted metrics.

    The page stays bytes: a search per wanted name (bytes.find is about 15x faster than
    str.find for a name that is not on the page), and only the lines found are decoded, with
    `errors`. Names are ASCII and lines end at b"\n", so a line decoded alone is the same
    text as that line of the whole page decoded."""
    size = len(page)
    for name, raw in wanted:
        needle = b"\n" + raw
        if page.startswith(raw):
            pos = -1
        else:
            pos = page.find(needle)
            if pos < 0:
                continue  # not on the page: one search, not a second from the first line
        while True:
            start = pos + 1  # pos is the newline before the line (or -1: the page start)
            after = start + len(raw)
            end = page.find(b"\n", after)
            if end < 0:
                end = size
            if after < size and page[start:after] == raw and page[after] in b"{ \t":
                line = page[after:end].decode("utf-8", errors)
                labels = ""
                if line.startswith("{"):
                    close = line.rfind("}")
                    labels, line = (line[1:close], line[close + 1 :]) if close > 0 else ("", "")
                fields = line.split()
                if fields:
                    yield name, labels, fields[0]
            pos = page.find(needle, end - 1)
            if pos < 0:
                break


# What a wanted series feeds: a sum (a PodMetrics field, or `<field>_old`), the start time,
# the LoRA info or the cache info.
_SUM, _START, _LORA, _CACHE = range(4)
# (field, kind, label values required)
_Want = tuple[str, int, tuple[tuple[str, str], ...]]


class PageReader:
    """Reads the routing signals from one page. Built once per configuration: the table of
    wanted names (one C-speed substring search each per page) is fixed here."""

    __slots__ = ("_label_cache", "_looked_for", "_table", "_wanted")

    def __init__(
        self,
        waiting: MetricSpec | None = MetricSpec(DEFAULT_WAITING),
        running: MetricSpec | None = MetricSpec(DEFAULT_RUNNING),
        kv_usage: MetricSpec | None = MetricSpec(DEFAULT_KV_USAGE),
        lora_info: MetricSpec | None = MetricSpec(DEFAULT_LORA_INFO),
        cache_info: MetricSpec | None = MetricSpec(DEFAULT_CACHE_INFO),
    ) -> None:
        table: dict[str, list[_Want]] = {}

        def want(spec: MetricSpec | None, field: str, kind: int) -> None:
            if spec is not None:
                table.setdefault(spec.name, []).append((field, kind, spec.labels))

        want(waiting, "waiting", _SUM)
        want(running, "running", _SUM)
        want(kv_usage, "kv_usage", _SUM)
        if kv_usage == MetricSpec(DEFAULT_KV_USAGE):
            want(MetricSpec(OLD_KV_USAGE), "kv_usage_old", _SUM)
        for name, field in VLLM_COUNTERS.items():
            want(MetricSpec(name), field, _SUM)
        want(lora_info, "lora", _LORA)
        want(cache_info, "cache", _CACHE)
        want(MetricSpec(START_TIME), "start_time", _START)
        self._table = {name: tuple(wants) for name, wants in table.items()}
        self._wanted = tuple((name, name.encode("ascii")) for name in self._table)
        specs = (waiting, running, kv_usage, lora_info, cache_info)
        self._looked_for = ", ".join(str(s) for s in specs if s is not None)
        self._label_cache: dict[str, dict[str, str]] = {}

    @classmethod
    def from_texts(
        cls, waiting: str, running: str, kv_usage: str, lora_info: str, cache_info: str
    ) -> PageReader:
        """From spec strings (`parse_metric_spec`); MetricSpecError names the bad one."""
        return cls(
            *(parse_metric_spec(t) for t in (waiting, running, kv_usage, lora_info, cache_info))
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The metric names read from a page, each once (a scrape can ask for only these)."""
        return tuple(self._table)

    def parse(self, page: bytes | str) -> PodMetrics:
        """The page's routing signals; MetricsFormatError if it has none of them. Bytes as
        fetched (invalid UTF-8 in a line read becomes U+FFFD), or text."""
        if isinstance(page, str):
            data, errors = page.encode("utf-8", "surrogatepass"), "surrogatepass"
        else:
            data, errors = page, "replace"
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        result = PodMetrics()
        lora_stamp = -math.inf
        table = self._table
        # A C-speed bytes search per wanted name: the ~90% of lines that are histogram
        # buckets, and the HELP and TYPE comments, are never decoded nor split.
        for name, label_text, value_text in _series(data, self._wanted, errors):
            value = _value(value_text)
            if value is None:
                continue
            labels = self._labels(label_text) if label_text else {}
            for field, kind, required in table[name]:
                if required and any(labels.get(k) != v for k, v in required):
                    continue
                if kind == _SUM:
                    sums[field] = min(_MAX_VALUE, sums.get(field, 0.0) + value)
                    counts[field] = counts.get(field, 0) + 1
                    if result.model is None and labels.get("model_name"):
                        result.model = labels["model_name"]
                elif kind == _START:
                    result.start_time = value
                elif kind == _LORA:
                    # Old label sets are never removed; the newest (largest timestamp) is
                    # current.
                    if value > lora_stamp:
                        lora_stamp = value
                        result.running_adapters = _names(labels.get("running_lora_adapters", ""))
                        result.waiting_adapters = _names(labels.get("waiting_lora_adapters", ""))
                        result.max_loras = _count(labels.get("max_lora", ""))
                else:
                    _cache_info(result, labels)
        if not sums and result.block_size is None and lora_stamp == -math.inf:
            raise MetricsFormatError(
                f"no model server metrics on the page (wanted: {self._looked_for})"
            )
        for new in ("kv_usage", "prefix_queries", "prefix_hits"):
            old = new + "_old"
            if new not in sums and old in sums:
                sums[new], counts[new] = sums[old], counts[old]
        result.waiting = sums.get("waiting", 0.0)
        result.running = sums.get("running", 0.0)
        # Usage is a ratio per engine: the pod's usage is the mean of the series read.
        engines = max(1, counts.get("kv_usage", 1))
        result.kv_usage = min(1.0, max(0.0, sums.get("kv_usage", 0.0) / engines))
        result.prefix_queries = sums.get("prefix_queries", 0.0)
        result.prefix_hits = sums.get("prefix_hits", 0.0)
        result.prefix_counters = "prefix_hits" in sums
        result.preemptions = sums.get("preemptions", 0.0)
        result.generation_tokens = sums.get("generation_tokens")
        result.finished_requests = sums.get("finished_requests")
        result.finished_prompt_tokens = sums.get("finished_prompt_tokens")
        return result

    def _labels(self, text: str) -> dict[str, str]:
        """`_split_labels(text)`, kept for the next pages (the dict is only read)."""
        cache = self._label_cache
        labels = cache.get(text)
        if labels is None:
            labels = _split_labels(text)
            if len(text) <= _LABEL_CACHE_TEXT:
                if len(cache) >= _LABEL_CACHE_SIZE:
                    cache.clear()
                cache[text] = labels
        return labels


def _cache_info(result: PodMetrics, labels: dict[str, str]) -> None:
    block_size = next((labels[k] for k in BLOCK_SIZE_LABELS if k in labels), "")
    blocks = next((labels[k] for k in NUM_BLOCKS_LABELS if k in labels), "")
    size, count = _count(block_size), _count(blocks)
    if size is not None:
        result.block_size = size
    if count is not None:
        # Data-parallel engines each hold their own KV blocks.
        result.num_gpu_blocks = (result.num_gpu_blocks or 0) + count


# vLLM's names: what `parse_vllm_metrics` reads (benchmarks, the demo, tests).
VLLM_READER = PageReader()


def parse_vllm_metrics(page: bytes | str) -> PodMetrics:
    """Read the routing signals from one vLLM /metrics page (raises MetricsFormatError if
    none)."""
    return VLLM_READER.parse(page)
