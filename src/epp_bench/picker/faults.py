"""`epp bench faults`: the fault suite through the real stack (Envoy + `epp serve` +
simulated pods on 127.0.0.1), one scenario per fault, under a steady client load.

For each scenario:

- **moved away**: seconds from the fault to the last request the EPP routed to the faulty
  pod (its scheduling decisions, `inference_extension_scheduler_attempts_total{pod_name}`,
  read every 0.1 s: that is the resolution). The fault is held until no request went to
  the pod for `quiet_s` while the others got requests, or `fault_max_s`: "no" then.
- **returned**: seconds from the repair (the pod serving again; for a restarted process,
  its /health answering) to the first request routed back to it.
- **failed**: the client's requests sent from the fault to the end of the scenario that
  did not answer 200, by status (0: no answer within the client's timeout, or reset).
- precise mode (KV events): the index's **divergence** from the engine's truth after
  recovery (blocks in one and not the other: `/debug/index?pod=` against the pod's
  `/sim/kv`) and the seconds until they agreed again.

Faults are the simulator's switches (`POST /sim/fail`, `POST /sim/kv/restart`) and real
signals to real processes. The contracts each scenario must keep are asserted by
tests/e2e/test_fault_suite.py; this command measures.

    .venv/bin/epp bench faults --out docs/benchmarks/faults.md
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from epp_harness.stack import LocalStack, _Child

MODEL = "sim-llama-8b"
FAST_PODS = ("--prefill-per-token-ms", "0.01", "--decode-per-token-ms", "0.2")
FAULTY = "pod-1"
BLOCK = 16
DRAIN_TIMEOUT_S = 5.0
APPROX_CONFIG = f"server: {{drain_timeout_s: {DRAIN_TIMEOUT_S:g}, drain_quiet_s: 1.0}}\n"
PRECISE_CONFIG = (
    "kv_events: {mode: auto, reconnect_max_s: 0.5, resync_timeout_s: 1.0}\n"
    f"prefix: {{block_size: {BLOCK}}}\n"
)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
ATTEMPTS = "inference_extension_scheduler_attempts_total{"
POLL_S = 0.1


def http(
    url: str, body: object = None, timeout: float = 5.0, method: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body); status 0 when there was no answer (refused, reset, timeout)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    try:
        with _DIRECT.open(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()
    except (OSError, urllib.error.URLError):
        return 0, {}, b""


# -- the stack ---------------------------------------------------------------------------


class FaultStack(LocalStack):
    """A LocalStack whose pods and EPP can be killed and started again on their ports."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._argv: dict[str, list[str]] = {}
        self._current: dict[str, _Child] = {}
        self._restarts = itertools.count(1)

    def _spawn(self, name: str, argv: Sequence[str]) -> _Child:
        child = super()._spawn(name, argv)
        base = name.partition(".")[0]
        self._argv.setdefault(base, list(argv))
        self._current[base] = child
        return child

    def signal(self, name: str, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._current[name].popen.pid, sig)

    def exited(self, name: str, timeout_s: float) -> int | None:
        """The process's exit code once it exited (None: still running after timeout_s)."""
        with contextlib.suppress(Exception):
            return self._current[name].popen.wait(timeout_s)
        return None

    def restart(self, name: str) -> None:
        """Start `name` again with its first command line (same ports); its log is
        `<name>.restart<n>.log`. Returns once it answers (/health, or /ready for the EPP)."""
        self._spawn(f"{name}.restart{next(self._restarts)}", self._argv[name])
        if name == "epp":
            assert self.epp_metrics_url is not None
            url = self.epp_metrics_url.replace("/metrics", "/ready")
        else:
            url = f"{self.pod(name).base_url}/health"
        wait(lambda: http(url, timeout=1)[0] == 200, 30, f"{name} to answer again")

    def epp_url(self, path: str) -> str:
        assert self.epp_metrics_url is not None
        return self.epp_metrics_url.replace("/metrics", path)

    def sim_fail(self, pods: Sequence[str], switches: dict) -> None:
        for name in pods:
            status = http(f"{self.pod(name).base_url}/sim/fail", switches)[0]
            if status != 200:
                raise RuntimeError(f"POST /sim/fail {switches} on {name}: {status}")


def wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until `predicate()`; the seconds it took. Raises TimeoutError."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - began


# -- the load and what it sees -------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    sent: float
    status: int
    pod: str


class Load:
    """A steady client through Envoy: `rate` requests a second, paced, from threads."""

    def __init__(self, url: str, body_for: Callable[[int], dict], rate: float, threads: int):
        self.url, self.body_for, self.rate, self.threads = url, body_for, rate, threads
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = itertools.count()
        self._workers: list[threading.Thread] = []
        self.timeout_s = 5.0

    def start(self) -> Load:
        began = time.monotonic()

        def work() -> None:
            while not self._stop.is_set():
                with self._lock:
                    n = next(self._sent)
                delay = began + n / self.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sent = time.monotonic()
                status, headers, _ = http(self.url, self.body_for(n), timeout=self.timeout_s)
                with self._lock:
                    self.answers.append(Answer(sent, status, headers.get("x-sim-pod", "")))

        self._workers = [threading.Thread(target=work, daemon=True) for _ in range(self.threads)]
        for worker in self._workers:
            worker.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(self.timeout_s + 5)

    def since(self, t0: float) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if a.sent >= t0]

    def answered_since(self, t0: float, count: int) -> bool:
        return len(self.since(t0)) >= count


class DecisionWatch:
    """When the EPP routed to each pod: its per-pod decision counters, read every 0.1 s.
    A counter that goes back (a new EPP process) starts again from 0."""

    def __init__(self, stack: FaultStack) -> None:
        self.url = stack.epp_url("/metrics")
        self.routed: dict[str, list[float]] = {}  # pod -> times an increase was seen
        self.counts: dict[str, list[tuple[float, float]]] = {}  # pod -> (time, decisions)
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> DecisionWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            status, _, page = http(self.url, timeout=2)
            if status != 200:
                continue
            seen = time.monotonic()
            counts = decisions_by_pod(page.decode())
            with self._lock:
                for pod, count in counts.items():
                    last = self._last.get(pod, 0.0)
                    new = count - last if count >= last else count
                    if new > 0:
                        self.routed.setdefault(pod, []).append(seen)
                        self.counts.setdefault(pod, []).append((seen, new))
                    self._last[pod] = count

    def times(self, pod: str, after: float) -> list[float]:
        with self._lock:
            return [t for t in self.routed.get(pod, []) if t > after]

    def share(self, pod: str, after: float, before: float) -> float:
        """The pod's share of the decisions seen between two times."""
        with self._lock:
            per_pod = {
                p: sum(n for t, n in seen if after < t <= before) for p, seen in self.counts.items()
            }
        total = sum(per_pod.values())
        return per_pod.get(pod, 0.0) / total if total else 0.0

    def others(self, pod: str, after: float) -> int:
        with self._lock:
            return sum(1 for p, ts in self.routed.items() if p != pod for t in ts if t > after)


def epp_gauge(stack: FaultStack, name: str) -> dict[str, float]:
    """pod -> value of one per-pod series of the EPP's /metrics page."""
    status, _, page = http(stack.epp_url("/metrics"))
    out: dict[str, float] = {}
    for line in page.decode().splitlines() if status == 200 else ():
        if line.startswith(name + "{"):
            pod = line.partition('pod="')[2].partition('"')[0]
            out[pod] = float(line.rsplit(" ", 1)[1])
    return out


