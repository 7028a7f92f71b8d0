"""Where a node's CPU goes, per process role, over a benchmark run: read from `/proc` (Linux;
elsewhere nothing is reported). Tells which process is the wall: a role whose busiest process
is near a whole core limits the node; none near it means the calls wait on each other instead."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

PROC = Path("/proc")


class Role(StrEnum):
    SUPERVISOR = "supervisor"  # the node's first process (`tensorwasm serve`)
    FRONT = "fronts"
    WORKER = "workers"  # the fork server and the workers forked from it
    OTHER = "other"  # compile sandboxes


def role_of(cmdline: list[str], root: bool) -> Role:
    if root:
        return Role.SUPERVISOR
    if "app.node.front" in cmdline:
        return Role.FRONT
    if "app.worker.forkserver" in cmdline or "app.worker.main" in cmdline:
        return Role.WORKER
    return Role.OTHER


@dataclass(frozen=True)
class Sample:
    role: Role
    cpu_s: float  # user + system, since the process started


def children(proc: Path = PROC) -> dict[int, list[int]]:
    """Every process's children, by parent pid, as /proc lists them now."""
    kids: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _tree(root: int, proc: Path) -> Iterator[int]:
    kids, todo = children(proc), [root]
    while todo:
        pid = todo.pop()
        yield pid
        todo.extend(kids.get(pid, []))


def sample(root: int, proc: Path = PROC) -> dict[int, Sample]:
    """The CPU time of `root` and every process under it, by pid (empty without /proc)."""
    if not (proc / str(root)).exists():
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, Sample] = {}
    for pid in _tree(root, proc):
        try:
            fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / str(pid) / "cmdline").read_text().split("\0")
        except OSError:
            continue
        out[pid] = Sample(role_of(cmdline, pid == root), (int(fields[11]) + int(fields[12])) / tick)
    return out


@dataclass(frozen=True)
class RoleCpu:
    role: Role
    processes: int  # that used any CPU in the run
    per_call_us: float
    busiest: float  # the busiest process's share of one core over the run


def per_role(before: dict[int, Sample], after: dict[int, Sample], calls: int, seconds: float) -> dict[Role, RoleCpu]:
    """CPU per call and the busiest process of each role, between two samples (a process started
    in between counts from zero)."""
    used: dict[Role, list[float]] = {}
    for pid, s in after.items():
        spent = s.cpu_s - (before[pid].cpu_s if pid in before else 0.0)
        if spent > 0:
            used.setdefault(s.role, []).append(spent)
    return {
        role: RoleCpu(role, len(v), sum(v) / max(calls, 1) * 1e6, max(v) / seconds if seconds > 0 else 0.0)
        for role, v in used.items()
    }


@dataclass(frozen=True)
class HostCpu:
    """This machine's CPU time since boot, all cores (/proc/stat; zeros where there is none):
    busy, and stolen by the hypervisor from a virtual machine's cores."""

    total_s: float = 0.0
    busy_s: float = 0.0
    steal_s: float = 0.0

    @classmethod
    def read(cls, path: str = "/proc/stat") -> HostCpu:
        tick = os.sysconf("SC_CLK_TCK")
        try:
            with open(path) as f:
                fields = [float(x) / tick for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return cls()
        user, nice, system, idle, iowait, irq, softirq, steal = fields + [0.0] * (8 - len(fields))
        return cls(sum(fields), user + nice + system + irq + softirq, steal)

    def __sub__(self, other: HostCpu) -> HostCpu:
        return HostCpu(self.total_s - other.total_s, self.busy_s - other.busy_s, self.steal_s - other.steal_s)
