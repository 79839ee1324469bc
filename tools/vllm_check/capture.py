"""Drive one identical workload against a server (real vLLM or `epp sim`) and record it.

Stdlib + pyzmq + msgspec only (all in the project venv). What is recorded, per step:
the request, the HTTP status, `usage` (prompt, completion and cached tokens), the change
of every `_total` counter on /metrics across the step, a few gauges after it, and the KV
events published during it. Once per run: every /metrics family (type, label names,
sample suffixes) and the replay of the whole KV event stream from sequence 0.

The workload is fixed and seeded. Token-id prompts (`prompt: [ids]`) make both servers
see exactly the same tokens, so their prefix-cache accounting can be compared number for
number; text prompts and chats show how tokenization and chat templates differ.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

END_SEQ = 2**64 - 1
VOCAB_LOW, VOCAB_HIGH = 100, 4000  # token ids the tiny model's vocabulary surely has

# -- the workload -------------------------------------------------------------------------

WORDS = [
    "router",
    "cache",
    "prefix",
    "block",
    "token",
    "request",
    "engine",
    "pod",
    "gateway",
    "latency",
    "queue",
    "memory",
    "score",
    "load",
    "health",
    "adapter",
    "prompt",
    "answer",
    "system",
    "user",
    "model",
    "fleet",
    "replica",
    "scheduler",
    "batch",
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]


@dataclass
class Step:
    name: str
    note: str
    kind: str  # completion | chat | reset | tokenize
    body: dict[str, Any] = field(default_factory=dict)
    # Filled in at run time from an earlier step's answer (multi-turn, output reuse).
    continue_from: str | None = None
    extra_ids: list[int] = field(default_factory=list)
    extra_messages: list[dict[str, str]] = field(default_factory=list)


def build_workload(model: str, long_prompt_tokens: int, seed: int = 7) -> list[Step]:
    """The steps, in order. Names are stable keys for the comparison."""
    rng = random.Random(seed)
    a = ids(rng, 100)
    a_branch = a[:64] + ids(rng, 36)
    b = ids(rng, 64)
    c = ids(rng, 40)
    y = ids(rng, 10)
    long_ids = ids(rng, long_prompt_tokens)
    system = "You are a helpful assistant for a gateway. " + text(rng, 220)
    q1, q2, q3 = text(rng, 25), text(rng, 25), text(rng, 15)
    prose = text(rng, 180)

    def comp(prompt: Any, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        body.update({"temperature": 0.0, "ignore_eos": True, **extra})
        return body

    def chat(messages: list[dict[str, str]], max_tokens: int = 16) -> dict[str, Any]:
        return {
            "model": model,
            "messages": messages,
            "max_completion_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }

    sys_msg = {"role": "system", "content": system}
    return [
        Step("ids_cold", "100 token ids, first time", "completion", comp(a)),
        Step("ids_repeat", "same 100 ids again", "completion", comp(a)),
        Step("ids_branch", "first 64 ids shared, 36 new", "completion", comp(a_branch)),
        Step("ids_64_cold", "64 ids (whole blocks), first time", "completion", comp(b)),
        Step("ids_64_repeat", "same 64 ids: the last token is never a hit", "completion", comp(b)),
        Step(
            "ids_gen40",
            "40 ids, 40 generated tokens (engine caches full output blocks?)",
            "completion",
            comp(c, 40, return_token_ids=True),
        ),
        Step(
            "ids_gen40_continue",
            "the 40 ids + the 40 generated ids + 10 new ids",
            "completion",
            comp(None),
            continue_from="ids_gen40",
            extra_ids=y,
        ),
        Step("chat_sys_q1", "system prompt + question 1", "chat", chat([sys_msg, user(q1)])),
        Step("chat_sys_q2", "same system prompt + question 2", "chat", chat([sys_msg, user(q2)])),
        Step(
            "chat_turn2",
            "conversation 1, turn 2 (turn-1 answer replayed as the assistant message)",
            "chat",
            chat([]),
            continue_from="chat_sys_q1",
            extra_messages=[user(q3)],
        ),
        Step(
            "tokenize_chat",
            "POST /tokenize of the turn-1 chat: the engine's rendering",
            "tokenize",
            {"model": model, "messages": [sys_msg, user(q1)]},
        ),
        Step(
            "tokenize_text",
            "POST /tokenize of the text prompt (completions add special tokens: BOS)",
            "tokenize",
            {"model": model, "prompt": prose},
        ),
        Step("text_cold", "text completion (~180 words)", "completion", comp(prose)),
        Step("text_repeat", "same text again", "completion", comp(prose)),
        Step(
            "text_stream_repeat",
            "same text, streamed with include_usage",
            "completion",
            comp(prose, stream=True, stream_options={"include_usage": True}),
        ),
        Step(
            "text_salted",
            "same text with cache_salt: a different tenant",
            "completion",
            comp(prose, cache_salt="tenant-b"),
        ),
        Step(
            "ids_long",
            f"{long_prompt_tokens} new ids: more than the free KV blocks, forces eviction",
            "completion",
            comp(long_ids, 4),
        ),
        Step(
            "ids_after_evict", "the first 100 ids again, after the eviction", "completion", comp(a)
        ),
        Step("reset", "POST /reset_prefix_cache", "reset"),
        Step("ids_after_reset", "the first 100 ids again, after the reset", "completion", comp(a)),
    ]


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


# -- /metrics -----------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum", "_info")


def parse_metrics(page: str) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """(families, samples): each family's type, label names, suffixes and series count;
    and every sample keyed `name{sorted labels}` (buckets left out)."""
    families: dict[str, dict[str, Any]] = {}
    samples: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            families.setdefault(name, {"type": kind, "labels": set(), "suffixes": set()})
            families[name]["type"] = kind
            continue
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, _, labels_text, value = match.group(1), match.group(2), match.group(3), match.group(4)
        labels = dict(_LABEL.findall(labels_text or ""))
        family = _family_of(name, families)
        entry = families.setdefault(family, {"type": "untyped", "labels": set(), "suffixes": set()})
        entry["labels"].update(k for k in labels if k != "le")
        entry["suffixes"].add(name[len(family) :] or "")
        if name.endswith("_bucket"):
            continue
        key = name + "{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}"
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    out = {
        name: {
            "type": entry["type"],
            "labels": sorted(entry["labels"]),
            "suffixes": sorted(entry["suffixes"]),
        }
        for name, entry in families.items()
    }
    return out, samples


def _family_of(name: str, families: dict[str, Any]) -> str:
    if name in families:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return name


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Changes of `_total` samples, only those that moved."""
    out = {}
    for key, value in after.items():
        name = key.split("{", 1)[0]
        if not name.endswith("_total"):
            continue
        delta = value - before.get(key, 0.0)
        if delta:
            out[key] = delta
    return out