def decisions_by_pod(page: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(ATTEMPTS) and 'status="success"' in line:
            pod = line.partition('pod_name="')[2].partition('"')[0]
            counts[pod] = counts.get(pod, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


# -- scenarios -----------------------------------------------------------------------------


@dataclass
class Settings:
    rate: float = 12.0
    threads: int = 12
    quiet_s: float = 2.0  # no request to the faulty pod for this long: moved away
    fault_min_answers: int = 12  # the fault holds at least until this many answers came
    fault_max_s: float = 15.0
    return_max_s: float = 20.0
    converge_max_s: float = 20.0


@dataclass
class Result:
    name: str
    fault: str
    moved_away_s: float | None = None  # None: not applicable
    moved_away: bool | None = None
    returned_s: float | None = None
    returned: bool | None = None
    failed: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    divergence: int | None = None  # blocks, after recovery (precise faults)
    missing: int = 0  # of which the engine holds and the index does not
    phantom: int = 0  # of which the index holds and the engine does not
    converged_s: float | None = None
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)  # the scenario's own figures

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    def to_json(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k != "failed"}
        return out | {"failed": dict(self.failed)}


@dataclass
class Bench:
    stack: FaultStack
    load: Load
    watch: DecisionWatch
    settings: Settings

    def hold_until_moved_away(self, pod: str, t_fault: float) -> tuple[float, bool]:
        """Hold the fault until `pod` got no request for quiet_s while the others got
        some (moved away), or fault_max_s. (seconds to the last request routed there,
        moved away)."""
        s = self.settings
        while True:
            now = time.monotonic()
            last = max(self.watch.times(pod, t_fault), default=t_fault)
            quiet = now - last >= s.quiet_s and self.watch.others(pod, last) >= 3
            if quiet and self.load.answered_since(t_fault, s.fault_min_answers):
                return last - t_fault, True
            if now - t_fault > s.fault_max_s:
                return last - t_fault, False
            time.sleep(0.05)

    def wait_return(self, pod: str, t_repair: float) -> tuple[float, bool]:
        try:
            wait(
                lambda: bool(self.watch.times(pod, t_repair)),
                self.settings.return_max_s,
                f"a request routed to {pod}",
            )
        except TimeoutError:
            return self.settings.return_max_s, False
        return min(self.watch.times(pod, t_repair)) - t_repair, True

    def settle(self, t0: float) -> None:
        """A few more answers after the scenario (the last requests' fate is counted)."""
        wait(lambda: self.load.answered_since(t0, 6), 30, "answers after the scenario")

    def finish(self, result: Result, t_fault: float) -> Result:
        self.settle(time.monotonic())
        answers = self.load.since(t_fault)
        result.sent = len(answers)
        result.failed = Counter(str(a.status) for a in answers if a.status != 200)
        return result


def pod_fault(name: str, fault: str, on: dict, off: dict) -> Callable[[Bench], Result]:
    """A fault that a /sim/fail switch turns on and off on the faulty pod."""

    def run(b: Bench) -> Result:
        t_fault = time.monotonic()
        b.stack.sim_fail([FAULTY], on)
        moved_s, moved = b.hold_until_moved_away(FAULTY, t_fault)
        b.stack.sim_fail([FAULTY], off)
        t_repair = time.monotonic()
        share = b.watch.share(FAULTY, t_fault, t_repair)
        returned_s, returned = b.wait_return(FAULTY, t_repair)
        result = Result(name, fault, moved_s, moved, returned_s, returned)
        result.note = f"pod-1's share of the decisions during the fault: {share:.0%} (of 4 pods)"
        result.extra["share"] = share
        return b.finish(result, t_fault)

    return run


def crash(b: Bench) -> Result:
    t_fault = time.monotonic()
    b.stack.signal(FAULTY, signal.SIGKILL)
    moved_s, moved = b.hold_until_moved_away(FAULTY, t_fault)
    b.stack.restart(FAULTY)
    t_repair = time.monotonic()
    returned_s, returned = b.wait_return(FAULTY, t_repair)
    result = Result("crash", "SIGKILL pod-1; restarted on its port", moved_s, moved)
    result.returned_s, result.returned = returned_s, returned
    result.note = "returned: from its /health answering"
    return b.finish(result, t_fault)


def flap(b: Bench) -> Result:
    """pod-1 down (every request 503, /health 503) and up, 1 s each, four times."""
    t_fault = time.monotonic()
    down = {"generation": "503", "health": 503}
    up = {"generation": None, "health": None}
    for _ in range(4):
        b.stack.sim_fail([FAULTY], down)
        time.sleep(1.0)  # the flap's period: the fault's shape, not a wait for a signal
        b.stack.sim_fail([FAULTY], up)
        time.sleep(1.0)
    t_repair = time.monotonic()
    routed = len(b.watch.times(FAULTY, t_fault))
    returned_s, returned = b.wait_return(FAULTY, t_repair)
    result = Result("flap", "pod-1 503 for 1 s, fine for 1 s, x4", None, None, returned_s, returned)
    result.note = f"{routed} requests routed to pod-1 while flapping"
    return b.finish(result, t_fault)


def partition(b: Bench) -> Result:
    """Every pod's /metrics hangs (the EPP cannot scrape) while Envoy reaches the pods."""
    pods = [p.name for p in b.stack.pods]
    t_fault = time.monotonic()
    b.stack.sim_fail(pods, {"metrics": "hang"})
    wait(
        lambda: all(v >= 5 for v in epp_gauge(b.stack, "epp_pod_scrape_failures").values()),
        60,
        "every pod to fail 5 scrapes",
    )
    t5 = time.monotonic()
    wait(lambda: b.load.answered_since(t5, 20), 60, "20 answers after that")
    routed = sorted(p for p in pods if b.watch.times(p, t5))
    excluded = sum(epp_gauge(b.stack, "epp_pod_excluded").values())
    b.stack.sim_fail(pods, {"metrics": None})
    result = Result("partition", "every pod's /metrics hangs; Envoy still reaches them")
    result.note = (
        f"after 5 failed scrapes each: {excluded:.0f} pods excluded, {len(routed)} of"
        f" {len(pods)} routed to"
    )
    result.extra |= {"pods_routed_after": len(routed), "excluded_after": excluded}
    return b.finish(result, t_fault)


def frozen(b: Bench) -> Result:
    t_fault = time.monotonic()
    b.stack.sim_fail([FAULTY], {"metrics": "frozen"})
    wait(lambda: b.load.answered_since(t_fault, 40), 60, "40 answers")
    routed = len(b.watch.times(FAULTY, t_fault))
    total = routed + b.watch.others(FAULTY, t_fault)
    b.stack.sim_fail([FAULTY], {"metrics": None})
    result = Result("frozen metrics", "pod-1's /metrics repeats one page; it serves")
    result.note = f"pod-1 kept {routed} of {total} decisions (not moved away: it serves)"
    result.extra["routed_to_faulty"] = routed
    return b.finish(result, t_fault)


def epp_kill(b: Bench) -> Result:
    t_fault = time.monotonic()
    b.stack.signal("epp", signal.SIGKILL)
    b.stack.exited("epp", 10)
    wait(lambda: b.load.answered_since(t_fault, 6), 30, "answers while the EPP is down")
    b.stack.restart("epp")
    t_repair = time.monotonic()
    result = Result("EPP SIGKILL", "SIGKILL epp serve; restarted on its ports")
    result.returned_s, result.returned = first_routed(b, t_repair)
    result.note = (
        f"down {t_repair - t_fault:.1f} s (to the new process ready; Envoy answers 500 meanwhile);"
        " returned: its first decision"
    )
    return b.finish(result, t_fault)


def epp_drain(b: Bench) -> Result:
    t_fault = time.monotonic()
    b.stack.signal("epp", signal.SIGTERM)
    code = b.stack.exited("epp", 30)
    t_exit = time.monotonic()
    # Under steady load a routing stream is always open: the drain lasts drain_timeout_s,
    # then the EPP stops and what is being routed then fails. Draining: until 0.5 s before.
    drained_until = min(t_fault + DRAIN_TIMEOUT_S - 0.5, t_exit)
    during_drain = [a for a in b.load.since(t_fault) if a.sent < drained_until]
    drain_failed = sum(1 for a in during_drain if a.status != 200)
    wait(lambda: b.load.answered_since(t_exit, 6), 30, "answers while the EPP is down")
    b.stack.restart("epp")
    t_repair = time.monotonic()
    result = Result("EPP SIGTERM", "SIGTERM epp serve (drain), restarted after it exited")
    result.returned_s, result.returned = first_routed(b, t_repair)
    result.note = (
        f"exit {code} after {t_exit - t_fault:.1f} s (drain_timeout_s {DRAIN_TIMEOUT_S:g}: a"
        f" routing stream is always open); {drain_failed} of {len(during_drain)} sent in its"
        f" first {DRAIN_TIMEOUT_S - 0.5:g} s (or until the exit) failed, the rest after the stop"
    )
    result.extra |= {"drain_failed": drain_failed, "drain_sent": len(during_drain)}
    result.extra["exit_code"] = -1 if code is None else code
    return b.finish(result, t_fault)


def first_routed(b: Bench, after: float) -> tuple[float, bool]:
    try:
        wait(
            lambda: any(b.watch.times(p.name, after) for p in b.stack.pods),
            b.settings.return_max_s,
            "a decision",
        )
    except TimeoutError:
        return b.settings.return_max_s, False
    return min(t for p in b.stack.pods for t in b.watch.times(p.name, after)) - after, True


# -- precise mode -------------------------------------------------------------------------


def token_ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 29_000 + 100 for i in range(n)]


