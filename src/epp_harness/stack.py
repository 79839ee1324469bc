"""The local stack as child processes: simulated pods, the EPP (optional) and Envoy.

`LocalStack` starts them in dependency order, waits until each one answers, and stops them
in reverse order. Every child runs in its own session (so its own process group): a stop
signals the whole group, so nothing a child started survives it, and Ctrl-C in the
terminal reaches only this process, which then shuts the children down in order.

Used by the end-to-end tests, the demo (`epp demo` / `epp run`) and the benchmarks that run
real processes (`epp bench live`, `overhead`, `pause`, `pressure`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Literal

import yaml

from epp.envoy_config import BodyMode, Completions, Mode, render
from epp.serving.workers import free_ports as epp_free_ports

HOST = "127.0.0.1"
DEFAULT_MODEL = "sim-llama-8b"
_POLL_INTERVAL_S = 0.05
_LOG_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1

StackMode = Literal["epp", "round_robin", "least_request"]


class StackError(RuntimeError):
    """A process of the stack could not be started or did not become ready."""


def free_ports(count: int, host: str = HOST) -> list[int]:
    """`count` distinct ports that were free a moment ago (the product's own picker, which
    `epp serve --workers` uses for its loopback peer ports): another program may still take
    one before the child binds it (unavoidable, rare)."""
    return epp_free_ports(count, host)


def free_port(host: str = HOST) -> int:
    return free_ports(1, host)[0]


def envoy_binary() -> str:
    """The envoy executable: on PATH, or next to this interpreter (the venv's bin/)."""
    found = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    if found is None:
        raise StackError("envoy not found on PATH nor next to the Python interpreter")
    return found


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True, slots=True)
class PodInfo:
    name: str
    address: str  # "ip:port"
    # The pod's vLLM KV-event publisher and replay sockets ("tcp://ip:port"), when it
    # publishes (LocalStack(kv_events=True)); pods on one host need ports of their own.
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None

    @property
    def labels(self) -> dict[str, str]:
        """The endpoint labels that tell the EPP where this pod's KV events are: a
        templated endpoint cannot name several pods sharing one host (README, Precise mode)."""
        labels: dict[str, str] = {}
        if self.kv_events_endpoint is not None:
            labels["kv_events_endpoint"] = self.kv_events_endpoint
        if self.kv_replay_endpoint is not None:
            labels["kv_events_replay"] = self.kv_replay_endpoint
        return labels

    @property
    def base_url(self) -> str:
        return f"http://{self.address}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"


@dataclass(slots=True)
class _Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook that makes the child get SIGKILL if this process dies (Linux only).

    Process groups cover every orderly exit; this covers the disorderly one (the demo
    itself SIGKILLed). The kernel ties it to the forking *thread*, so it is only safe
    from the main thread: a child started from a worker thread would die with that thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return hook


