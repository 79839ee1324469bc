"""Open-loop streaming load at a fixed rate, recorded per request.

A request leaves at its scheduled time whether or not earlier ones have finished (queueing
then shows in the latency). Requests are created as they fall due, never all up front, so
a ten-minute run holds only what is in flight. Each record: when it was sent (from the
run's origin), the HTTP status, TTFT and end-to-end latency, and an error if any.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from epp_bench.live.client import _send
from epp_bench.workloads.types import RequestOutcome

MODEL = "sim-llama-8b"
# A fleet's traffic: a few shared system prompts (prefix reuse) and a distinct question each.
SYSTEM_PROMPTS = tuple(
    f"You are assistant {n} of the support desk of company {n}. Answer briefly and politely. " * 6
    for n in range(16)
)


def payload(index: int, max_tokens: int) -> bytes:
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPTS[index % len(SYSTEM_PROMPTS)]},
            {"role": "user", "content": f"Question {index}: where is order {index * 7919}?"},
        ],
    }
    return json.dumps(body).encode()


@dataclass(slots=True)
class Record:
    sent_s: float
    status: int
    ttft_s: float | None
    latency_s: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None


class LoadClient:
    """One aiohttp session for the whole run; `phase()` sends at a rate for a duration."""

    def __init__(self, base_url: str, *, max_tokens: int, max_in_flight: int) -> None:
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.max_tokens = max_tokens
        self.max_in_flight = max_in_flight
        self.origin = time.monotonic()
        self.records: list[Record] = []
        self.skipped = 0  # due while max_in_flight were in flight: not sent, counted
        self._in_flight: set[asyncio.Task[None]] = set()
        self._next_index = 0
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> LoadClient:
        connector = aiohttp.TCPConnector(limit=self.max_in_flight)
        timeout = aiohttp.ClientTimeout(total=60)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain(30.0)
        assert self._session is not None
        await self._session.close()

    def now(self) -> float:
        return time.monotonic() - self.origin

    async def _one(self, index: int) -> None:
        assert self._session is not None
        started = time.monotonic()
        outcome = RequestOutcome(index, None, 0, started - self.origin, None, 0.0)
        try:
            await _send(
                self._session, self.url, payload(index, self.max_tokens), outcome, started, {}
            )
        except asyncio.CancelledError:
            outcome.error = "cancelled"
            raise
        finally:
            self.records.append(
                Record(
                    outcome.start_s,
                    outcome.status,
                    outcome.ttft_s,
                    time.monotonic() - started,
                    outcome.error,
                )
            )

    async def phase(self, rate_rps: float, duration_s: float) -> tuple[float, float]:
        """Send at `rate_rps` for `duration_s`; returns (start, end) on the run's clock.
        The schedule is absolute: a late wake-up sends what fell due at once."""
        start = self.now()
        interval = 1.0 / rate_rps
        count = int(rate_rps * duration_s)
        for k in range(count):
            delay = start + k * interval - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(self._in_flight) >= self.max_in_flight:
                self.skipped += 1
                continue
            task = asyncio.create_task(self._one(self._next_index))
            self._next_index += 1
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
        end = start + duration_s
        delay = end - self.now()
        if delay > 0:
            await asyncio.sleep(delay)
        return start, end

    async def drain(self, timeout_s: float) -> None:
        """Wait for what is in flight; cancel what is left after `timeout_s`."""
        if not self._in_flight:
            return
        _, pending = await asyncio.wait(set(self._in_flight), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def between(self, start_s: float, end_s: float) -> list[Record]:
        return [r for r in self.records if start_s <= r.sent_s < end_s]
