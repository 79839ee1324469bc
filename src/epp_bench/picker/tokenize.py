"""`epp bench tokenize`: what a real tokenizer costs the EPP, per request.

For each tokenizer (the test tokenizer `tests/fixtures/tokenizer/llama3`, and
`.bench/tiny-llama` when it was built; `--tokenizer DIR` adds others), in process:

1. **Encode cost per 1,000 tokens, cold**: a long prompt text encoded whole with the
   prefix cache off, by HF `tokenizers` alone and by the fast path (`fast.py`; the piece
   caches are warm, as in steady state: words repeat), divided by its tokens.
2. **The decision path** for a 4,096-token chat prompt: `parse_request` (the body's JSON)
   + the tokenizer (render the chat template, encode) + the chained block hashes, the
   exact calls the router makes (`prefix.blocks.prompt_blocks`):
   - byte estimate: the default without a configured tokenizer, for reference;
   - cold: a conversation never seen before (every iteration another one), with HF's
     encode alone and with the fast path;
   - turn N, cache warm: a conversation whose turn N-1 was routed before (the new turn
     adds an assistant reply and a user message, ~150 tokens); each iteration another
     conversation;
   - the same, as an Anthropic `/v1/messages` body;
   - cold with every word new (random letters): the fast path's piece cache misses on
     every piece, its worst case;
   - cold with typographic text: curly quotes, dashes and an accented word in every
     sentence, as people and models write (no segment is ASCII);
   - a 4 MiB chat body (the server's body limit): only the head is encoded (8,192 blocks,
     131,072 tokens); the event loop is paused this long.

With `--engine`, the whole decision (`Router.route`: tokenize, hash, look up, score,
reserve) for new 4,096-token chats, the model's tokenizer given as its local files and
then as `source: engine`: the router asks a simulated pod, a process of its own serving
the same tokenizer files on loopback, for the ids (POST /tokenize). The difference is
what the engine source adds: one HTTP round trip and the pod's own tokenization.

p50 / p90 / p99 over the iterations, in microseconds. The machine is shared and noisy:
compare rows of one run. With `--before REV`, the in-process rows are also measured on a
frozen commit and on the work tree, each in child processes, alternately, and printed side
by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from epp.app import connect
from epp.config import EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.observability.logs import configure_logging
from epp.observability.metrics import EppMetrics
from epp.prefix.blocks import prompt_blocks
from epp.prefix.hashing import chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest, parse_request
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.tokenization import HfTokenizer, TokenizerRegistry, load_tokenizer_dir
from epp.tokenization.engine import EngineTokenizer, request_body
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.tokenization.protocol import ChatMessage, Tokenizer
from epp_harness.stack import _die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TOKENIZERS = [
    ROOT / "tests" / "fixtures" / "tokenizer" / "llama3",
    ROOT / ".bench" / "tiny-llama",
]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
_WORDS_TEXT = (
    "the a of to in for with from system user assistant model router cache prefix block token "
    "request response engine pod gateway latency throughput queue memory score load health "
    "adapter prompt conversation question answer please explain describe summarize write code "
    "python function class data value number time first last next because therefore however "
    "which what where when why how you we they it is are was be have has do does can could"
)
WORDS = _WORDS_TEXT.split()


@dataclass(slots=True)
class Row:
    tokenizer: str
    case: str
    tokens: int
    p50_us: float
    p90_us: float
    p99_us: float


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def _timed(run: Callable[[int], object], iterations: int) -> list[float]:
    clock = time.perf_counter_ns
    samples = []
    for i in range(iterations):
        start = clock()
        run(i)
        samples.append((clock() - start) / 1000)
    return samples


def _text(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        word = rng.choice(WORDS)
        out.append(word.capitalize() if i % 12 == 0 else word)
        if i % 12 == 11:
            out[-1] += rng.choice([".", ",", "?", ".\n"])
    return " ".join(out)


def _typographic_text(rng: random.Random, words: int) -> str:
    """`_text` as people and models write it: curly quotes, dashes, an accented word in
    every sentence (so no segment is ASCII)."""
    out = _text(rng, words).split(" ")
    for i in range(0, len(out), 12):
        out[i] = rng.choice(["\u201c", "", "caf\u00e9 "]) + out[i]
    for i in range(6, len(out), 12):
        out[i] += rng.choice(["\u2019s", " \u2014", "\u201d", "\u2026"])
    return " ".join(out)


def _novel_text(rng: random.Random, words: int) -> str:
    """Words never seen before (random letters): every piece misses the piece cache."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choices(letters, k=rng.randint(3, 9))) for _ in range(words))