# Loopback only: an http_proxy in the environment must not see these probes.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_status(url: str, timeout_s: float = 1.0) -> int | None:
    """The HTTP status of a GET, or None if nothing answered."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


class LocalStack:
    """Pods, EPP (in mode "epp") and Envoy on 127.0.0.1, as a sync context manager.

    After `start()`: `envoy_url`, `envoy_admin_url`, `pods`, `epp_grpc_port`,
    `epp_metrics_url` (None unless mode "epp"), `log_paths` (process name -> log file),
    `pids` (process name -> pid of the live ones).

    With `kv_events=True` every pod publishes vLLM KV events on ports of its own
    (`--kv-events-port`, `--kv-replay-port`), and the EPP's endpoints file names them in
    each pod's labels, so the EPP (in `kv_events.mode` auto or precise) follows them.

    The EPP serves its default transport, TLS with a self-signed certificate, and Envoy
    dials it so (`epp envoy-config`'s default); `epp_plaintext=True` runs both in
    plaintext (`epp serve --plaintext`, `--epp-plaintext`). Envoy reports how requests
    ended over its gRPC access log, or with `completions="observer"` the observer filter.
    """

    def __init__(
        self,
        *,
        pods: int = 4,
        mode: StackMode = "epp",
        body_mode: BodyMode = "FULL_DUPLEX_STREAMED",
        sim_args: Sequence[str] = (),
        epp_args: Sequence[str] = (),
        epp_config_yaml: str | None = None,
        work_dir: str | Path | None = None,
        listen_port: int | None = None,
        model: str = DEFAULT_MODEL,
        startup_timeout_s: float = 30.0,
        stop_timeout_s: float = 5.0,
        envoy_concurrency: int = 1,
        log_level: str = "info",
        kv_events: bool = False,
        epp_plaintext: bool = False,
        completions: Completions = "access_log",
    ) -> None:
        if pods < 1:
            raise ValueError(f"pods must be at least 1, got {pods}")
        if mode not in ("epp", "round_robin", "least_request"):
            raise ValueError(f"unknown mode {mode!r}")
        self.mode: Mode = mode
        self.body_mode: BodyMode = body_mode
        self.completions: Completions = completions
        self.pod_count = pods
        self.sim_args = list(sim_args)
        self.epp_args = list(epp_args)
        self.epp_config_yaml = epp_config_yaml
        self.model = model
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.envoy_concurrency = envoy_concurrency
        self.log_level = log_level
        self.kv_events = kv_events
        self.epp_plaintext = epp_plaintext
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir is not None else None
        self._listen_port = listen_port

        self.pods: list[PodInfo] = []
        self.envoy_url = ""
        self.envoy_admin_url = ""
        self.epp_grpc_port: int | None = None
        self.epp_metrics_url: str | None = None
        self.log_paths: dict[str, Path] = {}
        self._children: list[_Child] = []
        self._started = False
        self._stopped = False

    # -- public API -------------------------------------------------------------------------

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pids(self) -> dict[str, int]:
        return {c.name: c.popen.pid for c in self._children if _exit_status(c.popen) is None}

    @property
    def keeps_work_dir(self) -> bool:
        """False when the work directory is a temporary one that `stop()` removes."""
        return not self._own_work_dir

    def pod(self, name: str) -> PodInfo:
        for pod in self.pods:
            if pod.name == name:
                return pod
        raise KeyError(f"no pod named {name!r}")

    def start(self) -> None:
        """Start every process and wait until each answers; on failure stop all and raise."""
        if self._started:
            raise StackError("this LocalStack was already started")
        self._started = True
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="epp-stack-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_pods()
            if self.mode == "epp":
                self._start_epp()
            self._start_envoy()
        except BaseException as exc:
            # KeyboardInterrupt included: a half-started stack must not outlive us. After a
            # failure the logs stay, even in a temporary directory: the error points at them.
            if not isinstance(exc, KeyboardInterrupt):
                self._own_work_dir = False
            self.stop()
            raise

    def kill_pod(self, name: str) -> None:
        """SIGKILL one pod's process group (simulates a crashed pod) and reap it."""
        self.pod(name)
        for child in self._children:
            if child.name == name:
                _terminate_group(child.popen, timeout_s=0.0, first_signal=signal.SIGKILL)
                return
        raise KeyError(f"pod {name!r} is not running")

    def stop(self) -> None:
        """Stop every process, newest first: SIGTERM, then SIGKILL after the timeout.

        Idempotent. Ctrl-C / SIGTERM arriving during the stop are held back until every
        child is gone (a second Ctrl-C must not leave orphans), then re-raised.
        """
        if self._stopped:
            return
        self._stopped = True
        with _deferred_interrupts() as interrupted:
            for child in reversed(self._children):
                _terminate_group(child.popen, self.stop_timeout_s)
        if self._own_work_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        if interrupted:
            raise KeyboardInterrupt

    # -- starting ---------------------------------------------------------------------------

    def _spawn(self, name: str, argv: Sequence[str]) -> _Child:
        assert self.work_dir is not None
        log_path = self.work_dir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Held back so an interrupt cannot land between the fork and the bookkeeping: a
        # child that is not in `_children` would never be stopped.
        with _deferred_interrupts() as interrupted, open(log_path, "wb") as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.work_dir,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
            child = _Child(name, popen, log_path)
            self._children.append(child)
            self.log_paths[name] = log_path
        if interrupted:
            raise KeyboardInterrupt
        return child

    def _failure(self, child: _Child, reason: str) -> StackError:
        return StackError(
            f"{child.name} {reason} (log {child.log_path}):\n{log_tail(child.log_path)}"
        )

    def _wait_until(
        self, child: _Child, url: str, accept: Callable[[int | None], bool], what: str
    ) -> None:
        """Poll `url` until `accept(status)`; fail fast if the process exits meanwhile."""
        deadline = time.monotonic() + self.startup_timeout_s
        status: int | None = None
        while True:
            code = _exit_status(child.popen)
            if code is not None:
                raise self._failure(child, f"exited with code {code} before {what}")
            status = _http_status(url)
            if accept(status):
                return
            if time.monotonic() >= deadline:
                raise self._failure(
                    child,
                    f"not {what} after {self.startup_timeout_s:.0f} s "
                    f"(GET {url} -> {status if status is not None else 'no answer'})",
                )
            time.sleep(_POLL_INTERVAL_S)

    def pod_argv(self, pod: PodInfo) -> list[str]:
        """The command line of one simulated pod."""
        argv = [
            sys.executable, "-m", "vllm_sim",
            "--host", HOST, "--port", pod.address.rpartition(":")[2],
            "--name", pod.name, "--model", self.model,
        ]  # fmt: skip
        for flag, endpoint in (
            ("--kv-events-port", pod.kv_events_endpoint),
            ("--kv-replay-port", pod.kv_replay_endpoint),
        ):
            if endpoint is not None:
                argv += [flag, endpoint.rpartition(":")[2]]
        return argv + self.sim_args

    def plan_pods(self) -> list[PodInfo]:
        """Names and free ports of the pods: one HTTP port each, and with `kv_events` a
        publisher and a replay port each (distinct: the pods share 127.0.0.1)."""
        per_pod = 3 if self.kv_events else 1
        ports = free_ports(self.pod_count * per_pod)
        pods = []
        for index in range(self.pod_count):
            http, *kv = ports[index * per_pod : (index + 1) * per_pod]
            pod = PodInfo(f"pod-{index}", f"{HOST}:{http}")
            if kv:
                events, replay = (f"tcp://{HOST}:{port}" for port in kv)
                pod = PodInfo(pod.name, pod.address, events, replay)
            pods.append(pod)
        return pods

    def endpoints_yaml(self) -> str:
        """The EPP's endpoints file for the started pods."""
        endpoints = [
            {"name": p.name, "address": p.address, "metrics_url": p.metrics_url, "labels": p.labels}
            for p in self.pods
        ]
        return yaml.safe_dump({"endpoints": endpoints}, sort_keys=False)

    def _start_pods(self) -> None:
        starting: list[tuple[_Child, PodInfo]] = []
        # All pods boot in parallel; only then is each one waited for.
        for pod in self.plan_pods():
            starting.append((self._spawn(pod.name, self.pod_argv(pod)), pod))
        for child, pod in starting:
            self._wait_until(child, f"{pod.base_url}/health", lambda s: s == 200, "healthy")
            self.pods.append(pod)

    def _start_epp(self) -> None:
        assert self.work_dir is not None
        endpoints_path = self.work_dir / "endpoints.yaml"
        endpoints_path.write_text(self.endpoints_yaml())
        grpc_port, metrics_port = free_ports(2)
        argv = [
            sys.executable, "-m", "epp", "serve",
            "--endpoints", str(endpoints_path),
            "--grpc-host", HOST, "--grpc-port", str(grpc_port),
            "--grpc-health-port", "0",  # any free port: several stacks run side by side
            "--metrics-host", HOST, "--metrics-port", str(metrics_port),
            "--log-level", self.log_level,
        ]  # fmt: skip
        if self.epp_config_yaml is not None:
            config_path = self.work_dir / "epp-config.yaml"
            config_path.write_text(self.epp_config_yaml)
            argv += ["--config", str(config_path)]
        if self.epp_plaintext:
            argv.append("--plaintext")
        argv += self.epp_args
        child = self._spawn("epp", argv)
        base = f"http://{HOST}:{metrics_port}"
        self._wait_until(child, f"{base}/ready", lambda s: s == 200, "ready")
        self.epp_grpc_port = grpc_port
        self.epp_metrics_url = f"{base}/metrics"

    def _start_envoy(self) -> None:
        assert self.work_dir is not None
        envoy = envoy_binary()
        if self._listen_port is not None:
            listen_port, admin_port = self._listen_port, free_port()
        else:
            listen_port, admin_port = free_ports(2)
        config = render(
            mode=self.mode,
            listen_port=listen_port,
            admin_port=admin_port,
            epp_port=self.epp_grpc_port,
            pods=[p.address for p in self.pods],
            body_mode=self.body_mode,
            epp_plaintext=self.epp_plaintext,
            completions=self.completions,
        )
        config_path = self.work_dir / "envoy.yaml"
        config_path.write_text(config)
        check = subprocess.run(
            [envoy, "--mode", "validate", "-c", str(config_path)],
            capture_output=True,
            text=True,
            timeout=self.startup_timeout_s,
            check=False,
        )
        if check.returncode != 0:
            output = "\n".join((check.stdout + check.stderr).splitlines()[-_LOG_TAIL_LINES:])
            raise StackError(f"envoy rejected {config_path}:\n{output}")
        argv = [
            envoy, "-c", str(config_path),
            # Several Envoys may run at once (tests, two stacks): no shared hot-restart state.
            "--disable-hot-restart",
            # One worker: round robin is then global, and the pods keep the CPU.
            "--concurrency", str(self.envoy_concurrency),
            "--log-level", "info" if self.log_level == "debug" else "warning",
        ]  # fmt: skip
        child = self._spawn("envoy", argv)
        self.envoy_admin_url = f"http://{HOST}:{admin_port}"
        self._wait_until(child, f"{self.envoy_admin_url}/ready", lambda s: s == 200, "ready")
        self.envoy_url = f"http://{HOST}:{listen_port}"
        # Through the listener end to end (and, in mode "epp", through the EPP): any answer
        # from a pod proves the routing chain works.
        self._wait_until(
            child, f"{self.envoy_url}/v1/models", lambda s: s == 200, "routing to the pods"
        )


def _exit_status(popen: subprocess.Popen[bytes]) -> int | None:
    """The child's exit code (negative: killed by that signal), or None while it runs.

    It does not reap the child: its pid, which is also its process group id, stays
    reserved until `_terminate_group` has signalled the whole group.
    """
    if popen.returncode is not None:
        return popen.returncode
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return popen.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _terminate_group(
    popen: subprocess.Popen[bytes], timeout_s: float, first_signal: int = signal.SIGTERM
) -> None:
    """Signal the child's process group, SIGKILL it after `timeout_s`, then reap the child.

    The leader is watched without being reaped, so the group id cannot be reused by an
    unrelated process before the final SIGKILL: stragglers of the group die too.
    """
    if popen.returncode is not None:
        return
    pgid = popen.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, first_signal)
    deadline = time.monotonic() + timeout_s
    while _exit_status(popen) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    popen.wait()


@contextlib.contextmanager
def _deferred_interrupts() -> Iterator[list[int]]:
    """Hold SIGINT/SIGTERM back for the block (main thread only); yields the ones that came."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def sigterm_as_keyboard_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread, like Ctrl-C.

    So `kill <pid>` of the demo runs the same try/finally cleanup as Ctrl-C does.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
