"""A node's CPU per process role over a run, read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.bench.cpu import Role, RoleCpu, Sample, per_role, role_of, sample

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def test_roles_come_from_each_processs_command_line() -> None:
    assert role_of([sys.executable, "-m", "app.cli", "serve"], root=True) == Role.SUPERVISOR
    assert role_of([sys.executable, "-m", "app.node.front", "--fd", "12"], root=False) == Role.FRONT
    assert role_of([sys.executable, "-m", "app.worker.forkserver", "--fd", "18"], root=False) == Role.WORKER
    assert role_of([sys.executable, "-m", "app.sandbox.child"], root=False) == Role.OTHER


def test_a_process_tree_is_sampled_and_its_cpu_split_per_call_by_role() -> None:
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn, "app.node.front"])  # its argv names it a front
    try:
        before = sample(os.getpid())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = sample(os.getpid())
            if child.pid in after and after[child.pid].cpu_s >= 0.3:
                break
            time.sleep(0.05)
        assert after[os.getpid()].role == Role.SUPERVISOR  # the root of the tree
        assert after[child.pid].role == Role.FRONT
        use = per_role(before, after, calls=1000, seconds=1.0)
        assert use[Role.FRONT].processes == 1
        assert use[Role.FRONT].per_call_us >= 250  # 0.3 s over 1,000 calls, less what `before` saw
    finally:
        child.kill()
        child.wait()
    assert sample(-1) == {}  # no such process: nothing


def test_per_role_counts_a_process_started_in_between_from_zero() -> None:
    before = {1: Sample(Role.SUPERVISOR, 10.0), 2: Sample(Role.WORKER, 5.0)}
    after = {1: Sample(Role.SUPERVISOR, 10.5), 2: Sample(Role.WORKER, 5.0), 3: Sample(Role.WORKER, 0.25)}
    use = per_role(before, after, calls=500, seconds=2.0)
    assert use[Role.SUPERVISOR] == RoleCpu(Role.SUPERVISOR, 1, 1000.0, 0.25)
    assert use[Role.WORKER] == RoleCpu(Role.WORKER, 1, 500.0, 0.125)  # the idle one used nothing
