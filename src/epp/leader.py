"""Leader election on a coordination.k8s.io/v1 Lease: one active replica among several.

What the upstream EPP does with `--ha-enable-leader-election` (llm-d router v0.10.0:
controller-runtime's leader election, `LeaderElectionResourceLock: leases`, ID
`epp-<pool namespace>-<pool name>.llm-d.ai` in the pool's namespace, released on cancel,
controller-runtime's default timings), re-implemented on the `kubernetes` client with
client-go's rules (tools/leaderelection):

- A candidate reads the Lease. None: it creates one naming itself (409: someone else won).
  Held by another whose record has not changed for `leaseDurationSeconds` of *our* clock
  (the time we first saw that record, never the holder's timestamps, so clock skew
  between nodes does not matter), or held by nobody (released): it writes itself in,
  with the resourceVersion it read, so of two candidates only one update succeeds (409).
- The leader renews (the same update) every `retry_period_s`. Its leadership ends at
  once when `renew_deadline_s` passed since the start of its last successful renewal
  (`is_leader` reads the clock, so it is false even while a call hangs), or when the
  Lease names another holder. renew_deadline_s < lease_duration_s: a candidate takes the
  Lease no earlier than lease_duration_s after it saw the last renewal, which started
  after ours, so two replicas never both believe they lead (on clocks that run at the
  same rate).
- `stop()` releases the Lease (holder "", duration 1 s, as client-go's release): a
  candidate takes it at its next try instead of waiting for expiry.

Unlike controller-runtime, a replica that loses the Lease keeps running as a candidate
(not Ready) instead of exiting; the upstream EPP is restarted by the kubelet for that.

The API calls (`epp.leases`) block: they run on one daemon thread, never on the event
loop. `tick()` is one round of that thread's loop, public so that tests drive it on an
injected clock.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import structlog

from epp.leases import (
    LEASE_API_VERSION,
    KubernetesLeases,
    LeaseApi,
    LeaseConflict,
    Obj,
    micro_time,
)

log = structlog.get_logger("epp.leader")

__all__ = [
    "KubernetesLeases",
    "LeaderElectionError",
    "LeaderElector",
    "LeaseApi",
    "LeaseConflict",
    "LeaseTimings",
    "holder_identity",
    "lease_name",
    "micro_time",
]

# A Pod of a Deployment is named <deployment>-<replicaset hash>-<suffix>: upstream's
# extractDeploymentName.
_DEPLOYMENT_POD = re.compile(r"^(.+)-[a-z0-9]+-[a-z0-9]+$")


class LeaderElectionError(ValueError):
    """Leader election cannot start (no Lease name can be derived); one line."""


@dataclass(frozen=True, slots=True)
class LeaseTimings:
    """controller-runtime's defaults, which the upstream EPP keeps."""

    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("lease timings need 0 < retry period < renew deadline < duration")


def lease_name(namespace: str, pool_name: str | None, pod_name: str | None = None) -> str:
    """Upstream's Lease name, `epp-<namespace>-<pool>.llm-d.ai`; without a pool (standalone
    discovery) the EPP Deployment's name, from its Pod's name, in place of the pool's."""
    if pool_name:
        return f"epp-{namespace}-{pool_name}.llm-d.ai"
    match = _DEPLOYMENT_POD.match(pod_name or "")
    if match is None:
        raise LeaderElectionError(
            f"leader election without an InferencePool names its Lease after the EPP's "
            f"Deployment, read from POD_NAME ({pod_name or 'unset'}): set POD_NAME or "
            "discovery.leader_election_lease"
        )
    return f"epp-{namespace}-{match.group(1)}.llm-d.ai"


def holder_identity(pod_name: str | None = None) -> str:
    """The Pod's name (or the host's) and a random suffix, as controller-runtime's: a
    restarted process is a new holder and waits like any candidate."""
    base = pod_name or os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4()}"