def _conversation(
    rng: random.Random, tok: Tokenizer, target: int, turns: int, text: Callable[..., str] = _text
) -> list[ChatMessage]:
    """A conversation of about `target` tokens under `tok`: a system prompt and turns."""
    messages = [ChatMessage("system", text(rng, 200))]
    for i in range(turns):
        messages.append(ChatMessage("user" if i % 2 == 0 else "assistant", text(rng, 60)))
    # Grow the system prompt until the rendering holds `target` tokens (+ the new turn).
    while len(tok.encode_chat(messages)) < target - 150:
        messages[0] = ChatMessage("system", messages[0].content + " " + text(rng, 100))
    return messages


def _chat_body(messages: list[ChatMessage]) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": m.role, "content": m.content} for m in messages]}
    ).encode()


def _messages_body(messages: list[ChatMessage]) -> bytes:
    system = messages[0].content
    turns = [
        {"role": m.role, "content": [{"type": "text", "text": m.content}]} for m in messages[1:]
    ]
    return json.dumps(
        {"model": "m", "max_tokens": 256, "system": system, "messages": turns}
    ).encode()


def decision(path: str, body: bytes, tok: Tokenizer) -> int:
    """parse + tokenize + hash, as Router.prepare does them."""
    request = parse_request(path, body, {}, max_prompt_tokens=8192 * 16)
    seed = chain_seed(request.model or "", request.adapter, request.cache_salt)
    return len(prompt_blocks(request.prompt, tok, 16, seed, 8192).hashes)