def divergence(stack: FaultStack, pod: str) -> tuple[int, int]:
    """(blocks the engine holds and the index does not, blocks the index holds and the
    engine does not). The engine is read before and after the index: a block stored or
    removed meanwhile (the load goes on) counts in neither."""
    before = engine_blocks(stack, pod)
    index = index_blocks(stack, pod)
    after = engine_blocks(stack, pod)
    return len((before & after) - index), len(index - (before | after))


def engine_blocks(stack: FaultStack, pod: str) -> set[str]:
    status, _, body = http(f"{stack.pod(pod).base_url}/sim/kv")
    if status != 200:
        raise RuntimeError(f"GET /sim/kv on {pod}: {status}")
    return set(json.loads(body)["blocks"])


def index_blocks(stack: FaultStack, pod: str) -> set[str]:
    """The engine blocks the EPP's index holds for the pod (`/debug/index`, every page)."""
    url = stack.epp_url(f"/debug/index?pod={pod}&limit=10000")
    blocks: set[str] = set()
    after = ""
    while True:
        status, _, body = http(url + after)
        if status != 200:
            raise RuntimeError(f"GET {url}: {status} {body[:200]!r}")
        view = json.loads(body)
        blocks.update(view.get("engine_blocks", []))
        if "next" not in view:
            return blocks
        after = f"&after={view['next']}"