class LeaderElector:
    def __init__(
        self,
        api: LeaseApi,
        namespace: str,
        name: str,
        identity: str,
        *,
        timings: LeaseTimings | None = None,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        rng: random.Random | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timings = timings or LeaseTimings()
        self._on_change = on_change
        self._clock = clock
        self._wall = wall_clock
        self._rng = rng or random.Random()
        # One attribute, read by any thread: the monotonic time our leadership ends
        # (start of the last successful renewal + renew deadline); None: not leading.
        self._leading_until: float | None = None
        self._reported = False  # what on_change was last told
        self._observed: Obj | None = None  # the Lease's spec as last read
        self._observed_at = 0.0  # our clock when that spec was first seen
        self._lease: Obj | None = None  # the Lease as last read or written
        self._failing = False  # an API error was logged; the next success is logged
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        until = self._leading_until
        return until is not None and self._clock() < until

    # --- the thread ---------------------------------------------------------------------

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="epp-leader-election", daemon=True)
        self._thread.start()
        log.info(
            "leader_election_started",
            lease=f"{self.namespace}/{self.name}",
            identity=self.identity,
            lease_duration_s=self.timings.lease_duration_s,
            renew_deadline_s=self.timings.renew_deadline_s,
            retry_period_s=self.timings.retry_period_s,
        )

    async def stop(self, release: bool = True) -> None:
        """Stop competing; with `release`, give the Lease up if we hold it. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        await asyncio.to_thread(self._finish, release)

    def _finish(self, release: bool) -> None:
        if self._thread is not None:
            self._thread.join(self.timings.renew_deadline_s)
        if release:
            self.release()
        self._leading_until = None
        self._report()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.tick()
            period = self.timings.retry_period_s
            if not self.is_leader:
                # A little jitter so that candidates do not ask in step (client-go
                # jitters up to 1.2 periods; less here, so a released Lease is taken
                # within about one period).
                period *= 1.0 + 0.1 * self._rng.random()
            self._stopping.wait(period)

    # --- one round ------------------------------------------------------------------------

    def tick(self) -> None:
        """Try to acquire or renew once; update `is_leader` and call back on a change."""
        started = self._clock()
        try:
            won = self._try_acquire_or_renew(started)
        except LeaseConflict:
            won = False
        except Exception as exc:  # the API server unreachable, 403, 5xx: try again later
            won = False
            if not self._failing:
                self._failing = True
                log.warning(
                    "leader_lease_error",
                    lease=f"{self.namespace}/{self.name}",
                    error=f"{type(exc).__name__}: {exc}"[:300],
                    leader=self.is_leader,
                )
        else:
            if self._failing:
                self._failing = False
                log.info("leader_lease_reachable", lease=f"{self.namespace}/{self.name}")
        if won:
            self._leading_until = started + self.timings.renew_deadline_s
        elif self._leading_until is not None and not self.is_leader:
            self._leading_until = None  # the renew deadline passed
        self._report()

    def _report(self) -> None:
        leader = self.is_leader
        if leader == self._reported:
            return
        self._reported = leader
        log.info(
            "leader_elected" if leader else "leader_lost",
            lease=f"{self.namespace}/{self.name}",
            identity=self.identity,
        )
        if self._on_change is not None:
            try:
                self._on_change(leader)
            except Exception:
                log.exception("leader_callback_failed")

    def _timeout(self) -> float:
        """A call may take at most half the renew deadline, so that one hung call leaves
        time for another try."""
        return self.timings.renew_deadline_s / 2

    def _spec(self, acquire_time: str, transitions: int, now: str) -> Obj:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": math.ceil(self.timings.lease_duration_s),
            "acquireTime": acquire_time,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _try_acquire_or_renew(self, now: float) -> bool:
        stamp = micro_time(self._wall())
        lease = self.api.get(self.namespace, self.name, self._timeout())
        if lease is None:
            body = {
                "apiVersion": LEASE_API_VERSION,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(stamp, 0, stamp),
            }
            self._remember(self.api.create(self.namespace, body, self._timeout()), now)
            return True
        spec: Obj = lease.get("spec") or {}
        self._remember(lease, now)
        holder = spec.get("holderIdentity") or ""
        if holder != self.identity:
            if self._leading_until is not None:
                self._leading_until = None  # another holder: not leading, whatever the clock
            duration = spec.get("leaseDurationSeconds") or self.timings.lease_duration_s
            if holder and now < self._observed_at + duration:
                return False  # held, and renewed within its duration as we saw it
        if holder == self.identity:
            acquired = spec.get("acquireTime") or stamp
            transitions = int(spec.get("leaseTransitions") or 0)
        else:
            acquired = stamp
            transitions = int(spec.get("leaseTransitions") or 0) + 1
        body = dict(lease)
        body["spec"] = {**spec, **self._spec(acquired, transitions, stamp)}
        self._remember(self.api.replace(self.namespace, self.name, body, self._timeout()), now)
        return True

    def _remember(self, lease: Obj, now: float) -> None:
        spec = lease.get("spec") or {}
        if spec != self._observed:
            self._observed = spec
            self._observed_at = now
        self._lease = lease

    def release(self) -> bool:
        """Give the Lease up if we hold it: holder "", duration 1 s. True if released."""
        try:
            lease = self.api.get(self.namespace, self.name, self._timeout())
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return False
            self._leading_until = None  # from now on we do not lead, whatever the write does
            stamp = micro_time(self._wall())
            spec = dict(lease.get("spec") or {})
            spec.update(
                holderIdentity="", leaseDurationSeconds=1, acquireTime=stamp, renewTime=stamp
            )
            self.api.replace(self.namespace, self.name, {**lease, "spec": spec}, self._timeout())
        except Exception as exc:  # the Lease then expires on its own
            log.warning(
                "leader_release_failed",
                lease=f"{self.namespace}/{self.name}",
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            return False
        log.info("leader_released", lease=f"{self.namespace}/{self.name}", identity=self.identity)
        return True