# -- KV events ----------------------------------------------------------------------------


def _hex(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:016x}"
    return value


def normalize_event(event: Any) -> dict[str, Any]:
    """A decoded event as a JSON-friendly dict; positional (<= 0.25) events become maps."""
    if isinstance(event, (list, tuple)):
        kind = event[0]
        fields = {
            "BlockStored": [
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
            ],
            "BlockRemoved": ["block_hashes", "medium"],
        }.get(kind, [])
        event = {"type": kind, **dict(zip(fields, event[1:], strict=False)), "_positional": True}
    out = dict(event)
    if "block_hashes" in out:
        out["block_hashes"] = [_hex(h) for h in out["block_hashes"]]
    if "parent_block_hash" in out:
        out["parent_block_hash"] = _hex(out["parent_block_hash"])
    if isinstance(out.get("extra_keys"), list):
        out["extra_keys"] = [_jsonable(k) for k in out["extra_keys"]]
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def decode_payload(payload: bytes) -> dict[str, Any]:
    raw = msgspec.msgpack.decode(payload)
    ts, events, rank = ([*list(raw), None, None, None])[:3]
    return {
        "ts": ts,
        "dp_rank": rank,
        "events": [normalize_event(e) for e in events],
        "bytes": len(payload),
    }


class KvEventCollector:
    """SUB socket in a thread. vLLM's publisher *connects* to a non-wildcard endpoint, so
    for vLLM we bind; the simulator binds its PUB, so for it we connect."""

    def __init__(self, endpoint: str, bind: bool) -> None:
        self.endpoint = endpoint
        self.bind = bind
        self.messages: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED)
        if bind:
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self.connected_after_s = self._wait_peer(monitor)
        self._sock.disable_monitor()
        monitor.close(0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _wait_peer(monitor: zmq.Socket, timeout_s: float = 15.0) -> float | None:
        """Until the publisher is connected (a PUB drops what it sends with no peer), then a
        little more for our subscription to reach it. None if it never came."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if monitor.poll(100):
                event = recv_monitor_message(monitor)
                if event["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                    time.sleep(0.3)
                    return round(time.monotonic() - start, 3)
        return None

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            record: dict[str, Any] = {"recv": time.time(), "frames": len(frames)}
            if len(frames) == 3:
                record["topic"] = frames[0].decode("utf-8", "replace")
                record["seq"] = int.from_bytes(frames[1], "big")
                record.update(decode_payload(frames[2]))
            else:
                record["raw"] = [f.hex()[:64] for f in frames]
            with self._lock:
                self.messages.append(record)

    def count(self) -> int:
        with self._lock:
            return len(self.messages)

    def wait_quiet(self, quiet_s: float = 0.4, max_s: float = 5.0) -> None:
        """Until no message arrived for `quiet_s` (events trail the HTTP response)."""
        deadline = time.monotonic() + max_s
        last, since = self.count(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.count()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


def replay(endpoint: str, start: int = 0, timeout_s: float = 5.0) -> dict[str, Any]:
    """Ask the replay ROUTER for every buffered batch from `start` (DEALER, [b"", seq])."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: dict[str, Any] = {"start": start, "batches": [], "end_marker": False, "error": None}
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                break
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            # vllm.md says [seq, payload]; vLLM 0.32 sends [topic, seq, payload] (the end
            # marker with an empty topic). Accept both and record which one came.
            layout = "topic,seq,payload" if len(frames) == 3 else f"{len(frames)} frames"
            if len(frames) == 2:
                layout = "seq,payload"
            out.setdefault("frame_layouts", [])
            if layout not in out["frame_layouts"]:
                out["frame_layouts"].append(layout)
            topic = frames[0].decode("utf-8", "replace") if len(frames) == 3 else None
            seq_frame, payload = (frames[-2], frames[-1]) if len(frames) >= 2 else (frames[0], b"")
            seq = int.from_bytes(seq_frame, "big")
            if seq == END_SEQ:
                out["end_marker"] = True
                out["end_marker_topic"] = topic
                out["end_payload_bytes"] = len(payload)
                break
            batch = decode_payload(payload) if payload else {}
            out["batches"].append(
                {"seq": seq, "topic": topic, "n_events": len(batch.get("events", []))}
            )
        else:
            out["error"] = "timeout"
        if not out["end_marker"] and out["error"] is None:
            out["error"] = "no end marker before timeout"
    finally:
        sock.close(0)
    return out


# -- HTTP ---------------------------------------------------------------------------------


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any, str]:
    """(status, parsed JSON or None, raw text). Errors come back as statuses, not raises."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode("utf-8", "replace")
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode("utf-8", "replace")
        status = exc.code
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    return status, parsed, raw


def http_stream(url: str, body: Any, timeout: float = 120.0) -> tuple[int, list[Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    chunks: list[Any] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    chunks.append("[DONE]")
                    break
                chunks.append(json.loads(payload))
            return resp.status, chunks
    except urllib.error.HTTPError as exc:
        return exc.code, [exc.read().decode("utf-8", "replace")]


def scrape(base: str) -> tuple[str, dict[str, float]]:
    status, _, page = http("GET", base + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return page, parse_metrics(page)[1]


def scrape_settled(base: str, before: dict[str, float], max_s: float = 3.0) -> dict[str, float]:
    """Counters trail the HTTP answer a little in vLLM (the stat logger runs per engine
    step): scrape until two reads 150 ms apart agree, at most `max_s`."""
    deadline = time.monotonic() + max_s
    time.sleep(0.15)
    _, last = scrape(base)
    while time.monotonic() < deadline:
        time.sleep(0.15)
        _, now = scrape(base)
        if counter_deltas(last, now) == {}:
            return now
        last = now
    return last


# -- the run ------------------------------------------------------------------------------

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def _gauges(samples: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in samples.items() if k.split("{", 1)[0] in GAUGES}


def _usage_of(step: Step, status: int, parsed: Any) -> dict[str, Any] | None:
    if status != 200 or not isinstance(parsed, dict) or "usage" not in parsed:
        return None
    usage = parsed["usage"] or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens") if details else None,
        "has_prompt_tokens_details": bool(details),
    }


def run_workload(
    base: str,
    steps: list[Step],
    collector: KvEventCollector | None,
) -> list[dict[str, Any]]:
    answers: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    _, samples = scrape(base)
    for step in steps:
        body = json.loads(json.dumps(step.body))
        record: dict[str, Any] = {"name": step.name, "note": step.note, "kind": step.kind}
        if step.continue_from and step.continue_from not in answers:
            record.update(status=None, skipped=f"{step.continue_from} failed")
            records.append(record)
            continue
        if step.continue_from:
            prev = answers[step.continue_from]
            if step.kind == "completion":
                out_ids = prev.get("output_token_ids")
                record["continuation_source"] = "server token ids" if out_ids else "fallback ids"
                if not out_ids:
                    # The simulator returns filler text, not token ids: any ids will do,
                    # since it never caches output blocks.
                    out_ids = [VOCAB_LOW + i for i in range(prev["max_tokens"])]
                body["prompt"] = prev["prompt"] + list(out_ids) + step.extra_ids
            else:
                body["messages"] = [
                    *prev["messages"],
                    {"role": "assistant", "content": prev["text"]},
                    *step.extra_messages,
                ]
        if step.kind in ("completion", "chat"):
            prompt = body.get("prompt")
            record["request"] = {
                "endpoint": "/v1/completions"
                if step.kind == "completion"
                else "/v1/chat/completions",
                "prompt_ids": prompt if isinstance(prompt, list) else None,
                "prompt_chars": len(prompt) if isinstance(prompt, str) else None,
                "messages": [
                    {"role": m["role"], "chars": len(m["content"])}
                    for m in body.get("messages", [])
                ]
                or None,
                "max_tokens": body.get("max_tokens") or body.get("max_completion_tokens"),
                "stream": bool(body.get("stream")),
                "cache_salt": body.get("cache_salt"),
            }
        n_before = collector.count() if collector else 0
        started = time.monotonic()
        if step.kind == "reset":
            status, parsed, raw = http("POST", base + "/reset_prefix_cache")
            record["response"] = raw[:300]
        elif step.kind == "tokenize":
            status, parsed, raw = http("POST", base + "/tokenize", body)
            if status == 200 and isinstance(parsed, dict):
                tokens = parsed.get("tokens") or []
                record["tokenize"] = {"count": parsed.get("count"), "ids": tokens}
            else:
                record["response"] = raw[:300]
        elif body.get("stream"):
            url = base + (
                "/v1/completions" if step.kind == "completion" else "/v1/chat/completions"
            )
            status, chunks = http_stream(url, body)
            usage_chunks = [c for c in chunks if isinstance(c, dict) and c.get("usage")]
            parsed = usage_chunks[-1] if usage_chunks else None
            record["stream_chunks"] = len(chunks)
            record["usage_chunk_has_choices"] = bool(parsed and parsed.get("choices"))
        else:
            url = base + (
                "/v1/completions" if step.kind == "completion" else "/v1/chat/completions"
            )
            status, parsed, raw = http("POST", url, body)
            if status != 200:
                record["response"] = raw[:300]
        record["elapsed_s"] = round(time.monotonic() - started, 4)
        record["status"] = status
        record["usage"] = _usage_of(step, status, parsed)
        if status == 200 and step.kind in ("completion", "chat") and not body.get("stream"):
            choice = (parsed.get("choices") or [{}])[0]
            answer = {"max_tokens": record["request"]["max_tokens"]}
            if step.kind == "completion":
                answer["prompt"] = body["prompt"]
                answer["output_token_ids"] = choice.get("token_ids")
                record["output_token_ids"] = choice.get("token_ids")
            else:
                answer["messages"] = body["messages"]
                answer["text"] = (choice.get("message") or {}).get("content") or ""
            answers[step.name] = answer
        if collector:
            collector.wait_quiet()
        after = scrape_settled(base, samples)
        record["counter_deltas"] = counter_deltas(samples, after)
        record["gauges_after"] = _gauges(after)
        samples = after
        if collector:
            record["event_messages"] = [n_before, collector.count()]
        records.append(record)
        print(
            f"  {step.name:22s} {status} usage={record['usage']} "
            f"events={record.get('event_messages')}",
            flush=True,
        )
    return records


def capture(
    base: str,
    model: str,
    *,
    target: str,
    long_prompt_tokens: int,
    kv_sub: tuple[str, bool] | None,
    kv_replay: str | None,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The whole capture for one server, as a JSON-ready dict."""
    collector = KvEventCollector(*kv_sub) if kv_sub else None
    try:
        if collector:
            print(f"  KV event publisher connected after {collector.connected_after_s} s")
        first_page, _ = scrape(base)
        models = http("GET", base + "/v1/models")[1]
        steps = build_workload(model, long_prompt_tokens)
        records = run_workload(base, steps, collector)
        last_page, _ = scrape(base)
        messages = collector.messages if collector else []
        replayed = replay(kv_replay) if kv_replay else None
    finally:
        if collector:
            collector.close()
    families, _ = parse_metrics(last_page)
    return {
        "target": target,
        "meta": meta,
        "models": models,
        "metrics_families": families,
        "metrics_page_first": _strip_buckets(first_page),
        "steps": records,
        "kv_events": {
            "enabled": collector is not None,
            "subscribe": kv_sub[0] if kv_sub else None,
            "subscriber_binds": kv_sub[1] if kv_sub else None,
            "publisher_connected_after_s": collector.connected_after_s if collector else None,
            "messages": messages,
            "replay": replayed,
        },
    }


def _strip_buckets(page: str) -> str:
    """The page without histogram buckets and HELP lines (they are most of its bytes)."""
    return "\n".join(
        line
        for line in page.splitlines()
        if "_bucket{" not in line and not line.startswith("# HELP")
    )