def kv_state(stack: FaultStack, pod: str) -> dict:
    status, _, body = http(stack.epp_url("/debug/endpoints"))
    if status != 200:
        return {}
    return {e["name"]: e for e in json.loads(body)}[pod].get("kv_events") or {}


_direct_prompts = itertools.count(10_000)


def direct_requests(stack: FaultStack, pod: str, count: int) -> None:
    """Requests straight to the pod (new prompts: each stores blocks, so each publishes)."""
    for _ in range(count):
        ids = token_ids(next(_direct_prompts), 4 * BLOCK)
        body = {"model": MODEL, "prompt": ids, "max_tokens": 2}
        status = http(f"{stack.pod(pod).base_url}/v1/completions", body)[0]
        if status != 200:
            raise RuntimeError(f"direct request to {pod}: {status}")


def kv_fault(name: str, fault: str, switch: str | None) -> Callable[[Bench], Result]:
    """`switch` on /sim/fail kv_events for 6 batches of pod-1's, or (None) a publisher
    restart; then a batch more, and the index must agree with the engine again."""

    def run(b: Bench) -> Result:
        stack = b.stack
        wait(lambda: divergence(stack, FAULTY) == (0, 0), 30, "pod-1 in step before the fault")
        before = kv_state(stack, FAULTY)
        t_fault = time.monotonic()
        if switch is None:
            direct_requests(stack, FAULTY, 3)
            http(f"{stack.pod(FAULTY).base_url}/sim/kv/restart", method="POST")
        else:
            stack.sim_fail([FAULTY], {"kv_events": switch})
            direct_requests(stack, FAULTY, 6)
            stack.sim_fail([FAULTY], {"kv_events": None})
        direct_requests(stack, FAULTY, 1)
        result = Result(name, fault)
        at_repair = sum(divergence(stack, FAULTY))
        try:
            result.converged_s = wait(
                lambda: divergence(stack, FAULTY) == (0, 0),
                b.settings.converge_max_s,
                "agreement",
            )
            result.divergence = 0
        except TimeoutError:
            result.missing, result.phantom = divergence(stack, FAULTY)
            result.divergence = result.missing + result.phantom
        after = kv_state(stack, FAULTY)
        moved = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in ("gaps", "restarts", "resyncs", "replayed")
            if after.get(k, 0) != before.get(k, 0)
        }
        result.extra = {k: float(v) for k, v in moved.items()}
        result.note = "subscriber: " + (
            ", ".join(f"{k} +{v}" for k, v in moved.items()) or "no change"
        )
        if result.divergence:
            result.note += f"; {at_repair} blocks apart just after the repair"
        return b.finish(result, t_fault)

    return run