def bench_tokenizer(directory: Path, iterations: int, prompt_tokens: int) -> list[Row]:
    name = directory.name
    rows: list[Row] = []
    rng = random.Random(0)
    cold = load_tokenizer_dir(directory, cache_bytes=0)
    # 1. encode cost per 1k tokens (cold: no prefix cache)
    text = _text(rng, 12_000)
    tokens = len(cold.encode(text))
    for label, tok in (("HF tokenizers' encode", load_tokenizer_dir(directory, cache_bytes=0, fast_path=False)), ("fast path", cold)):  # fmt: skip
        samples = _timed(lambda _, t=tok: t.encode(text), max(20, iterations // 10))
        per_k = [s * 1000 / tokens for s in samples]
        rows.append(Row(name, f"encode, per 1k tokens, {label} ({len(text) / tokens:.1f} chars/token)", 1000,
                        _pct(per_k, 50), _pct(per_k, 90), _pct(per_k, 99)))  # fmt: skip
    # 2. the decision path for a `prompt_tokens` chat prompt
    turns = 8
    sample = _conversation(rng, cold, prompt_tokens, turns)
    count = len(cold.encode_chat(sample))
    conversations = [_conversation(random.Random(i + 1), cold, prompt_tokens, turns) for i in range(iterations)]  # fmt: skip
    previous = [c[:-2] for c in conversations]  # turn N-1: without the last reply and question
    byte = ByteEstimateTokenizer()
    hf_only = load_tokenizer_dir(directory, cache_bytes=0, fast_path=False)
    bodies = [_chat_body(c) for c in conversations]
    for label, path, tok, make, warm in (
        ("byte estimate", CHAT, byte, _chat_body, None),
        (
            "real tokenizer, cold, HF tokenizers' encode (no fast path)",
            CHAT,
            hf_only,
            _chat_body,
            None,
        ),
        ("real tokenizer, cold", CHAT, cold, _chat_body, None),
        ("real tokenizer, turn N, cache warm", CHAT, None, _chat_body, _chat_body),
        (
            "real tokenizer, turn N, cache warm, /v1/messages",
            MESSAGES,
            None,
            _messages_body,
            _messages_body,
        ),
    ):
        if tok is None:
            tok = load_tokenizer_dir(directory)
            assert isinstance(tok, HfTokenizer) and warm is not None
            for prev in previous:
                decision(path, warm(prev), tok)
        these = bodies if make is _chat_body else [make(c) for c in conversations]
        for i in range(min(20, iterations)):  # warm the interpreter, not the cache
            decision(path, these[i], byte)
        runner = tok
        samples = _timed(lambda i, t=runner, b=these, p=path: decision(p, b[i], t), iterations)
        rows.append(Row(name, f"decision: {label}", count, _pct(samples, 50), _pct(samples, 90), _pct(samples, 99)))  # fmt: skip
    # The worst cold case: every word new, so every piece is a BPE call (the
    # conversations are built with another tokenizer, so the timed one has seen none).
    novel = [_chat_body(_conversation(random.Random(10_000 + i), hf_only, prompt_tokens, turns, _novel_text)) for i in range(min(iterations, max(20, iterations // 5)))]  # fmt: skip
    fresh = load_tokenizer_dir(directory, cache_bytes=0)
    novel_count = len(hf_only.encode_chat(parse_request(CHAT, novel[0], {}).prompt.messages or ()))
    samples = _timed(lambda i: decision(CHAT, novel[i], fresh), len(novel))
    rows.append(Row(name, "decision: real tokenizer, cold, every word new", novel_count, _pct(samples, 50), _pct(samples, 90), _pct(samples, 99)))  # fmt: skip
    # Cold again, with the quotes, dashes and accents of real text in every turn.
    typographic = [_chat_body(_conversation(random.Random(20_000 + i), cold, prompt_tokens, turns, _typographic_text)) for i in range(iterations)]  # fmt: skip
    typographic_count = len(
        cold.encode_chat(parse_request(CHAT, typographic[0], {}).prompt.messages or ())
    )
    for i in range(min(20, iterations)):
        decision(CHAT, typographic[i], cold)
    samples = _timed(lambda i: decision(CHAT, typographic[i], cold), iterations)
    rows.append(Row(name, "decision: real tokenizer, cold, typographic text (\u2019 \u2014 \u201c\u201d \u00e9)", typographic_count, _pct(samples, 50), _pct(samples, 90), _pct(samples, 99)))  # fmt: skip
    # The largest body the server takes (server.max_body_bytes, 4 MiB) as one chat turn:
    # the head bound (8,192 blocks, 131,072 tokens) is all that is encoded.
    huge = json.dumps({"model": "m", "messages": [{"role": "user", "content": _text(rng, 800_000)[: 4 * 1024 * 1024 - 100]}]}).encode()  # fmt: skip
    for label, tok in (("byte estimate", byte), ("HF tokenizers' encode", hf_only), ("real tokenizer", load_tokenizer_dir(directory))):  # fmt: skip
        decision(CHAT, huge, tok)
        samples = _timed(lambda _, t=tok: decision(CHAT, huge, t), 5)
        rows.append(Row(name, f"decision: 4 MiB chat body (131,072-token head), {label}", 131_072, _pct(samples, 50), _pct(samples, 90), _pct(samples, 99)))  # fmt: skip
    return rows


async def _until_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30.0
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the simulated pod exited with code {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the simulated pod did not answer {url} within 30 s")


def _router(port: int, entry: dict[str, Any]) -> tuple[Router, EndpointStore]:
    """A router in front of the one simulated pod, tokenizing model `m` as `entry` says."""
    config = EppConfig.model_validate(
        {
            "tokenizers": {"m": entry},
            "endpoints": [{"name": "pod-0", "address": f"127.0.0.1:{port}"}],
        }
    )
    store = EndpointStore.for_config(config)
    store.sync(config.endpoints)
    for endpoint in store.all():
        store.scraped(endpoint, PodMetrics(model="m"))
    index = PrefixIndex.from_config(config.prefix)
    metrics = EppMetrics()
    registry = TokenizerRegistry.from_config(config.tokenizers)
    router = Router(config, store, index, Scheduler(config.scheduling), registry, metrics)
    connect(store, index, router, config)
    router.engine_tokenizer = EngineTokenizer.from_config(
        config.tokenizers, store.all, metrics.registry
    )
    return router, store


async def _engine_rows(directory: Path, iterations: int, prompt_tokens: int) -> list[Row]:
    name = directory.name
    # As `epp serve` logs by default (one INFO line per decision), to nowhere.
    configure_logging("info", stream=open(os.devnull, "w"))  # noqa: SIM115 - for the process
    tok = load_tokenizer_dir(directory, cache_bytes=0)
    conversations = [_conversation(random.Random(50_000 + i), tok, prompt_tokens, 8) for i in range(iterations + 20)]  # fmt: skip
    count = len(tok.encode_chat(conversations[0]))
    bodies = [_chat_body(c) for c in conversations]
    port = free_port()
    argv = [sys.executable, "-m", "vllm_sim", "--port", str(port), "--model", "m",
            "--tokenizer", str(directory)]  # fmt: skip
    pod = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent()
    )
    rows: list[Row] = []
    routers: list[Router] = []
    try:
        await _until_healthy(f"http://127.0.0.1:{port}/health", pod)
        for label, entry in (
            ("local tokenizer", {"path": str(directory)}),
            ("source: engine (a pod's /tokenize)", {"source": "engine", "timeout_ms": 5000}),
        ):
            router, store = _router(port, entry)
            routers.append(router)
            samples: list[float] = []
            for i, body in enumerate(bodies):
                _fresh_page(store)  # as the scraper keeps it: a stale page costs health
                start = time.perf_counter_ns()
                routed = await router.route(
                    IncomingRequest(path=CHAT, body=body, request_id=f"r{i}")
                )
                if i >= 20:  # the first ones warm the connection and the interpreter
                    samples.append((time.perf_counter_ns() - start) / 1000)
                router.complete(routed.token, 200)
            engine = router.engine_tokenizer
            if engine is not None:
                ok = engine.calls.labels("ok")._value.get()
                if ok != len(bodies):  # a fallback would time the local path instead
                    raise RuntimeError(f"the engine answered {ok:g} of {len(bodies)} requests")
            rows.append(Row(name, f"Router.route, new chat, {label}", count, _pct(samples, 50), _pct(samples, 90), _pct(samples, 99)))  # fmt: skip
        # The pod's part: the same /tokenize bodies posted directly (no router around).
        samples = []
        url = f"http://127.0.0.1:{port}/tokenize"
        async with aiohttp.ClientSession() as http:
            for i, c in enumerate(conversations):
                prompt = parse_request(CHAT, _chat_body(c), {}).prompt
                payload = request_body("m", prompt)
                assert payload is not None
                start = time.perf_counter_ns()
                async with http.post(url, data=payload) as response:
                    await response.read()
                if i >= 20:
                    samples.append((time.perf_counter_ns() - start) / 1000)
        rows.append(Row(name, "POST /tokenize alone (the pod's answer, seen by the client)", count, _pct(samples, 50), _pct(samples, 90), _pct(samples, 99)))  # fmt: skip
    finally:
        for router in routers:
            if router.engine_tokenizer is not None:
                await router.engine_tokenizer.close()
        pod.terminate()
        pod.wait(10)
    return rows


def _fresh_page(store: EndpointStore) -> None:
    for endpoint in store.all():
        store.scraped(endpoint, PodMetrics(model="m"))


def markdown(rows: list[Row], command: str, load: str) -> str:
    lines = [
        "# Tokenizing with the model's own tokenizer",
        "",
        f"Regenerate: `.venv/bin/{command}` (about 1 minute; 3 with `--engine`).",
        "",
        f"In process, on {platform.machine()} (CPython {platform.python_version()}), {load}.",
        "The machine is shared: compare rows of one run. Each decision row is what",
        "`Router.prepare` does with the prompt: `parse_request` + the tokenizer (chat",
        "template rendered, text encoded) + the chained block hashes",
        "(`prefix.blocks.prompt_blocks`).",
        "",
        "| tokenizer | what | tokens | p50 (us) | p90 (us) | p99 (us) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.tokenizer} | {r.case} | {r.tokens:,} | {r.p50_us:,.0f} | {r.p90_us:,.0f} | {r.p99_us:,.0f} |"
        )
    lines += [
        "",
        "- **Tokenizers.** `llama3`: the test tokenizer (tests/fixtures/tokenizer/llama3,",
        "  `tools/make_test_tokenizer.py`: byte-level BPE of 1,024 tokens with Llama 3's",
        "  pre-tokenizer and a Llama-3.1-like template with tools). `tiny-llama`: the model",
        "  `tools/vllm_check/build_model.py` builds for the real-vLLM checks (byte-level BPE of",
        "  4,096 tokens, Llama-3-style template). Small vocabularies cut text into more tokens",
        "  than a 128k-token one (the text here is common English words); the cost is mostly",
        "  per character, so a 4,096-token prompt of a real model, with more characters, costs",
        "  somewhat more than these rows.",
        "- **Cold** is a conversation never seen before; the fast path's piece cache is warm",
        "  for common words, as in steady state. **Every word new** is its worst case: random",
        "  letters, every piece a call into the BPE model.",
        "- **Turn N, cache warm**: the conversation's previous turn was routed before, so the",
        "  prefix cache holds its tokens up to its generation prompt; only the reply and the",
        "  new user turn (~150 tokens) are encoded. Also for Anthropic `/v1/messages` bodies.",
        "- **HF tokenizers' encode** is the same path with the fast path off: what",
        "  `tokenizers.Tokenizer.encode` costs here, and what tokenizers the fast path does not",
        "  take (sentencepiece-style Metaspace ones, other normalizers) cost.",
        "- **4 MiB chat body**: the worst pause one request causes (5 runs). Only the head",
        "  the router hashes (`prefix.max_blocks_per_request` x 16 tokens) is encoded; a",
        "  tokenizer without the fast path pauses the loop far longer than the 50 ms the",
        "  server's body limit is set for: lower `max_blocks_per_request` for those.",
    ]
    if any(r.case.startswith("Router.route") for r in rows):
        lines += [
            "- **Router.route, new chat** (`--engine`): the whole decision for a new",
            "  4,096-token chat (parse, tokenize, hash, look up, score, reserve), the model's",
            "  tokenizer given as its files, then as `source: engine`: a simulated pod in a",
            "  process of its own, on loopback, serving the same tokenizer files, answers",
            "  POST /tokenize (HF `tokenizers`' encode, as vLLM's). The difference is what",
            "  the engine source adds to each decision; the pod's tokenization is part of it",
            "  (**POST /tokenize alone**: the same requests sent without a router).",
        ]
    return "\n".join(lines) + "\n"


# A child process's rows for one code (PYTHONPATH): bench_tokenizer exists, with this
# signature, in every commit the before column may name.
_CHILD = (
    "import json, sys; from dataclasses import asdict; from pathlib import Path; "
    "from epp.observability.logs import configure_logging; configure_logging('warning'); "
    "from epp_bench.picker.tokenize import bench_tokenizer; "
    "rows = bench_tokenizer(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])); "
    "print(json.dumps([asdict(r) for r in rows]))"
)


def child_rows(code: Path, directory: Path, iterations: int, prompt_tokens: int) -> list[Row]:
    """`bench_tokenizer` run by the code under `code`, in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-P", "-c", _CHILD, str(directory), str(iterations), str(prompt_tokens)],
        env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True,
        timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"bench_tokenizer ({code}): {done.stderr.strip()[-2000:]}")
    return [Row(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def compared(
    codes: dict[str, Path], directories: list[Path], iterations: int, prompt_tokens: int,
    rounds: int,
) -> dict[str, list[Row]]:  # fmt: skip
    """Each code's rows, the codes alternating round by round; per row, the median of each
    percentile over the rounds."""
    runs: dict[str, list[list[Row]]] = {label: [] for label in codes}
    for _ in range(rounds):
        for label, code in codes.items():
            rows: list[Row] = []
            for directory in directories:
                rows += child_rows(code, directory, iterations, prompt_tokens)
            runs[label].append(rows)
    out: dict[str, list[Row]] = {}
    for label, by_round in runs.items():
        out[label] = [
            Row(
                first.tokenizer,
                first.case,
                first.tokens,
                statistics.median(r[i].p50_us for r in by_round),
                statistics.median(r[i].p90_us for r in by_round),
                statistics.median(r[i].p99_us for r in by_round),
            )
            for i, first in enumerate(by_round[0])
        ]
    return out


def compared_markdown(revision: str, rows: dict[str, list[Row]], rounds: int) -> list[str]:
    lines = [
        "",
        f"## Before ({revision}) and after (the work tree), one run",
        "",
        f"`bench_tokenizer` in a child process per code, the codes alternating, {rounds} "
        "rounds; the median over rounds of each p50. Only the rows both codes have.",
        "",
        "| tokenizer | what | before p50 (us) | after p50 (us) | after / before |",
        "|---|---|---:|---:|---:|",
    ]
    before = {(r.tokenizer, r.case): r for r in rows["before"]}
    for r in rows["after"]:
        b = before.get((r.tokenizer, r.case))
        if b is not None:
            ratio = r.p50_us / b.p50_us if b.p50_us else float("nan")
            lines.append(
                f"| {r.tokenizer} | {r.case} | {b.p50_us:,.0f} | {r.p50_us:,.0f} | {ratio:.2f} |"
            )
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="epp bench tokenize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tokenizer", type=Path, action="append", help="a tokenizer directory (repeatable)"
    )
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also time Router.route with the tokenizer as source: engine (a simulated pod)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument(
        "--out", type=Path, help="write NAME.md and NAME.json (e.g. docs/benchmarks/tokenize)"
    )
    parser.add_argument(
        "--before",
        help="also run the in-process rows on this commit (frozen as tools/bench/"
        "freeze_code.py does) and on the work tree, alternately, and print both columns",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --before: rounds per code")
    args = parser.parse_args(argv)
    command = ("epp bench tokenize " + shlex.join(argv)).strip()
    directories = args.tokenizer or [
        d for d in DEFAULT_TOKENIZERS if (d / "tokenizer.json").exists()
    ]
    before = os.getloadavg()[0]
    rows: list[Row] = []
    for directory in directories:
        rows += bench_tokenizer(directory, args.iterations, args.prompt_tokens)
        if args.engine:
            rows += asyncio.run(_engine_rows(directory, args.iterations, args.prompt_tokens))
    load = (
        f"load average {before:.1f} before and {os.getloadavg()[0]:.1f} after,"
        f" {os.cpu_count()} cores"
    )
    report = markdown(rows, command, load)
    if args.before:
        from epp_bench.picker.overhead import WORK_TREE_SRC, frozen_src

        codes = {"before": frozen_src(args.before), "after": WORK_TREE_SRC}
        both = compared(codes, directories, args.iterations, args.prompt_tokens, args.rounds)
        report += "\n".join(compared_markdown(args.before, both, args.rounds)) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(report)
        payload: dict[str, Any] = {
            "command": command,
            "load": load,
            "rows": [asdict(r) for r in rows],
        }
        args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0
