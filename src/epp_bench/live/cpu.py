"""CPU accounting from /proc: per process group, for the whole machine, and for ourselves.

Why /proc and not psutil: a process's `utime + stime` (fields 14 and 15 of
/proc/<pid>/stat) is exactly the CPU it consumed, the kernel keeps it for free, and reading
it costs no dependency. Every stack process runs in its own session, so summing a process
group covers whatever a process forked (sglang-router's Python launcher and its Rust
threads, Envoy's workers are threads anyway). Resolution is one clock tick (10 ms), well
below what a run of seconds needs.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    pgrp: int
    cpu_s: float  # utime + stime


def parse_proc_stat(text: str) -> ProcStat:
    """Parse one /proc/<pid>/stat line.

    The command name (field 2) is in parentheses and may itself contain spaces and
    parentheses, so the fields are counted from the *last* closing parenthesis.
    """
    pid_part, _, rest = text.partition(" (")
    fields = rest[rest.rindex(")") + 2 :].split()
    # After the name: state(3) ppid(4) pgrp(5) ... utime(14) stime(15); fields[0] is state.
    pgrp = int(fields[2])
    utime, stime = int(fields[11]), int(fields[12])
    return ProcStat(pid=int(pid_part), pgrp=pgrp, cpu_s=(utime + stime) / _CLOCK_TICKS)


def read_proc_stat(pid: int) -> ProcStat | None:
    try:
        return parse_proc_stat((_PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def process_groups_cpu_s(pgids: Iterable[int]) -> dict[int, float]:
    """CPU seconds used so far by the live members of each process group (one /proc pass)."""
    wanted = {pgid: 0.0 for pgid in pgids}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = read_proc_stat(int(entry.name))
        if stat is not None and stat.pgrp in wanted:
            wanted[stat.pgrp] += stat.cpu_s
    return wanted


@dataclass(frozen=True, slots=True)
class MachineCpu:
    """Cumulative CPU time of all cores from /proc/stat's first line."""

    busy_s: float
    total_s: float


def parse_machine_cpu(text: str) -> MachineCpu:
    for line in text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:]]
            # user nice system idle iowait irq softirq steal [guest guest_nice]: guests are
            # already inside user/nice, so only the first eight add up to the total.
            first = values[:8]
            idle = first[3] + (first[4] if len(first) > 4 else 0)
            total = sum(first)
            return MachineCpu(busy_s=(total - idle) / _CLOCK_TICKS, total_s=total / _CLOCK_TICKS)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def machine_cpu() -> MachineCpu:
    return parse_machine_cpu((_PROC / "stat").read_text())


def self_cpu_s() -> float:
    """CPU seconds of this process (the benchmark client) plus its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    """CPU seconds per component (process-group leaders by name), the machine and us."""

    components: dict[str, float]
    machine: MachineCpu
    client_s: float


def snapshot(groups: Mapping[str, int]) -> CpuSnapshot:
    """`groups`: component name -> pid of its process-group leader."""
    by_pgid = process_groups_cpu_s(groups.values())
    return CpuSnapshot(
        components={name: by_pgid[pgid] for name, pgid in groups.items()},
        machine=machine_cpu(),
        client_s=self_cpu_s(),
    )


@dataclass(frozen=True, slots=True)
class CpuUsage:
    """What a run cost, in cores (CPU seconds / wall seconds), by component.

    `foreign_cores` is machine time that none of ours used: other programs on the box. A
    run with a large value was measured on a busy machine and says so.
    """

    wall_s: float
    cores: dict[str, float]
    client_cores: float
    machine_busy_cores: float
    machine_cores: int
    foreign_cores: float

    def to_dict(self) -> dict[str, object]:
        return {
            "wall_s": self.wall_s,
            "cores": self.cores,
            "client_cores": self.client_cores,
            "machine_busy_cores": self.machine_busy_cores,
            "machine_cores": self.machine_cores,
            "foreign_cores": self.foreign_cores,
        }


def usage_between(before: CpuSnapshot, after: CpuSnapshot, wall_s: float) -> CpuUsage:
    wall = max(wall_s, 1e-9)
    cores = {
        name: max(0.0, after.components.get(name, 0.0) - start) / wall
        for name, start in before.components.items()
    }
    client = max(0.0, after.client_s - before.client_s) / wall
    elapsed_total = after.machine.total_s - before.machine.total_s
    machine_cores = os.cpu_count() or 1
    busy = (
        (after.machine.busy_s - before.machine.busy_s) / elapsed_total * machine_cores
        if elapsed_total > 0
        else 0.0
    )
    return CpuUsage(
        wall_s=wall_s,
        cores=cores,
        client_cores=client,
        machine_busy_cores=busy,
        machine_cores=machine_cores,
        foreign_cores=max(0.0, busy - sum(cores.values()) - client),
    )