SCENARIOS: dict[str, tuple[bool, Callable[[Bench], Result]]] = {
    # name -> (precise stack, scenario)
    "crash": (False, crash),
    "hang": (
        False,
        pod_fault(
            "hang",
            "pod-1 accepts every request, never answers",
            {"generation": "hang"},
            {"generation": None},
        ),
    ),
    "slow": (
        False,
        pod_fault(
            "slow", "pod-1 starts every request 2 s late", {"delay_ms": 2000}, {"delay_ms": 0}
        ),
    ),
    "flap": (False, flap),
    "5xx": (
        False,
        pod_fault(
            "5xx spell",
            "pod-1 answers every request 500",
            {"generation": "500"},
            {"generation": None},
        ),
    ),
    "partition": (False, partition),
    "frozen": (False, frozen),
    "epp-kill": (False, epp_kill),
    "epp-drain": (False, epp_drain),
    "kv-loss": (True, kv_fault("KV-event loss", "6 of pod-1's batches lost", "drop")),
    "kv-reorder": (True, kv_fault("KV reorder", "pod-1's batches swapped in pairs", "reorder")),
    "kv-duplicates": (True, kv_fault("KV duplicates", "pod-1's batches sent twice", "duplicate")),
    "kv-restart": (True, kv_fault("publisher restart", "pod-1's publisher restarts", None)),
}


@contextlib.contextmanager
def bench(precise: bool, settings: Settings, work_dir: Path | None = None) -> Iterator[Bench]:
    """A stack of 4 pods with the steady load and the decision watch running."""
    stack = FaultStack(
        pods=4,
        sim_args=FAST_PODS,
        epp_config_yaml=PRECISE_CONFIG if precise else APPROX_CONFIG,
        kv_events=precise,
        work_dir=work_dir,
        log_level="warning",
    )
    with stack:
        if precise:
            wait(
                lambda: all((kv_state(stack, p.name) or {}).get("attached") for p in stack.pods),
                30,
                "every pod precise",
            )

            def body_for(n: int) -> dict:
                ids = token_ids(n % 8, 6 * BLOCK) + token_ids(50_000 + n, 20)
                return {"model": MODEL, "prompt": ids, "max_tokens": 2}
        else:

            def body_for(n: int) -> dict:
                return {"model": MODEL, "prompt": f"request {n} " * 30, "max_tokens": 2}

        load = Load(f"{stack.envoy_url}/v1/completions", body_for, settings.rate, settings.threads)
        watch = DecisionWatch(stack).start()
        load.start()
        try:
            b = Bench(stack, load, watch, settings)
            began = time.monotonic()
            wait(lambda: all(watch.times(p.name, began) for p in stack.pods), 30, "warm-up")
            yield b
        finally:
            load.stop()
            watch.stop()


