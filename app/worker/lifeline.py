"""A worker never outlives the node that started it, even while a guest runs.

Two independent guards: the kernel's parent-death signal (SIGKILL as soon as the thread that
started us exits), and a watchdog thread that kills the process once the node's process is gone.
The watchdog watches the node itself, not merely our parent, so it holds however the worker was
started. Neither needs the guest loop to reach a check: wasmtime runs guest code with the GIL
released.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None if no such process runs.

    With the pid it names one process for good: a pid reused later has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (not Linux): the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "0"
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # a zombie runs no more
        return None
    return fields[19]  # field 22 of proc(5); the split starts at field 3


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent (thread) exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
            return False
    except (OSError, AttributeError):
        return False
    return True


def _pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when `pid` exits (Linux 5.3+), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # an older kernel, another system, or already gone
        return None


def start_watchdog(node_pid: int, interval_s: float = 0.2) -> threading.Thread:
    """Kill this process within `interval_s` of `node_pid` no longer running: at once where the
    kernel can tell us (a pidfd, waited on without waking), else by polling its start time."""
    born = start_time(node_pid)
    if born is None:  # gone already (it died before we got here)
        _die()
    pidfd = _pidfd(node_pid)
    if pidfd is not None and start_time(node_pid) != born:  # the pid named another process by then
        _die()

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the node has exited (a zombie too)
            _die()
        while True:
            if start_time(node_pid) != born:
                _die()
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, name="node-watchdog", daemon=True)
    thread.start()
    return thread


def die_with_parent(node_pid: int) -> None:
    """Die with the node process `node_pid` (our parent, or our parent's parent through a fork
    server): the parent-death signal for the direct parent, the watchdog for the node."""
    arm_parent_death_signal()
    start_watchdog(node_pid)
