"""A worker never outlives the process that started it, even while a guest runs.

Two independent guards: the kernel's parent-death signal (SIGKILL as soon as the thread that
started us exits), and a watchdog thread that kills the process once its parent is gone. Neither
needs the guest loop to reach a check: the guest runs in wasmtime with the GIL released.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def start_watchdog(parent_pid: int, interval_s: float = 0.2) -> threading.Thread:
    """Kill this process within `interval_s` of `parent_pid` no longer being its parent."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                _die()
            time.sleep(interval_s)

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def die_with_parent(parent_pid: int) -> None:
    arm_parent_death_signal()
    # The parent may have died before the signal was armed: then we were already re-parented.
    if os.getppid() != parent_pid:
        _die()
    start_watchdog(parent_pid)