def run_scenarios(names: Sequence[str], settings: Settings) -> list[Result]:
    results: list[Result] = []
    for precise in (False, True):
        chosen = [n for n in names if SCENARIOS[n][0] is precise]
        if not chosen:
            continue
        with bench(precise, settings) as b:
            for name in chosen:
                print(f"[faults] {name} ...", flush=True)
                result = SCENARIOS[name][1](b)
                print(f"[faults] {format_row(result)}", flush=True)
                results.append(result)
    return results


# -- the report ----------------------------------------------------------------------------

HEADER = (
    "| scenario | fault | moved away (s) | returned (s) | failed / sent | "
    "index divergence after recovery | note |\n|---|---|---:|---:|---|---|---|"
)


def _seconds(value: float | None, ok: bool | None, never: str) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" if ok else never


def format_row(r: Result) -> str:
    failed = ", ".join(f"{n} x {s}" for s, n in sorted(r.failed.items()))
    failed_cell = f"{r.failed_total} / {r.sent}" + (f" ({failed})" if failed else "")
    div = "—"
    if r.divergence is not None:
        div = (
            f"0 blocks (agreed after {r.converged_s:.1f} s)"
            if r.divergence == 0
            else (
                f"{r.divergence} blocks after {Settings.converge_max_s:.0f} s "
                f"({r.missing} held by the engine only, {r.phantom} by the index only)"
            )
        )
    moved = _seconds(r.moved_away_s, r.moved_away, "no (still routed)")
    returned = _seconds(r.returned_s, r.returned, "no")
    return f"| {r.name} | {r.fault} | {moved} | {returned} | {failed_cell} | {div} | {r.note} |"


def table(results: Sequence[Result]) -> str:
    return "\n".join([HEADER, *(format_row(r) for r in results)])


def command(names: Sequence[str]) -> str:
    only = "" if list(names) == list(SCENARIOS) else f" --only {','.join(names)}"
    return f".venv/bin/epp bench faults{only}"


def page(results: Sequence[Result], names: Sequence[str], settings: Settings) -> str:
    return f"""# Fault suite

`epp bench faults` ([src/epp_bench/picker/faults.py](../../src/epp_bench/picker/faults.py)):
one scenario per fault through the real stack (Envoy 1 worker, `epp serve`, 4 simulated
pods on 127.0.0.1), under a steady client load of {settings.rate:.0f} requests/s through
Envoy (completions, 2 tokens, a 5 s client timeout). Faults hit `pod-1` unless said.

- **moved away**: from the fault to the last request the EPP routed to the faulty pod
  (its per-pod decision counter, read every {POLL_S} s: the resolution). The fault is held
  until the pod got nothing for {settings.quiet_s:.0f} s while the others got requests
  (or {settings.fault_max_s:.0f} s: "no").
- **returned**: from the repair (the switch off; a restarted process answering) to the
  first request routed back to it.
- **failed / sent**: the client's requests sent from the fault to the end of the scenario,
  by status (0: no answer within 5 s).
- **index divergence** (precise mode, KV events): blocks the EPP's index and the engine's
  pool (`GET /sim/kv`) disagree on for the pod after recovery, and when they agreed again.

Contracts (bounds generous enough for a loaded machine) are asserted by
`tests/e2e/test_fault_suite.py`; what the EPP promises for each fault is in
[reliability.md](../reliability.md#fault-suite).

Measured on a 2-core machine shared with other work (one run; expect ±0.3 s):

{table(results)}

Reproduce:

```sh
{command(names)} --out docs/benchmarks/faults.md
```
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="epp bench faults", description=__doc__)
    parser.add_argument("--only", help=f"comma-separated among: {', '.join(SCENARIOS)}")
    parser.add_argument("--rate", type=float, default=Settings.rate, help="client requests/s")
    parser.add_argument("--out", type=Path, help="write the markdown page here")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    names = list(SCENARIOS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    settings = Settings(rate=args.rate)
    results = run_scenarios(names, settings)
    print()
    print(table(results))
    print(f"\nrerun: {command(names)}")
    if args.out:
        args.out.write_text(page(results, names, settings))
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    return 0
