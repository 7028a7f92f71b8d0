"""A worker never outlives its node (the watchdog on its own, without the parent-death signal),
and stats pages are private, and swept only when their owner no longer runs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from app.worker.stats import StatsPage, page_path, sweep_stale_pages
from tests.helpers import ROOT, process_alive

# a parent that starts a child guarded by the watchdog alone, prints the child's pid, and waits;
# POLL: the child has no pidfd (an older kernel), so its watchdog polls
_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import os, time\\n"
    "from app.worker import lifeline\\n"
    "if POLL: lifeline._pidfd = lambda pid: None\\n"
    "lifeline.start_watchdog(os.getppid())\\n"
    "print(os.getpid(), flush=True)\\n"
    "while True: pass\\n"], stdout=sys.stdout)
child.wait()
"""


@pytest.mark.parametrize("poll", [False, True], ids=["pidfd", "polling"])
def test_the_watchdog_kills_a_busy_child_whose_parent_died(poll: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.replace("POLL", str(poll))], stdout=subprocess.PIPE, env=env)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert process_alive(child)
    parent.kill()  # SIGKILL: the parent gets no chance to clean up
    parent.wait()
    deadline = time.monotonic() + 10  # a liveness bound, not a measurement
    while process_alive(child):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)


def test_pages_are_private_and_only_dead_owners_pages_are_swept(tmp_path) -> None:
    mine = StatsPage(page_path(tmp_path, "abc123"), create=True)
    assert stat.S_IMODE(mine.path.stat().st_mode) == 0o600
    assert mine.path.name.startswith(f"tensorwasm-worker-{os.getpid()}.")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    stale = tmp_path / f"tensorwasm-worker-{dead_pid}.12345-def456.stats"
    reused = tmp_path / f"tensorwasm-worker-{os.getpid()}.1-0a0a0a.stats"  # our pid, another start
    other = tmp_path / "something-else.stats"
    for path in (stale, reused, other):
        path.write_bytes(b"\0" * 32)
    assert sweep_stale_pages(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.path.name, other.name])
    mine.close(unlink=True)
    assert not mine.path.exists()
