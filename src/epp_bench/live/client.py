"""An open-loop streaming client: sends a `Workload` on its schedule and times every request.

Open loop means a request goes out at its `arrival_s` whether or not earlier ones have
finished, which is how real traffic behaves and what makes queueing show in the latency
(a closed loop slows down with the server and hides it). A follow-up turn of a
conversation (`after`) waits for its predecessor to finish, then `think_s`.

Two safety bounds keep a run finite even against a stuck server: a cap on requests in
flight (a request over the cap waits for a slot; how often that happened is reported,
because it turns the open loop partly closed), and a hard deadline after which every
request still in flight is cancelled and recorded as such, and those not yet sent are
counted as `not_sent`.

Per request: TTFT (first content chunk), end-to-end latency, usage (prompt, cached,
output tokens) from the last SSE chunk, and the serving pod from `x-sim-pod`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from epp.envoy_config import REQUEST_ID_RESPONSE_HEADER
from epp_bench.workloads.types import BenchRequest, RequestOutcome, Workload
from epp_harness.sse import POD_HEADER, read_stream

_ERROR_BODY_LIMIT = 300
DEADLINE_ERROR = "cancelled at the run's deadline"


@dataclass(frozen=True, slots=True)
class ClientLimits:
    max_in_flight: int = 256
    deadline_s: float = 120.0  # from the run's start; nothing is sent or awaited past it
    request_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if not (self.deadline_s > 0 and self.request_timeout_s > 0):
            raise ValueError("deadline_s and request_timeout_s must be > 0")


@dataclass(slots=True)
class ClientRun:
    outcomes: list[RequestOutcome]  # one per request sent, by index
    wall_s: float
    not_sent: int = 0  # still unsent at the deadline (or their predecessor never finished)
    cap_waits: int = 0  # requests that had to wait for a slot under `max_in_flight`
    # How late open-loop requests left compared with their schedule: a client that cannot
    # keep up (CPU) shows here before it shows anywhere else.
    send_lateness_s: list[float] = field(default_factory=list)
    # Request index -> the id the EPP logged its decision under (Envoy's x-request-id,
    # echoed as x-epp-request-id): joins a response to the EPP's prediction for it.
    request_ids: dict[int, str] = field(default_factory=dict)


ProgressCallback = Callable[[RequestOutcome], None]


def endpoint_path(request: BenchRequest) -> str:
    return "/v1/chat/completions" if request.kind == "chat" else "/v1/completions"


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    payload: bytes,
    outcome: RequestOutcome,
    started: float,
    request_ids: dict[int, str],
) -> None:
    """Send one streaming request and fill `outcome` (never raises but for cancellation)."""
    try:
        async with session.post(
            url, data=payload, headers={"content-type": "application/json"}
        ) as response:
            outcome.status = response.status
            outcome.pod = response.headers.get(POD_HEADER)
            request_id = response.headers.get(REQUEST_ID_RESPONSE_HEADER)
            if request_id:
                request_ids[outcome.index] = request_id
            if response.status != 200:
                text = await response.text(errors="replace")
                outcome.error = f"HTTP {response.status}: {text[:_ERROR_BODY_LIMIT]}"
                return
            stream = await read_stream(response.content, started)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BODY_LIMIT]
        return
    finally:
        outcome.latency_s = time.monotonic() - started
    outcome.ttft_s = stream.ttft_s
    usage = stream.usage or {}
    outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    outcome.output_tokens = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    outcome.cached_tokens = cached if isinstance(cached, int) else 0
    if stream.error is not None:
        outcome.error = stream.error
    elif not stream.done:
        outcome.error = "stream ended before [DONE]"


async def run_open_loop(
    base_url: str,
    workload: Workload,
    limits: ClientLimits = ClientLimits(),
    progress: ProgressCallback | None = None,
) -> ClientRun:
    """Drive every request of `workload` against `base_url` on its schedule."""
    requests = workload.requests
    by_index = {r.index: r for r in requests}
    # Encoded up front: JSON of multi-kilobyte prompts is client CPU that would otherwise
    # land inside the timed window.
    payloads = {r.index: json.dumps(r.body(stream=True)).encode() for r in requests}
    finished = {r.index: asyncio.Event() for r in requests}
    finished_at: dict[int, float] = {}
    outcomes: dict[int, RequestOutcome] = {}
    slots = asyncio.Semaphore(limits.max_in_flight)
    run = ClientRun(outcomes=[], wall_s=0.0)
    base = base_url.rstrip("/")

    async def one(request: BenchRequest) -> None:
        try:
            target = request.arrival_s
            if request.after is not None:
                await finished[request.after].wait()
                previous_end = finished_at.get(request.after)
                if previous_end is None:  # predecessor never ran: neither does this turn
                    return
                target = max(target, previous_end + request.think_s)
            delay = target - (time.monotonic() - run_start)
            if delay > 0:
                await asyncio.sleep(delay)
            if slots.locked():
                run.cap_waits += 1
            async with slots:
                started = time.monotonic()
                if request.after is None:
                    run.send_lateness_s.append(max(0.0, started - run_start - target))
                outcome = RequestOutcome(
                    index=request.index,
                    pod=None,
                    status=0,
                    start_s=started - run_start,
                    ttft_s=None,
                    latency_s=0.0,
                )
                outcomes[request.index] = outcome
                try:
                    url = base + endpoint_path(request)
                    await _send(
                        session, url, payloads[request.index], outcome, started, run.request_ids
                    )
                except asyncio.CancelledError:
                    outcome.error = DEADLINE_ERROR
                    outcome.latency_s = time.monotonic() - started
                    raise
                finished_at[request.index] = time.monotonic() - run_start
                if progress is not None:
                    progress(outcome)
        finally:
            finished[request.index].set()

    timeout = aiohttp.ClientTimeout(total=limits.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=limits.max_in_flight, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        run_start = time.monotonic()
        tasks = [asyncio.create_task(one(by_index[i])) for i in sorted(by_index)]
        try:
            await asyncio.wait(tasks, timeout=limits.deadline_s)
        finally:
            # At the deadline, and also when this coroutine is itself cancelled (Ctrl-C):
            # no request may outlive the session it uses.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        run.wall_s = time.monotonic() - run_start
    run.not_sent = len(requests) - len(outcomes)
    run.outcomes = [outcomes[i] for i in sorted(outcomes)]
    return run
