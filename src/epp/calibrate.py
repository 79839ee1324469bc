"""`epp calibrate`: measure one idle pod's prefill cost, for `scheduling.prefill_estimate`.

The `prefill` scorer prices waiting in seconds of prefill work, so it needs the pods'
prefill speed (the field calibrates one peak prefill throughput per model and
accelerator). This sends a few single requests (max_tokens 1, never concurrent) straight
to a pod, OpenAI completions API:

- cold prompts of two lengths: per_token_s is the slope of latency over prompt tokens,
  overhead_s the intercept;
- the longer prompt again, now in the pod's prefix cache: per_cached_token_s from it.

Prompt sizes come from the pod's own `usage.prompt_tokens`. Run it against an idle pod
(nothing else sent to it) and paste the printed YAML into the EPP's configuration:

    epp calibrate --url http://10.0.0.7:8000 --model meta-llama/Llama-3.1-8B-Instruct
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sample:
    prompt_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillFit:
    overhead_s: float
    per_token_s: float
    per_cached_token_s: float

    def yaml(self) -> str:
        return (
            "scheduling:\n"
            "  prefill_estimate:\n"
            f"    overhead_s: {self.overhead_s:.6g}\n"
            f"    per_token_s: {self.per_token_s:.6g}\n"
            f"    per_cached_token_s: {self.per_cached_token_s:.6g}\n"
        )


def fit(short: list[Sample], long: list[Sample], cached: list[Sample]) -> PrefillFit:
    """Slope and intercept from the medians of cold samples at two lengths; the cached
    cost from the long prompt served from cache. Costs are clamped to be consistent (a
    cached token never dearer than a computed one, nothing negative)."""
    s_tokens = statistics.median(s.prompt_tokens for s in short)
    l_tokens = statistics.median(s.prompt_tokens for s in long)
    s_time = statistics.median(s.seconds for s in short)
    l_time = statistics.median(s.seconds for s in long)
    if l_tokens <= s_tokens:
        raise ValueError("the long prompt must have more tokens than the short one")
    per_token = max(0.0, (l_time - s_time) / (l_tokens - s_tokens))
    overhead = max(0.0, s_time - s_tokens * per_token)
    c_time = statistics.median(s.seconds for s in cached)
    per_cached = max(0.0, (c_time - overhead) / l_tokens)
    return PrefillFit(overhead, per_token, min(per_cached, per_token))


_VOCABULARY = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "bright",
    "stars",
    "shine",
    "above",
    "calm",
    "water",
    "and",
    "old",
    "ships",
    "rest",
    "near",
    "the",
    "quiet",
    "harbour",
    "of",
    "the",
    "small",
    "town",
]


def _words(count: int, salt: str) -> str:
    # Plain words (about one token each on most tokenizers, so prompt sizes are steady),
    # led by a salt so that nothing is in the pod's cache by accident: a prefix cache
    # matches from the first token.
    return salt + " " + " ".join(_VOCABULARY[i % len(_VOCABULARY)] for i in range(count))


def _complete(url: str, model: str, prompt: str, timeout_s: float) -> Sample:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    request = urllib.request.Request(
        f"{url.rstrip('/')}/v1/completions",
        data=body.encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        payload = json.loads(response.read())
    elapsed = time.perf_counter() - started
    return Sample(int(payload["usage"]["prompt_tokens"]), elapsed)


def measure(
    url: str, model: str, short_words: int, long_words: int, repeats: int, timeout_s: float
) -> PrefillFit:
    _complete(url, model, _words(8, "warm"), timeout_s)  # first request pays for warm-up
    short, long, cached = [], [], []
    for _ in range(repeats):
        short.append(_complete(url, model, _words(short_words, secrets.token_hex(3)), timeout_s))
        prompt = _words(long_words, secrets.token_hex(3))
        long.append(_complete(url, model, prompt, timeout_s))
        cached.append(_complete(url, model, prompt, timeout_s))
    return fit(short, long, cached)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp calibrate", description=__doc__)
    parser.add_argument("--url", required=True, help="the pod's base URL, e.g. http://ip:8000")
    parser.add_argument("--model", required=True, help="a model name the pod serves")
    parser.add_argument("--short-words", type=int, default=100)
    parser.add_argument("--long-words", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        result = measure(
            args.url, args.model, args.short_words, args.long_words, args.repeats, args.timeout_s
        )
    except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
        print(f"epp calibrate: {exc}", file=sys.stderr)
        return 1
    print(result.yaml(), end="")
    return 0
